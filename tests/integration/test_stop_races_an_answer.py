"""An answer racing a pause or a cancel cannot slip an effect past the stop.

A deliverer's "try again" puts its effect back to ``pending``; the trigger that
holds the effects of a paused or stopping run reads the run as it does so. Read
before the pause or cancel commits, the run looked live: the effect came back
due, and a claim (which does not look at runs) sent it again while the run was
paused or being cancelled. The stop now locks its run's in-flight effects too,
so such an answer waits for it and then reads the stopped run.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import text

from outbox import EffectStatus, Outbox, RunStatus
from outbox.runs.control import pause_run
from outbox.runs.stopping import cancel_run
from outbox.shards import shard_of
from outbox.storage.async_store import AsyncStore, Completion
from outbox.storage.engine import make_async_engine
from outbox.storage.run_tx import RunTx
from tests.integration.test_cancel_in_doubt import swept_until
from tests.integration.test_reconcile import lose_attempts
from tests.integration.test_stopping_and_budgets import busy_run
from tests.support import DaemonThread, wait_for

Stop = Callable[[RunTx, uuid.UUID], RunStatus]


def _cancel(tx: RunTx, run_id: uuid.UUID) -> RunStatus:
    return cancel_run(tx, run_id, "stop", by="t", via="api")


def _pause(tx: RunTx, run_id: uuid.UUID) -> RunStatus:
    return pause_run(tx, run_id, "hold")


#: What the stop does, and what the answered effect may be once it committed: a
#: cancel holds it pending but never due, until the stopping sweep cancels it.
STOPS: dict[str, tuple[Stop, set[EffectStatus]]] = {
    "cancel": (_cancel, {EffectStatus.PENDING, EffectStatus.CANCELLED}),
    "pause": (_pause, {EffectStatus.PAUSED}),
}


@pytest.mark.parametrize("stop", list(STOPS))
def test_a_retry_answer_while_the_stop_commits_is_held_not_sent_again(
    ob: Outbox, dsn: str, stop: str
) -> None:
    act, held_as = STOPS[stop]
    run, sink, release = busy_run(ob)
    (effect,) = ob.effects(run_id=run.id)
    with DaemonThread(dsn, {"k.busy": sink}, poll_seconds=0.05, reconcile_seconds=60):
        wait_for(lambda: len(sink.deliveries) == 1, message="the first attempt in flight")
        with ob.store.engine.connect() as conn, conn.begin():
            with ob.store.run_tx(conn) as tx:
                act(tx, run.id)
            # the stop is written, not committed: the answer comes now
            release.set()
            wait_for(
                lambda: _answer_waits(ob) or _answered(ob, effect.id),
                message="the retry answer waiting for the stop, or committed",
            )
        wait_for(lambda: _answered(ob, effect.id), message="the answer committed after the stop")
        threading.Event().wait(0.5)  # the daemon's chance to take it again
        assert len(sink.deliveries) == 1, f"not delivered again after the {stop}"
    (effect,) = ob.effects(run_id=run.id)
    assert effect.status in held_as
    if effect.status == EffectStatus.PENDING:
        due = effect.available_at
        assert due is not None and due > datetime.now(UTC) + timedelta(days=365), "never due"
    if stop == "cancel":
        # held pending, never due: the stopping sweep cancels it
        swept_until(ob, run, RunStatus.CANCELLED)
        (effect,) = ob.effects(run_id=run.id)
        assert effect.status == EffectStatus.CANCELLED
        assert len(sink.deliveries) == 1


def _answered(ob: Outbox, effect_id: uuid.UUID) -> bool:
    return "retry" in [a.outcome for a in ob.store.attempts(effect_id)]


def _answer_waits(ob: Outbox) -> bool:
    """Whether some session of this database waits for a row lock (the completion)."""
    with ob.store.engine.connect() as conn:
        return bool(
            conn.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock'"
                )
            ).scalar()
        )


def test_a_cancel_and_a_batch_answering_two_of_its_effects_do_not_deadlock(
    ob: Outbox, dsn: str
) -> None:
    # The batch names the higher id first and is slowed on that row, so it takes the
    # rows in the other order from the cancel's (id order), if it takes them as named.
    run = ob.start_run("a", "1")
    low, high = sorted(
        uuid.UUID(i)
        for i in run.transaction(
            "s", lambda tx: [str(tx.intend("k.slow", {"n": n}).id) for n in range(2)]
        )
    )
    lose_attempts(dsn, ["k.slow"])
    with ob.store.engine.begin() as conn:
        conn.execute(
            text(
                "CREATE FUNCTION test_slow_row() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
                f" IF OLD.id = '{high}' THEN PERFORM pg_sleep(0.3); END IF; RETURN NEW; END $$;"
                " CREATE TRIGGER test_slow_row BEFORE UPDATE ON outbox_effects"
                " FOR EACH ROW EXECUTE FUNCTION test_slow_row()"
            )
        )
    answered: list[tuple[uuid.UUID, str]] = []

    async def answer() -> None:
        store = AsyncStore(make_async_engine(dsn))
        try:
            done = [
                Completion(e, 1, "succeeded", "succeeded", shard=shard_of(e)) for e in (high, low)
            ]
            answered.extend(await store.complete("dead-deliverer", done))
        finally:
            await store.dispose()

    batch = threading.Thread(target=asyncio.run, args=(answer(),))
    batch.start()
    threading.Event().wait(0.1)  # the batch is on its first row
    stopped = ob.cancel(run.id, "stop")  # a deadlock would raise here, or in the batch
    batch.join(20)
    assert sorted(answered) == sorted([(low, "succeeded"), (high, "succeeded")])
    assert stopped in (RunStatus.CANCELLING, RunStatus.CANCELLED)
    ob.advance_stopping_runs()
    assert ob.run(run.id).status == RunStatus.CANCELLED, "both done: nothing to undo"
