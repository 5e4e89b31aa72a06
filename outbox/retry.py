"""The retry policy: a pure function from (attempt, outcome) to what happens next.

Exponential backoff with full jitter (each wait uniform in [0, min(cap, base·2^(n-1))]),
a sink's ``Retry-After`` as a floor, and a cap on attempts after which the effect
fails with the last reason. Pure so that unit tests drive it directly; the
daemon and the reconciler both call it.

Written here rather than taken from tenacity or backoff: those wrap a call in a
loop inside one process, while our "loop" is a row rescheduled in PostgreSQL
between processes; only the arithmetic is needed, and it is these few lines.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from outbox.delivery import Failed, Outcome, Retry, Succeeded, Unknown

__all__ = ["Decision", "RetryPolicy", "decide"]

# 2.0 ** 1024 overflows a float; past ~1000 doublings every ceiling is the cap anyway.


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


@dataclass(frozen=True)
class Decision:
    """What to record: the new status, the delay before the next attempt, why."""

    status: str  # succeeded | pending | failed | unknown
    outcome: str  # the attempt log's word: succeeded | retry | failed | unknown
    delay: float = 0.0
    result: Any = None
    error: str | None = None
    detail: Any = None


def decide(
    outcome: Outcome,
    *,
    attempt: int,
    max_attempts: int,
    policy: RetryPolicy,
    rng: random.Random | None = None,
) -> Decision:
    """Turn a deliverer's outcome for attempt number ``attempt`` into a decision."""
    if isinstance(outcome, Succeeded):
        return Decision("succeeded", "succeeded", result=outcome.result)
    if isinstance(outcome, Failed):
        return Decision("failed", "failed", error=outcome.reason, detail=outcome.detail)
    if isinstance(outcome, Unknown):
        return Decision("unknown", "unknown", error=outcome.reason, detail=outcome.detail)
    assert isinstance(outcome, Retry)
    if attempt >= max_attempts:
        return Decision(
            "failed",
            "retry",
            error=f"gave up after {attempt} attempts: {outcome.reason}",
            detail=outcome.detail,
        )
    delay = policy.backoff(attempt, rng)
    if outcome.after is not None:
        delay = max(delay, outcome.after)
    return Decision("pending", "retry", delay=delay, error=outcome.reason, detail=outcome.detail)
