"""The retry policy: full-jitter backoff, Retry-After as a floor, a cap on attempts."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox.delivery import Failed, Outcome, Retry, Succeeded, Unknown
from outbox.delivery.attempt import Decision, decide
from outbox.models import AttemptOutcome, EffectStatus
from outbox.retry import RetryPolicy


class TopOfRange(random.Random):
    """An rng pinned at the top of its range: ``uniform(0, c)`` returns ``c``, the ceiling."""

    def random(self) -> float:
        return 1.0


class BottomOfRange(random.Random):
    """An rng pinned at the bottom: ``uniform(0, c)`` returns 0."""

    def random(self) -> float:
        return 0.0


def ceiling(policy: RetryPolicy, attempt: int) -> float:
    """The documented bound min(cap, base * 2^(n-1)), computed exactly (no float overflow)."""
    exact = Fraction(policy.base_seconds) * 2 ** max(0, attempt - 1)
    return float(min(Fraction(policy.cap_seconds), exact))


POLICY = RetryPolicy(base_seconds=0.5, cap_seconds=300.0, max_attempts=10)


def test_defaults() -> None:
    assert RetryPolicy() == POLICY


def test_ceiling_doubles_from_base_until_the_cap() -> None:
    top = TopOfRange()
    ceilings = [POLICY.backoff(n, top) for n in range(1, 13)]
    assert ceilings == [0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]


def test_attempt_zero_is_treated_like_the_first() -> None:
    assert POLICY.backoff(0, TopOfRange()) == POLICY.backoff(1, TopOfRange()) == 0.5


def test_full_jitter_can_be_zero() -> None:
    """Full jitter (not 'equal jitter'): the lower bound is 0, not half the ceiling."""
    assert POLICY.backoff(8, BottomOfRange()) == 0.0


def test_seeded_rng_is_reproducible_and_uniform_in_range() -> None:
    first = [POLICY.backoff(n, random.Random(7)) for n in range(1, 15)]
    again = [POLICY.backoff(n, random.Random(7)) for n in range(1, 15)]
    assert first == again
    expected = [random.Random(7).uniform(0, ceiling(POLICY, n)) for n in range(1, 15)]
    assert first == expected


def test_jitter_spreads_over_the_whole_range() -> None:
    """Many draws at one attempt cover [0, ceiling]: near 0, near the top, mean about half."""
    rng = random.Random(1234)
    top = ceiling(POLICY, 6)  # 16 s
    draws = [POLICY.backoff(6, rng) for _ in range(5000)]
    assert all(0.0 <= d <= top for d in draws)
    assert min(draws) < 0.02 * top
    assert max(draws) > 0.98 * top
    assert abs(sum(draws) / len(draws) - top / 2) < 0.05 * top
    assert len(set(draws)) > 4900  # jittered, not a fixed schedule


def test_without_an_rng_the_module_random_is_used_within_bounds() -> None:
    draws = [POLICY.backoff(3) for _ in range(200)]
    assert all(0.0 <= d <= 2.0 for d in draws)
    assert len(set(draws)) > 1


def test_huge_attempt_numbers_do_not_overflow() -> None:
    """An operator's `retry` raises max_attempts past 1000; 2**1024 must not crash the daemon."""
    top = TopOfRange()
    for attempt in (1024, 1025, 5000, 10**6):
        assert POLICY.backoff(attempt, top) == 300.0
    assert RetryPolicy(base_seconds=10.0).backoff(1025, top) == 300.0
    decision = decide(Retry("busy"), attempt=2000, max_attempts=5000, policy=POLICY, rng=top)
    assert decision == Decision(
        EffectStatus.PENDING, AttemptOutcome.RETRY, delay=300.0, error="busy"
    )


def test_zero_base_means_retry_immediately() -> None:
    policy = RetryPolicy(base_seconds=0.0)
    assert policy.backoff(5, TopOfRange()) == 0.0
    assert policy.backoff(5000, TopOfRange()) == 0.0


@given(
    base=st.floats(min_value=0.0, max_value=1000.0),
    cap=st.floats(min_value=0.0, max_value=1e6),
    attempt=st.integers(min_value=0, max_value=5000),
    seed=st.integers(min_value=0, max_value=2**32),
)
def test_backoff_is_within_zero_and_the_capped_exponential(
    base: float, cap: float, attempt: int, seed: int
) -> None:
    policy = RetryPolicy(base_seconds=base, cap_seconds=cap)
    delay = policy.backoff(attempt, random.Random(seed))
    assert 0.0 <= delay <= ceiling(policy, attempt)
    assert policy.backoff(attempt, TopOfRange()) == pytest.approx(ceiling(policy, attempt))


@given(
    attempt=st.integers(min_value=1, max_value=2000),
    extra=st.integers(min_value=1, max_value=100),
    after=st.none() | st.floats(min_value=0.0, max_value=86400.0),
    seed=st.integers(min_value=0, max_value=2**32),
)
def test_a_retry_below_the_limit_waits_at_least_retry_after(
    attempt: int, extra: int, after: float | None, seed: int
) -> None:
    decision = decide(
        Retry("busy", after=after),
        attempt=attempt,
        max_attempts=attempt + extra,
        policy=POLICY,
        rng=random.Random(seed),
    )
    assert decision.status == "pending" and decision.outcome == "retry"
    assert decision.delay >= (after or 0.0)
    assert decision.delay <= max(after or 0.0, ceiling(POLICY, attempt))


def test_retry_below_the_limit_is_pending_with_jittered_delay() -> None:
    outcome = Retry("HTTP 503", detail={"status": 503})
    decision = decide(outcome, attempt=3, max_attempts=10, policy=POLICY, rng=random.Random(3))
    assert decision == Decision(
        EffectStatus.PENDING,
        AttemptOutcome.RETRY,
        delay=random.Random(3).uniform(0, 2.0),
        error="HTTP 503",
        detail={"status": 503},
    )


def test_retry_after_is_a_floor_over_a_smaller_jitter() -> None:
    """The sink's Retry-After wins when it is longer than the drawn backoff."""
    decision = decide(
        Retry("429", after=120.0), attempt=2, max_attempts=10, policy=POLICY, rng=TopOfRange()
    )
    assert decision.delay == 120.0  # the jitter could be at most 1 s


def test_retry_after_beyond_the_cap_is_still_honoured() -> None:
    decision = decide(
        Retry("429", after=3600.0), attempt=20, max_attempts=30, policy=POLICY, rng=TopOfRange()
    )
    assert decision.delay == 3600.0


def test_a_longer_backoff_wins_over_a_short_retry_after() -> None:
    """Retry-After is a floor, not a replacement: a larger jittered backoff is kept."""
    decision = decide(
        Retry("429", after=1.0), attempt=9, max_attempts=10, policy=POLICY, rng=TopOfRange()
    )
    assert decision.delay == 128.0  # 0.5 * 2**8
    low = decide(
        Retry("429", after=1.0), attempt=9, max_attempts=10, policy=POLICY, rng=BottomOfRange()
    )
    assert low.delay == 1.0


def test_retry_at_the_attempt_limit_fails_with_the_last_reason() -> None:
    decision = decide(
        Retry("HTTP 503", after=30.0, detail={"status": 503}),
        attempt=5,
        max_attempts=5,
        policy=POLICY,
    )
    assert decision == Decision(
        EffectStatus.FAILED,
        AttemptOutcome.RETRY,  # the attempt itself was a retry; the effect is what failed
        delay=0.0,
        error="gave up after 5 attempts: HTTP 503",
        detail={"status": 503},
    )


def test_retry_past_the_attempt_limit_also_fails() -> None:
    decision = decide(Retry("timeout"), attempt=12, max_attempts=10, policy=POLICY)
    assert decision.status == "failed"
    assert decision.error == "gave up after 12 attempts: timeout"


def test_max_attempts_one_gives_up_on_the_first_retry() -> None:
    decision = decide(Retry("busy"), attempt=1, max_attempts=1, policy=POLICY)
    assert (decision.status, decision.error) == ("failed", "gave up after 1 attempts: busy")


def test_the_attempt_before_the_limit_is_still_retried() -> None:
    decision = decide(Retry("busy"), attempt=4, max_attempts=5, policy=POLICY)
    assert decision.status == "pending"


def test_succeeded_records_the_result_and_ignores_the_attempt_limit() -> None:
    decision = decide(Succeeded({"id": 7}), attempt=99, max_attempts=1, policy=POLICY)
    assert decision == Decision(EffectStatus.SUCCEEDED, AttemptOutcome.SUCCEEDED, result={"id": 7})


def test_failed_stops_at_once_with_its_reason() -> None:
    decision = decide(
        Failed("HTTP 400", detail={"body": "bad"}), attempt=1, max_attempts=10, policy=POLICY
    )
    assert decision == Decision(
        EffectStatus.FAILED, AttemptOutcome.FAILED, error="HTTP 400", detail={"body": "bad"}
    )


def test_unknown_goes_to_an_operator_without_a_delay() -> None:
    decision = decide(
        Unknown("timed out", detail={"t": 10}), attempt=1, max_attempts=10, policy=POLICY
    )
    assert decision == Decision(
        EffectStatus.UNKNOWN, AttemptOutcome.UNKNOWN, error="timed out", detail={"t": 10}
    )


@pytest.mark.parametrize("attempt", [1, 10, 50])
def test_terminal_outcomes_never_become_retries(attempt: int) -> None:
    """Only Retry consults the attempt count; the others map the same at any attempt."""
    cases: list[tuple[Outcome, str]] = [
        (Succeeded(), "succeeded"),
        (Failed("x"), "failed"),
        (Unknown("x"), "unknown"),
    ]
    for outcome, status in cases:
        decision = decide(outcome, attempt=attempt, max_attempts=10, policy=POLICY)
        assert decision.status == status
        assert decision.delay == 0.0


def test_decision_is_immutable() -> None:
    decision = decide(Succeeded(), attempt=1, max_attempts=1, policy=POLICY)
    with pytest.raises(AttributeError):
        decision.status = EffectStatus.FAILED  # type: ignore[misc]
