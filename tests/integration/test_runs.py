"""Runs keep their versioned inputs; terminal runs accept no more steps."""

from __future__ import annotations

import pytest
from sqlalchemy import update

from outbox import DatabaseError, Outbox, RunStatus, RunTerminal
from outbox.payloads import content_hash, jsonb_text
from outbox.storage.schema import runs


def test_a_run_stores_agent_version_inputs_and_their_hash(ob: Outbox) -> None:
    inputs = {"month": "2026-10", "accounts": ["a", "b"]}
    run = ob.start_run("invoice-reconciler", "2.3.1", inputs, budget=25.0)
    record = ob.run(run.id).record
    assert (record.agent, record.agent_version, record.inputs) == (
        "invoice-reconciler",
        "2.3.1",
        inputs,
    )
    # the sha256 of the inputs' text as PostgreSQL renders their jsonb (the write functions')
    assert record.inputs_hash == content_hash(jsonb_text(inputs))
    assert float(record.budget or 0) == 25.0
    assert record.status == RunStatus.RUNNABLE


def test_inputs_never_change_after_start(ob: Outbox) -> None:
    run = ob.start_run("invoice-reconciler", "2.3.1", {"month": "2026-10"})
    run.transaction("s", lambda tx: tx.set_state({"month": "2026-11"}))
    assert ob.run(run.id).inputs == {"month": "2026-10"}
    with pytest.raises(Exception, match="these never change"), ob.engine.begin() as conn:
        conn.execute(update(runs).where(runs.c.id == run.id).values(inputs={"month": "x"}))
    assert ob.run(run.id).inputs == {"month": "2026-10"}


def test_a_completed_run_accepts_no_more_steps(ob: Outbox) -> None:
    run = ob.start_run("a", "1")
    run.call("one", lambda: 1)
    run.complete({"done": True})
    with pytest.raises(RunTerminal, match="completed"):
        run.call("two", lambda: 2)
    stale = ob.run(run.id)
    stale._record = stale.record.model_copy(update={"status": RunStatus.RUNNING})
    with pytest.raises(RunTerminal):
        stale.transaction("two", lambda tx: tx.intend("email.send", {}))
    assert ob.run(run.id).completed_steps == ["one"]
    assert ob.effects(run_id=run.id) == []
    with pytest.raises(RunTerminal):
        ob.run(run.id).fail("too late")


def test_runs_are_listed_newest_first_and_filtered(ob: Outbox) -> None:
    a = ob.start_run("a", "1")
    b = ob.start_run("b", "1")
    b.complete()
    assert [r.id for r in ob.runs()] == [b.id, a.id]
    assert [r.id for r in ob.runs(status="completed")] == [b.id]
    assert [r.id for r in ob.runs(agent="a")] == [a.id]


def test_database_errors_are_translated(ob: Outbox) -> None:
    with ob.engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE outbox_steps CASCADE")
    with pytest.raises(DatabaseError) as info:
        ob.start_run("a", "1").call("x", lambda: 1)
    assert info.value.__cause__ is not None
