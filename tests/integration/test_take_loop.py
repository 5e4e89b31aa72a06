"""The take loop waits when there is nothing it may take: no busy loop, no missed wake-up.

A real poll-mode DeliveryDaemon (its source counted, nothing else changed)
delivers while every kind it knows is held back: by a rate-limit pause, or at
its own concurrency cap while the process has room. A wake-up arrives
meanwhile (the outcome just recorded, a NOTIFY for a new intent). Expected:
the source is asked again about once per poll interval, not thousands of
times, and what waits starts as soon as the pause ends or a slot frees.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

from deliverers.testing import RecordingDeliverer
from outbox import EffectStatus, Outbox
from outbox.delivery import Delivery, Outcome, Retry, Succeeded
from outbox.delivery.leases import Leases
from outbox.delivery.settings import DeliverySettings
from outbox.delivery.sources import PollSource
from outbox.storage.async_store import AsyncStore, ClaimedEffect
from tests.support import DaemonThread, wait_for


class CountedPollSource(PollSource):
    """The real poll source; counts how often the daemon asks it for work."""

    takes = 0

    async def take(self, leases: Leases) -> list[ClaimedEffect]:
        self.takes += 1
        return await super().take(leases)


def counted(
    settings: DeliverySettings,
) -> tuple[list[CountedPollSource], Callable[[AsyncStore], CountedPollSource]]:
    made: list[CountedPollSource] = []

    def make(store: AsyncStore) -> CountedPollSource:
        made.append(CountedPollSource(store, settings))
        return made[0]

    return made, make


def intend(ob: Outbox, kind: str, n: int, step: str = "s") -> None:
    run = ob.start_run("agent", "1")
    run.transaction(step, lambda tx: [tx.intend(kind, {"n": i}) for i in range(n)] and None)


def all_succeeded(ob: Outbox, n: int) -> bool:
    found = ob.effects(limit=1000)
    return len(found) == n and all(e.status == EffectStatus.SUCCEEDED for e in found)


def test_a_rate_limit_pause_is_waited_out_not_spun_through(ob: Outbox, dsn: str) -> None:
    intend(ob, "k.rl", 3)
    calls: list[float] = []

    def limited(delivery: Delivery) -> Outcome:
        calls.append(time.monotonic())
        if len(calls) == 1:
            return Retry("HTTP 429", after=2.0, rate_limited=True)
        return Succeeded()

    settings = DeliverySettings(concurrency=1, retry_base_seconds=0.01, poll_seconds=1.0)
    made, make = counted(settings)
    deliverer = RecordingDeliverer("k.rl", outcome=limited)
    with DaemonThread(dsn, {"k.rl": deliverer}, settings=settings, source=make):
        wait_for(lambda: all_succeeded(ob, 3), timeout=30, message="delivery")
    assert all(t - calls[0] >= 2.0 for t in calls[1:]), "the pause held"
    # About one claim per poll second over a few seconds; a busy loop makes thousands.
    assert made[0].takes < 60, f"{made[0].takes} takes while paused"


def test_a_kind_at_its_cap_waits_for_a_slot_not_in_a_loop(ob: Outbox, dsn: str) -> None:
    intend(ob, "k.cap", 4)
    release = threading.Event()
    started: list[float] = []

    def slow(delivery: Delivery) -> Outcome:
        started.append(time.monotonic())
        release.wait(30)
        return Succeeded()

    settings = DeliverySettings(concurrency=50, poll_seconds=1.0)
    made, make = counted(settings)
    capped = RecordingDeliverer("k.cap", outcome=slow)
    capped.concurrency = 1
    with DaemonThread(dsn, {"k.cap": capped}, settings=settings, source=make):
        wait_for(lambda: len(started) == 1, message="the first call")
        intend(ob, "k.cap", 2, step="more")  # a NOTIFY while the kind is at its cap
        time.sleep(2.0)
        assert made[0].takes < 30, f"{made[0].takes} takes while the kind was at its cap"
        release.set()
        wait_for(lambda: all_succeeded(ob, 6), timeout=30, message="delivery")
    gaps = [b - a for a, b in itertools.pairwise(started)]
    assert max(gaps[1:]) < 0.5, f"the next call starts as a slot frees: {gaps}"
