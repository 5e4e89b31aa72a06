"""Backoff arithmetic: the retry policy's delays, and the idle backoff of claim loops.

Exponential backoff with full jitter (each wait uniform in [0, min(cap, base·2^(n-1))]).
Pure so that unit tests drive it directly; the deliverers, the reconciler and
the run workers all use it (what an outcome *means* is decided in
:mod:`outbox.delivery.attempt`).

Written here rather than taken from tenacity or backoff: those wrap a call in a
loop inside one process, while our "loop" is a row rescheduled in PostgreSQL
between processes; only the arithmetic is needed, and it is these few lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from dataclasses import dataclass

__all__ = ["IdleBackoff", "RetryPolicy", "wait_or_wake"]


async def wait_or_wake(event: asyncio.Event, seconds: float) -> bool:
    """Wait until ``event`` is set or ``seconds`` pass; True when it was set.

    ``asyncio.timeout``, not ``asyncio.wait_for``: on 3.11 the latter swallows a
    cancellation that comes as the event is set, and a stopping loop hangs. An
    event already set still yields to the loop once: ``Event.wait`` would return
    without yielding, and a caller looping on a set event would starve every
    other task.
    """
    if event.is_set():
        await asyncio.sleep(0)
        return True
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await event.wait()
    return event.is_set()


@dataclass(frozen=True)
class RetryPolicy:
    """Backoff shape; ``max_attempts`` is the default when neither effect nor deliverer sets one."""

    base_seconds: float = 0.5
    cap_seconds: float = 300.0
    max_attempts: int = 10

    def backoff(self, attempt: int, rng: random.Random | None = None) -> float:
        """Full-jitter delay before attempt ``attempt + 1``."""
        # ldexp scales exactly; a very high attempt number (an operator's ``retry``
        # can raise max_attempts past 1000) overflows to infinity, not an error.
        try:
            grown = math.ldexp(self.base_seconds, max(0, attempt - 1))
        except OverflowError:
            grown = math.inf
        ceiling = min(self.cap_seconds, grown)
        return (rng or random).uniform(0, ceiling)


class IdleBackoff:
    """How long a claim loop waits when it found too little: short after work, up to a ceiling.

    A NOTIFY usually wakes the loop sooner; this is the backstop poll. It
    doubles from ``floor`` while the loop keeps finding nothing, and drops back
    to ``floor`` as soon as it finds work.
    """

    def __init__(self, ceiling: float, floor: float = 0.01) -> None:
        self.floor = floor
        self.ceiling = max(ceiling, floor)
        self.current = floor

    def found(self, work: bool) -> float:
        """Record whether the last claim found work; return the wait before the next one."""
        wait = self.current
        self.current = self.floor if work else min(self.ceiling, self.current * 2)
        return self.floor if work else wait
