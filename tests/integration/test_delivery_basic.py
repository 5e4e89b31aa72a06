"""A daemon delivers intents once each, with their key, and records the outcome."""

from __future__ import annotations

from deliverers.testing import RecordingDeliverer
from outbox import EffectStatus, Outbox, StepTransaction
from outbox.delivery import Delivery, Failed, Outcome, Retry
from tests.support import DaemonThread, wait_for


def _intend(ob: Outbox, n: int, kind: str = "test.record") -> list[str]:
    run = ob.start_run("agent", "1")
    keys: list[str] = []

    def step(tx: StepTransaction) -> None:
        for i in range(n):
            keys.append(tx.intend(kind, {"i": i}).idempotency_key)

    run.transaction("s", step)
    return keys


def _statuses(ob: Outbox) -> dict[str, int]:
    counts: dict[str, int] = {}
    for e in ob.effects(limit=100_000):
        counts[e.status.value] = counts.get(e.status.value, 0) + 1
    return counts


def test_effects_are_delivered_once_with_their_key(ob: Outbox, dsn: str) -> None:
    keys = _intend(ob, 50)
    recorder = RecordingDeliverer()
    with DaemonThread(dsn, {"test.record": recorder}):
        wait_for(lambda: _statuses(ob) == {"succeeded": 50}, message="all succeeded")
    assert sorted(recorder.keys) == sorted(keys)
    effect = ob.effects(limit=1)[0]
    assert effect.result == {"recorded": 1} or isinstance(effect.result, dict)
    attempts = ob.store.attempts(effect.id)
    assert [(a.attempt, a.outcome) for a in attempts] == [(1, "succeeded")]


def test_retry_then_success_keeps_the_same_key(ob: Outbox, dsn: str) -> None:
    (key,) = _intend(ob, 1)
    seen: list[Delivery] = []

    def flaky(delivery: Delivery) -> Outcome:
        seen.append(delivery)
        if len(seen) < 3:
            return Retry("try again", after=0.05)
        from outbox.delivery import Succeeded

        return Succeeded({"ok": True})

    recorder = RecordingDeliverer(outcome=flaky)
    with DaemonThread(dsn, {"test.record": recorder}, retry_base_seconds=0.01):
        wait_for(lambda: _statuses(ob) == {"succeeded": 1})
    assert [d.idempotency_key for d in seen] == [key] * 3
    assert [d.attempt for d in seen] == [1, 2, 3]
    effect = ob.effects()[0]
    assert [a.outcome for a in ob.store.attempts(effect.id)] == ["retry", "retry", "succeeded"]


def test_permanent_failure_and_exhausted_retries_end_failed(ob: Outbox, dsn: str) -> None:
    _intend(ob, 1, kind="k.fail")
    _intend(ob, 1, kind="k.retry")
    failing = RecordingDeliverer("k.fail", outcome=lambda d: Failed("nope"))
    retrying = RecordingDeliverer("k.retry", outcome=lambda d: Retry("later"))
    retrying.max_attempts = 3
    with DaemonThread(dsn, {"k.fail": failing, "k.retry": retrying}, retry_base_seconds=0.01):
        wait_for(lambda: _statuses(ob) == {"failed": 2})
    by_kind = {e.kind: e for e in ob.effects()}
    assert by_kind["k.fail"].last_error == "nope"
    assert by_kind["k.retry"].last_error == "gave up after 3 attempts: later"
    assert len(retrying.deliveries) == 3
    assert by_kind["k.fail"].status == EffectStatus.FAILED
