"""A cancel does not call "never happened" an effect whose lost attempt may have reached its sink.

The reconciler puts a lost attempt of an idempotent kind back to ``pending``
for redelivery (the sink dedups the key). If its run is cancelled before that
redelivery, the effect has not started again, yet the lost call may have taken
effect: recording it ``cancelled`` would be untrue, and the compensation would
skip it (G3). It becomes ``unknown``, and the run's stop waits for an operator.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import psycopg
import pytest

from deliverers.http import HttpDeliverer
from deliverers.testing import IdempotentHttpSink, RecordingDeliverer
from outbox import (
    AttemptOutcome,
    EffectStatus,
    Outbox,
    Run,
    RunStateError,
    RunStatus,
    StepTransaction,
)
from outbox.delivery import Deliverer, Failed, Retry, Succeeded
from outbox.ids import RELAY_OWNER_PREFIX
from outbox.shards import shard_of
from outbox.storage.async_store import AsyncStore, Completion
from outbox.storage.engine import make_async_engine
from tests.integration.test_reconcile import lose_attempts, run_reconcile
from tests.support import DaemonThread, wait_for


def booking(ob: Outbox, dsn: str) -> Run:
    """A run whose flight booking was lost mid-call and put back for redelivery."""
    run = ob.start_run("travel", "1", {"trip": "LIS"})
    run.transaction(
        "book-flight",
        lambda tx: tx.intend("k.book", {"item": "flight"}, compensate=("k.refund", {})) and None,
    )
    lose_attempts(dsn, ["k.book"])
    report = run_reconcile(dsn, {"k.book": RecordingDeliverer("k.book")})
    assert report.counts == {"redeliver": 1}
    return run


def swept_until(ob: Outbox, run: Run, status: RunStatus) -> None:
    """Run the stopping sweep until the run is ``status``, as a daemon would."""
    wait_for(
        lambda: ob.advance_stopping_runs() is not None and ob.run(run.id).status == status,
        timeout=20,
    )


def effect_of(ob: Outbox, run: Run, item: str) -> Any:
    (effect,) = [e for e in ob.effects(run_id=run.id) if e.payload.get("item") == item]
    return effect


def test_a_cancelled_effect_that_a_lost_attempt_may_have_done_is_unknown_until_an_operator_says(
    ob: Outbox, dsn: str
) -> None:
    run = booking(ob, dsn)
    # another run's effect with an answer in its log: it says nothing about this one
    other = ob.start_run("travel", "1", {"trip": "car"})
    other.transaction("rent", lambda tx: tx.intend("k.car", {}) and None)
    with DaemonThread(dsn, {"k.car": RecordingDeliverer("k.car")}):
        wait_for(lambda: [e.status for e in ob.effects(kind="k.car")] == ["succeeded"])
    run.transaction(
        "book-hotel",
        lambda tx: tx.intend("k.book", {"item": "hotel"}, compensate=("k.refund", {})) and None,
    )

    assert ob.cancel(run.id, "customer changed plans") == RunStatus.CANCELLING
    flight, hotel = effect_of(ob, run, "flight"), effect_of(ob, run, "hotel")
    assert hotel.status == EffectStatus.CANCELLED, "never attempted: it did not happen"
    assert flight.status == EffectStatus.UNKNOWN
    assert "may have taken effect" in (flight.last_error or "")
    last = ob.store.attempts(flight.id)[-1]
    assert (last.outcome, last.attempt) == (AttemptOutcome.UNKNOWN, 1)
    ob.advance_stopping_runs()
    assert ob.run(run.id).status == RunStatus.CANCELLING, "the stop waits for the operator"

    ob.resolve_effect(
        flight.id, outcome="succeeded", note="the airline has the booking", operator="ops"
    )
    refund = RecordingDeliverer("k.refund")
    with DaemonThread(dsn, {"k.refund": refund}):
        swept_until(ob, run, RunStatus.COMPENSATED)
    assert len(refund.deliveries) == 1, "the flight it did book is refunded"
    assert effect_of(ob, run, "flight").status == EffectStatus.COMPENSATED


def test_an_operator_who_finds_it_never_happened_lets_the_cancel_end(ob: Outbox, dsn: str) -> None:
    run = booking(ob, dsn)
    assert ob.cancel(run.id, "stop") == RunStatus.CANCELLING
    flight = effect_of(ob, run, "flight")
    ob.resolve_effect(flight.id, outcome="failed", note="no such booking", operator="ops")
    ob.advance_stopping_runs()
    assert ob.run(run.id).status == RunStatus.CANCELLED


def test_a_retry_answer_of_the_redelivery_leaves_the_doubt(ob: Outbox, dsn: str) -> None:
    run = booking(ob, dsn)
    # An idempotent kind answers "try again" for a call it could not send as for
    # one whose fate it cannot tell (a timeout after sending): no word on the lost one.
    busy = RecordingDeliverer("k.book", outcome=lambda d: Retry("timed out", after=3600))
    with DaemonThread(dsn, {"k.book": busy}):
        wait_for(lambda: len(busy.deliveries) == 1, message="the redelivery was answered")
        wait_for(lambda: effect_of(ob, run, "flight").status == EffectStatus.PENDING)

    assert ob.cancel(run.id, "stop") == RunStatus.CANCELLING
    assert effect_of(ob, run, "flight").status == EffectStatus.UNKNOWN


def test_an_operator_s_word_on_the_lost_attempt_leaves_no_doubt(ob: Outbox, dsn: str) -> None:
    # a kind whose sink cannot dedup: the lost attempt is unknown at once, and the
    # operator, having checked, says it did not happen and sends it again
    run = ob.start_run("travel", "1", {"trip": "BCN"})
    run.transaction("book-flight", lambda tx: tx.intend("k.blind", {"item": "flight"}) and None)
    lose_attempts(dsn, ["k.blind"])
    blind: dict[str, Deliverer] = {"k.blind": RecordingDeliverer("k.blind", idempotent=False)}
    assert run_reconcile(dsn, blind).counts == {"unknown": 1}
    flight = effect_of(ob, run, "flight")
    ob.resolve_effect(flight.id, outcome="retry", note="no such booking", operator="ops")

    assert ob.cancel(run.id, "stop") == RunStatus.CANCELLED
    assert effect_of(ob, run, "flight").status == EffectStatus.CANCELLED


def test_an_attempt_lost_at_its_cap_then_retried_by_an_operator_is_still_in_doubt(
    ob: Outbox, dsn: str
) -> None:
    run = ob.start_run("travel", "1", {"trip": "MAD"})
    run.transaction(
        "book-flight", lambda tx: tx.intend("k.book", {"item": "flight"}, max_attempts=1) and None
    )
    lose_attempts(dsn, ["k.book"])
    assert run_reconcile(dsn, {"k.book": RecordingDeliverer("k.book")}).counts == {"failed": 1}
    flight = effect_of(ob, run, "flight")
    ob.retry_effect(flight.id, operator="ops", note="one more go")

    assert ob.cancel(run.id, "stop") == RunStatus.CANCELLING
    assert effect_of(ob, run, "flight").status == EffectStatus.UNKNOWN


def test_an_effect_of_a_stopping_run_is_not_sent_again_by_an_operator(ob: Outbox, dsn: str) -> None:
    run = booking(ob, dsn)
    assert ob.cancel(run.id, "stop") == RunStatus.CANCELLING
    flight = effect_of(ob, run, "flight")
    with pytest.raises(RunStateError, match=r"its run is cancelling.*as succeeded .* or as failed"):
        ob.resolve_effect(flight.id, outcome="retry", note="send it", operator="ops")
    assert effect_of(ob, run, "flight").status == EffectStatus.UNKNOWN
    ob.resolve_effect(flight.id, outcome="failed", note="it did not happen", operator="ops")
    # a failed effect of a stopping run is not retried either
    other = booking(ob, dsn)
    other.transaction("fail", lambda tx: tx.intend("k.fail", {}) and None)
    with DaemonThread(
        dsn, {"k.fail": RecordingDeliverer("k.fail", outcome=lambda d: Failed("no"))}
    ):
        wait_for(lambda: [e.status for e in ob.effects(kind="k.fail")] == ["failed"])
    assert ob.cancel(other.id, "stop") == RunStatus.CANCELLING
    (failed,) = ob.effects(kind="k.fail")
    with pytest.raises(RunStateError, match="its run is cancelling"):
        ob.retry_effect(failed.id, operator="ops")
    assert ob.effect(failed.id).status == EffectStatus.FAILED


def test_a_doubted_effect_the_relay_held_is_not_given_back_by_its_release(
    ob: Outbox, dsn: str
) -> None:
    run = booking(ob, dsn)
    # a relay claimed it again (a newer attempt) and has not published it yet
    flight = effect_of(ob, run, "flight")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE outbox_effects SET status = 'dispatched', attempt = 2,"
            " lease_owner = 'relay:r1', lease_expires_at = now() + interval '1 minute'"
            " WHERE id = %s",
            [flight.id],
        )
    assert ob.cancel(run.id, "stop") == RunStatus.CANCELLING
    assert (ob.effect(flight.id).status, ob.effect(flight.id).attempt) == (
        EffectStatus.UNKNOWN,
        3,
    ), "its attempt 2 (the relay's) is spent"

    async def give_back() -> Any:
        store = AsyncStore(make_async_engine(dsn))
        try:
            undone = Completion(
                flight.id,
                2,
                "pending",
                "released",
                error="not published",
                shard=shard_of(flight.id),
            )
            return await store.complete("relay:r1", [undone])
        finally:
            await store.dispose()

    assert asyncio.run(give_back()) == [(flight.id, "stale")]
    assert ob.effect(flight.id).status == EffectStatus.UNKNOWN


def test_an_attempt_lost_after_the_cancel_leaves_its_effect_unknown_not_cancelled(
    ob: Outbox, dsn: str
) -> None:
    """The usual way in: the call is in flight at the cancel, and its deliverer dies."""
    run = ob.start_run("travel", "1", {"trip": "OPO"})
    run.transaction(
        "book-flight",
        lambda tx: tx.intend("k.book", {"item": "flight"}, compensate=("k.refund", {})) and None,
    )
    lose_attempts(dsn, ["k.book"])
    assert ob.cancel(run.id, "stop") == RunStatus.CANCELLING, "an in-flight call finishes first"
    assert run_reconcile(dsn, {"k.book": RecordingDeliverer("k.book")}).counts == {"redeliver": 1}
    ob.advance_stopping_runs()
    assert effect_of(ob, run, "flight").status == EffectStatus.UNKNOWN
    assert ob.run(run.id).status == RunStatus.CANCELLING


def test_a_relay_s_lost_dispatch_made_no_call_and_leaves_no_doubt(ob: Outbox, dsn: str) -> None:
    run = ob.start_run("travel", "1", {"trip": "FAO"})
    run.transaction("book-flight", lambda tx: tx.intend("k.book", {"item": "flight"}) and None)
    lose_attempts(dsn, ["k.book"], owner=f"{RELAY_OWNER_PREFIX}gone")
    assert run_reconcile(dsn, {"k.book": RecordingDeliverer("k.book")}).counts == {"redeliver": 1}
    assert ob.cancel(run.id, "stop") == RunStatus.CANCELLED
    assert effect_of(ob, run, "flight").status == EffectStatus.CANCELLED


def test_a_compensation_of_a_stopping_run_may_be_sent_again(ob: Outbox, dsn: str) -> None:
    # its compensations are the stop's own work: an operator who finds the refund
    # never happened sends it again
    run = ob.start_run("travel", "1", {"trip": "LIS"})
    run.transaction(
        "book-flight",
        lambda tx: tx.intend("k.book", {"item": "flight"}, compensate=("k.refund", {})) and None,
    )
    with DaemonThread(dsn, {"k.book": RecordingDeliverer("k.book")}):
        wait_for(lambda: effect_of(ob, run, "flight").status == EffectStatus.SUCCEEDED)
    assert ob.cancel(run.id, "stop") == RunStatus.COMPENSATING
    (refund,) = ob.effects(kind="k.refund")
    with psycopg.connect(dsn, autocommit=True) as conn:  # its call was lost, say
        conn.execute(
            "UPDATE outbox_effects SET status = 'unknown', attempt = 1 WHERE id = %s", [refund.id]
        )
    ob.resolve_effect(refund.id, outcome="retry", note="no refund yet", operator="ops")
    sink = RecordingDeliverer("k.refund")
    with DaemonThread(dsn, {"k.refund": sink}):
        swept_until(ob, run, RunStatus.COMPENSATED)
    assert len(sink.deliveries) == 1


def test_a_late_retry_answer_of_a_lost_attempt_does_not_make_it_due(ob: Outbox, dsn: str) -> None:
    # in flight at the cancel; its lease ran out and the reconciler put it back
    # (held: never due while its run stops); then the lost attempt's own late answer,
    # "retry now", lands on the pending row: it must not make it due either
    run = ob.start_run("travel", "1", {"trip": "ZRH"})
    effect_id = run.transaction("book", lambda tx: str(tx.intend("k.book", {"n": 1}).id))
    lose_attempts(dsn, ["k.book"])
    assert ob.cancel(run.id, "stop") == RunStatus.CANCELLING
    assert run_reconcile(dsn, {"k.book": RecordingDeliverer("k.book")}).counts == {"redeliver": 1}

    async def late_retry() -> Any:
        store = AsyncStore(make_async_engine(dsn))
        try:
            late = Completion(uuid.UUID(effect_id), 1, "pending", "retry", error="busy", delay=0)
            return await store.complete("dead-deliverer", [late])
        finally:
            await store.dispose()

    assert asyncio.run(late_retry()) == [(uuid.UUID(effect_id), "retry")]
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT status, available_at > now() + interval '1 year' FROM outbox_effects"
            " WHERE id = %s",
            [effect_id],
        ).fetchone()
    assert row == ("pending", True), "held for the stopping sweep, not due"
    ob.advance_stopping_runs()
    assert ob.effect(effect_id).status == EffectStatus.UNKNOWN  # the retry answered nothing


def test_an_original_in_doubt_found_while_compensating_is_waited_for_and_undone(
    ob: Outbox, dsn: str
) -> None:
    # The hotel booking failed, so the cancel compensates the flight only; then a
    # put-back that raced the cancelling pass leaves the hotel pending after a lost
    # attempt (written here by hand). The compensating pass must not end the run:
    # the hotel may have been booked.
    run = ob.start_run("travel", "1", {"trip": "VIE"})
    for item in ("flight", "hotel"):

        def book_it(tx: StepTransaction, item: str = item) -> None:
            tx.intend("k.book", {"item": item}, compensate=("k.refund", {"item": item}))

        run.transaction(f"book-{item}", book_it)
    book = RecordingDeliverer(
        "k.book", outcome=lambda d: Failed("full") if d.payload["item"] == "hotel" else Succeeded()
    )
    with DaemonThread(dsn, {"k.book": book}):
        wait_for(lambda: {e.status for e in ob.effects(kind="k.book")} == {"succeeded", "failed"})
    assert ob.cancel(run.id, "stop") == RunStatus.COMPENSATING
    hotel = effect_of(ob, run, "hotel")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE outbox_effects SET status = 'pending', attempt = 2, completed_at = NULL"
            " WHERE id = %s",
            [hotel.id],
        )
        conn.execute(
            "INSERT INTO outbox_effect_attempts (effect_id, attempt, worker, outcome, detail,"
            " shard) VALUES (%s, 2, 'gone', 'expired', '{\"resolution\": \"redeliver\"}', %s)",
            [hotel.id, shard_of(run.id)],
        )
    refund = RecordingDeliverer("k.refund")
    with DaemonThread(dsn, {"k.refund": refund}):
        wait_for(lambda: len(refund.deliveries) == 1, message="the flight refunded")
        ob.advance_stopping_runs()
        assert effect_of(ob, run, "hotel").status == EffectStatus.UNKNOWN
        assert ob.run(run.id).status == RunStatus.COMPENSATING, "it waits for the operator"
        ob.resolve_effect(hotel.id, outcome="succeeded", note="it was booked", operator="ops")
        swept_until(ob, run, RunStatus.COMPENSATED)
    assert sorted(d.payload["item"] for d in refund.deliveries) == ["flight", "hotel"]


def test_a_sink_that_can_be_asked_settles_the_doubt_without_an_operator(
    ob: Outbox, dsn: str
) -> None:
    # an idempotent kind with a lookup: the reconciler asks the sink about the key
    # of each effect a cancel left unknown
    with IdempotentHttpSink() as sink:
        run = ob.start_run("travel", "1", {"trip": "OSL"})
        for n in (1, 2):

            def book(tx: StepTransaction, n: int = n) -> None:
                request = {"url": f"{sink.url}/ledger", "json": {"n": n}}
                tx.intend("http.request", request, compensate=("k.refund", {"n": n}))

            run.transaction(f"book-{n}", book)
        booked, never = sorted(
            ob.effects(kind="http.request"), key=lambda e: e.payload["json"]["n"]
        )
        # the first call reached the sink before its deliverer died; the second did not
        httpx.post(
            f"{sink.url}/ledger", json={"n": 1}, headers={"Idempotency-Key": booked.idempotency_key}
        )
        lose_attempts(dsn, ["http.request"])
        config = {"allow_private": ["127.0.0.1"], "lookup_url": sink.url + "/idempotency/{key}"}
        http: dict[str, Deliverer] = {
            "http.request": HttpDeliverer.from_config("http.request", config)
        }
        assert run_reconcile(dsn, http).counts == {"redeliver": 2}
        assert ob.cancel(run.id, "stop") == RunStatus.CANCELLING
        assert {ob.effect(booked.id).status, ob.effect(never.id).status} == {EffectStatus.UNKNOWN}
        http = {"http.request": HttpDeliverer.from_config("http.request", config)}
        report = run_reconcile(dsn, http)
    assert sorted(report.counts.items()) == [("looked_up_redeliver", 1), ("looked_up_succeeded", 1)]
    assert ob.effect(booked.id).status == EffectStatus.SUCCEEDED
    ob.advance_stopping_runs()
    assert ob.effect(never.id).status == EffectStatus.CANCELLED, "the sink said: never applied"
    refund = RecordingDeliverer("k.refund")
    with DaemonThread(dsn, {"k.refund": refund}):
        swept_until(ob, run, RunStatus.COMPENSATED)
    assert [d.payload for d in refund.deliveries] == [{"n": 1}], "only what happened is undone"
