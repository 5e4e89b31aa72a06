"""An effect's id names the shard it lives on (its run's), whoever writes it.

So a read or a change of one effect by its id alone (await it, approve it,
resolve it, show it) goes to that shard only on Citus. An effect written before
ids named their shard, or with an id its caller chose, is still found: looked for
on every shard.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import psycopg
from sqlalchemy import text

from deliverers.testing import RecordingDeliverer
from outbox import EffectStatus, Outbox, RunStatus, StepTransaction
from outbox.shards import on_shard, shard_of
from outbox.storage.run_tx import RunTx
from tests.sql_api_support import intend
from tests.support import DaemonThread

KIND = "k.ids"


def _shards(ob: Outbox, run_id: uuid.UUID) -> set[tuple[int, int]]:
    """(the shard each effect's id names, the shard it is stored on) for the run's effects."""
    with ob.store.engine.connect() as conn:
        rows = conn.execute(
            text("SELECT id, shard FROM outbox_effects WHERE run_id = :r"), {"r": run_id}
        ).all()
    return {(shard_of(row.id), int(row.shard)) for row in rows}


def test_every_writer_gives_a_runs_effects_ids_of_its_shard(ob: Outbox, dsn: str) -> None:
    run = ob.start_run("ids", "1")

    def book(tx: StepTransaction) -> None:
        for n in range(3):
            tx.intend(KIND, {"n": n}, compensate=("k.ids.undo", {"n": n}))

    run.transaction("python", book)
    with psycopg.connect(dsn) as db:  # the SQL API, as another language calls it
        intend(db, KIND, {"n": 9}, run_id=run.id, step_id="sql")
        db.execute("SELECT outbox_commit_step(%s, 'sql')", [run.id])
        db.execute(
            "SELECT outbox_commit_step(%s, 'sql-many', intents => %s::jsonb)",
            [run.id, json.dumps([{"kind": KIND, "payload": {"n": n}} for n in (10, 11)])],
        )
    with ob.store.engine.begin() as conn:  # delivered, so a cancel must undo them
        conn.execute(
            text("UPDATE outbox_effects SET status = 'succeeded', completed_at = now()"),
        )
    assert ob.cancel(run.id, "undo the booking") == RunStatus.COMPENSATING
    effects = ob.effects(run_id=run.id)
    assert len(effects) == 9, [(e.kind, e.step_id) for e in effects]
    assert len([e for e in effects if e.compensates is not None]) == 3
    assert _shards(ob, run.id) == {(shard_of(run.id), shard_of(run.id))}


def test_an_effect_whose_id_names_another_shard_is_still_found_awaited_and_resolved(
    ob: Outbox, dsn: str
) -> None:
    """As an effect written before ids named their shard: found by its id on any shard."""
    run = ob.start_run("ids", "1")
    other = (shard_of(run.id) + 1) % 32
    old = uuid.UUID(run.transaction("s", lambda tx: str(tx.intend(KIND, {"n": 1}).id)))
    moved = on_shard(old, other)
    with ob.store.engine.begin() as conn:
        conn.execute(
            text("UPDATE outbox_effects SET id = :new WHERE id = :old"), {"new": moved, "old": old}
        )
    assert shard_of(moved) != shard_of(run.id)
    assert ob.effect(moved).run_id == run.id
    with psycopg.connect(dsn) as db:  # the SQL API's read
        found = db.execute("SELECT run_id FROM outbox_effect_status(%s)", [moved]).fetchall()
    assert found == [(run.id,)]
    with ob.store.run_tx() as tx:
        assert isinstance(tx, RunTx)
        row = tx.await_effect(run.id, moved)
    assert row is not None and row.status == "pending"
    deliverer = RecordingDeliverer(KIND)
    with DaemonThread(dsn, {KIND: deliverer}, poll_seconds=0.1):
        assert run.await_effect(moved, timeout=30) == {"recorded": 1}
    assert ob.effect(moved).status == EffectStatus.SUCCEEDED
    # an operator's change finds it too
    with ob.store.engine.begin() as conn:
        conn.execute(
            text("UPDATE outbox_effects SET status = 'unknown' WHERE id = :id"), {"id": moved}
        )
    resolved = ob.resolve_effect(moved, outcome="succeeded", note="seen", operator="ops")
    assert resolved.status == EffectStatus.SUCCEEDED
    assert [a.outcome for a in ob.store.attempts(moved)][-1] == "resolved"


def test_awaiting_an_effect_that_does_not_exist_fails_the_wait(ob: Outbox) -> None:
    run = ob.start_run("ids", "1")
    missing: Any = on_shard(uuid.uuid4(), shard_of(run.id))
    with ob.store.run_tx() as tx:
        assert tx.await_effect(run.id, missing) is None
