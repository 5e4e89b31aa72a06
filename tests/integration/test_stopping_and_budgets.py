"""Cancellation with compensation in reverse order; budgets that cannot be spent twice (G7)."""

from __future__ import annotations

import threading
import time
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import select

from deliverers.testing import RecordingDeliverer
from outbox import (
    BudgetExceeded,
    EffectStatus,
    Outbox,
    Run,
    RunStatus,
    RunTerminal,
    StepTransaction,
    ValidationError,
    compensation_key,
)
from outbox.delivery import Delivery, Failed, Outcome, Retry, Succeeded
from outbox.storage.schema import budget_ledger
from tests.integration.test_cancel_in_doubt import swept_until
from tests.support import DaemonThread, wait_for


def book_trip(ob: Outbox) -> Run:
    run = ob.start_run("travel", "1", {"trip": "LIS"})
    for n, item in enumerate(["flight", "hotel", "car"]):

        def book(tx: StepTransaction, item: str = item, n: int = n) -> None:
            tx.intend("k.book", {"item": item}, compensate=("k.refund", {"item": item, "n": n}))

        run.transaction(f"book-{item}", book)
    return run


def test_cancel_compensates_succeeded_effects_in_reverse_order(ob: Outbox, dsn: str) -> None:
    run = book_trip(ob)
    book = RecordingDeliverer("k.book")
    refund = RecordingDeliverer("k.refund")
    with DaemonThread(dsn, {"k.book": book, "k.refund": refund}):
        wait_for(lambda: len(ob.effects(status="succeeded")) == 3)
        assert ob.cancel(run.id, "customer changed plans") == RunStatus.COMPENSATING
        wait_for(
            lambda: (
                ob.advance_stopping_runs() is not None
                and ob.run(run.id).status == RunStatus.COMPENSATED
            ),
            timeout=20,
        )
    assert [d.payload["item"] for d in refund.deliveries] == ["car", "hotel", "flight"]
    originals = [e for e in ob.effects(run_id=run.id) if e.compensates is None]
    refunds = [e for e in ob.effects(run_id=run.id) if e.compensates is not None]
    assert {e.status for e in originals} == {EffectStatus.COMPENSATED}
    assert {r.compensates for r in refunds} == {e.id for e in originals}
    for original in originals:
        twin = next(r for r in refunds if r.compensates == original.id)
        assert twin.idempotency_key == compensation_key(original.idempotency_key)
    assert ob.run(run.id).record.cancel_reason == "customer changed plans"
    with pytest.raises(RunTerminal, match="compensated"):
        ob.run(run.id).call("more", lambda: 1)


def test_cancel_with_nothing_to_undo_ends_cancelled_and_pending_effects_are_cancelled(
    ob: Outbox,
) -> None:
    run = ob.start_run("a", "1")
    run.transaction("s", lambda tx: tx.intend("k.x", {}) and None)
    assert ob.cancel(run.id, "not needed") == RunStatus.CANCELLED
    (effect,) = ob.effects(run_id=run.id)
    assert effect.status == EffectStatus.CANCELLED
    assert effect.last_error == "run cancelled: not needed"
    with pytest.raises(RunTerminal):
        ob.cancel(run.id, "again")


def test_cancellation_while_an_effect_is_in_flight_waits_for_it(ob: Outbox, dsn: str) -> None:
    run = book_trip(ob)
    release = threading.Event()

    def slow(delivery: Delivery) -> Outcome:
        release.wait(30)
        return Succeeded()

    book = RecordingDeliverer("k.book", outcome=slow)
    refund = RecordingDeliverer("k.refund")
    with DaemonThread(dsn, {"k.book": book, "k.refund": refund}, concurrency=1):
        wait_for(lambda: len(book.deliveries) == 1, message="one booking in flight")
        assert ob.cancel(run.id, "stop") == RunStatus.CANCELLING
        statuses = sorted(e.status.value for e in ob.effects(run_id=run.id))
        assert statuses == ["cancelled", "cancelled", "in_flight"], "in-flight one finishes"
        release.set()
        wait_for(
            lambda: (
                ob.advance_stopping_runs() is not None
                and ob.run(run.id).status == RunStatus.COMPENSATED
            ),
            timeout=20,
        )
    assert [d.payload["item"] for d in refund.deliveries] == ["flight"]


def test_a_compensation_that_fails_is_visible(ob: Outbox, dsn: str) -> None:
    run = book_trip(ob)
    refund = RecordingDeliverer(
        "k.refund",
        outcome=lambda d: (
            Failed("refund window closed") if d.payload["item"] == "hotel" else Succeeded()
        ),
    )
    with DaemonThread(dsn, {"k.book": RecordingDeliverer("k.book"), "k.refund": refund}):
        wait_for(lambda: len(ob.effects(status="succeeded")) == 3)
        ob.cancel(run.id, "stop")
        wait_for(
            lambda: (
                ob.advance_stopping_runs() is not None
                and ob.run(run.id).status == RunStatus.COMPENSATION_FAILED
            ),
            timeout=20,
        )
    failed = ob.effects(status="failed", run_id=run.id)
    assert [(e.kind, e.payload["item"], e.last_error) for e in failed] == [
        ("k.refund", "hotel", "refund window closed")
    ]
    assert len(refund.deliveries) == 3, "the others were still compensated"


def _ledger(ob: Outbox, run: Run) -> list[tuple[str, str, Decimal]]:
    with ob.engine.connect() as conn:
        rows = conn.execute(
            select(budget_ledger.c.entry, budget_ledger.c.reason, budget_ledger.c.amount)
            .where(budget_ledger.c.run_id == run.id)
            .order_by(budget_ledger.c.id)
        ).all()
    return [(r.entry, r.reason, r.amount) for r in rows]


def test_spending_is_keyed_and_over_budget_steps_commit_nothing(ob: Outbox) -> None:
    run = ob.start_run("a", "1", budget=10)

    def think(tx: StepTransaction) -> None:
        tx.spend(4, "model:gpt")
        tx.intend("k.x", {"n": 1})

    run.transaction("think", think)
    assert ob.run(run.id).transaction("think", think) is None  # replay: no second debit
    record = ob.run(run.id).record
    assert record.spent == Decimal(4)

    def think_more(tx: StepTransaction) -> None:
        tx.spend(7, "model:gpt")
        tx.intend("k.x", {"n": 2})

    with pytest.raises(BudgetExceeded) as info:
        run.transaction("think-more", think_more)
    assert info.value.remaining == 6.0
    after = ob.run(run.id)
    assert after.record.spent == Decimal(4)
    assert after.completed_steps == ["think"]
    assert len(ob.effects(run_id=run.id)) == 1, "the refused step intended nothing"
    assert _ledger(ob, run) == [("spend", "model:gpt", Decimal(4))]

    def spend_twice(tx: StepTransaction) -> None:
        tx.spend(1, "r")
        tx.spend(1, "r")

    with pytest.raises(ValidationError):
        run.transaction("bad", spend_twice)
    with pytest.raises(ValidationError):
        run.transaction("bad", lambda tx: tx.spend(-1, "r"))


def test_costly_effects_reserve_then_commit_or_release(ob: Outbox, dsn: str) -> None:
    run = ob.start_run("a", "1", budget=10)

    def buy(tx: StepTransaction) -> None:
        tx.intend("k.ok", {"n": 1}, cost=3)
        tx.intend("k.no", {"n": 2}, cost=2)

    run.transaction("buy", buy)
    record = ob.run(run.id).record
    assert (record.spent, record.reserved) == (Decimal(0), Decimal(5))
    with pytest.raises(BudgetExceeded):  # 5 reserved: 6 more does not fit
        run.transaction("buy-more", lambda tx: tx.intend("k.ok", {"n": 3}, cost=6))
    attempts: dict[str, int] = {}

    def flaky(d: Delivery) -> Outcome:
        attempts[d.kind] = attempts.get(d.kind, 0) + 1
        if d.kind == "k.no":
            return Failed("declined")
        if attempts[d.kind] < 3:
            from outbox.delivery import Retry

            return Retry("busy", after=0.01)
        return Succeeded()

    deliverers: dict[str, Any] = {
        "k.ok": RecordingDeliverer("k.ok", outcome=flaky),
        "k.no": RecordingDeliverer("k.no", outcome=flaky),
    }
    with DaemonThread(dsn, deliverers, retry_base_seconds=0.01):
        wait_for(lambda: all(e.terminal for e in ob.effects(run_id=run.id)))
    record = ob.run(run.id).record
    assert attempts["k.ok"] == 3, "retried twice"
    assert (record.spent, record.reserved) == (Decimal(3), Decimal(0)), "charged once"
    assert sorted(_ledger(ob, run)) == sorted(
        [
            ("reserve", "k.ok", Decimal(3)),
            ("reserve", "k.no", Decimal(2)),
            ("commit", "k.ok", Decimal(3)),
            ("release", "k.no", Decimal(2)),
        ]
    )


def busy_run(ob: Outbox) -> tuple[Run, RecordingDeliverer, threading.Event]:
    """A run of one effect whose first attempt answers "retry now" once released."""
    run = ob.start_run("a", "1")
    run.transaction("s", lambda tx: tx.intend("k.busy", {}) and None)
    release = threading.Event()

    def busy(delivery: Delivery) -> Outcome:
        if release.wait(30) and delivery.attempt == 1:
            return Retry("busy", after=0)
        return Succeeded()

    return run, RecordingDeliverer("k.busy", outcome=busy), release


def test_an_attempt_in_flight_at_the_cancel_that_asks_for_a_retry_is_not_sent_again(
    ob: Outbox, dsn: str
) -> None:
    # The answer puts it back to pending at once (no delay), and claims do not look
    # at runs: before the stopping sweep cancelled it, the daemon took it again.
    run, sink, release = busy_run(ob)
    # its duties (the stopping sweep among them) wait: the test sweeps by hand
    with DaemonThread(dsn, {"k.busy": sink}, poll_seconds=0.05, reconcile_seconds=60):
        wait_for(lambda: len(sink.deliveries) == 1, message="the first attempt in flight")
        assert ob.cancel(run.id, "stop") == RunStatus.CANCELLING
        release.set()
        (effect,) = ob.effects(run_id=run.id)
        wait_for(lambda: "retry" in [a.outcome for a in ob.store.attempts(effect.id)])
        time.sleep(0.5)  # the daemon's chance to take it again, before any sweep
        assert len(sink.deliveries) == 1, "not delivered again after the cancel"
        swept_until(ob, run, RunStatus.CANCELLED)
    (effect,) = ob.effects(run_id=run.id)
    assert effect.status == EffectStatus.CANCELLED
