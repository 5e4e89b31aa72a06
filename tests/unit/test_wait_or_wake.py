"""``wait_or_wake``: woken by its event, ended by its time, and always ended by a cancel."""

from __future__ import annotations

import asyncio
import time

from outbox.delivery.sources import wait_or_wake


def test_the_event_wakes_it_and_the_time_ends_it() -> None:
    async def main() -> tuple[float, float]:
        event = asyncio.Event()
        asyncio.get_running_loop().call_later(0.05, event.set)
        started = time.monotonic()
        await wait_or_wake(event, 30)
        woken = time.monotonic() - started
        started = time.monotonic()
        await wait_or_wake(asyncio.Event(), 0.05)
        return woken, time.monotonic() - started

    woken, timed_out = asyncio.run(main())
    assert woken < 10 and 0.04 < timed_out < 10


def test_a_cancel_as_the_event_is_set_is_not_swallowed() -> None:
    """Python 3.11's ``asyncio.wait_for`` returned normally here and the waiter lived on."""

    async def main() -> bool:
        event = asyncio.Event()
        waiting = asyncio.create_task(wait_or_wake(event, 60))
        await asyncio.sleep(0.01)
        event.set()
        waiting.cancel()
        await asyncio.wait({waiting}, timeout=5)
        return waiting.cancelled()

    assert asyncio.run(main())
