"""The SQL API honours run control as the Python client does (migration 0013).

A run started and an intent written through the SQL functions (as any
language sends them: plain SQL on a psycopg connection) take part in one run
per business key, priorities and fairness keys, pause and resume, and store
large values by reference in the same format, so Python readers, claims and
deliverers see them as their own. Each test checks the rows and reads them
back through the Python client.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from deliverers.testing import RecordingDeliverer
from outbox import EffectStatus, IdempotencyConflict, Outbox, RunExists, RunPaused, RunStatus
from outbox.blobs import is_reference
from outbox.payloads import content_hash, jsonb_text
from outbox.storage.async_store import AsyncStore, ClaimedEffect
from outbox.storage.dsn import libpq_dsn
from outbox.storage.engine import make_async_engine, sql_api_error
from outbox.storage.sql.queue import EFFECT_QUEUE
from tests.integration.test_roles import logins  # noqa: F401 (a fixture)
from tests.sql_api_support import count, intend, start_run
from tests.support import DaemonThread, wait_for

MB = 1024 * 1024


@pytest.fixture
def db(dsn: str, ob: Outbox) -> Any:  # ob: the schema is migrated
    with psycopg.connect(dsn) as conn:
        yield conn


def refused(conn: psycopg.Connection[Any], sql: str, params: Any = None) -> psycopg.Error:
    with pytest.raises(psycopg.Error) as caught:
        conn.execute(sql, params)
    conn.rollback()
    return caught.value


def typed(error: psycopg.Error) -> Exception | None:
    """The Python client's error for a SQL API refusal."""
    return sql_api_error(
        error.sqlstate, error.diag.message_primary or "", error.diag.message_detail
    )


def commit_step(conn: psycopg.Connection[Any], run_id: uuid.UUID, step_id: str, **kw: Any) -> Any:
    args = {"run_id": run_id, "step_id": step_id, **{k: json.dumps(v) for k, v in kw.items()}}
    named = ", ".join(f"{k} => %({k})s" for k in args)
    return conn.execute(f"SELECT * FROM outbox_commit_step({named})", args).fetchone()


def one(conn: psycopg.Connection[Any], sql: str, params: Any = None) -> Any:
    row = conn.execute(sql, params).fetchone()
    assert row is not None
    return row[0]


def claim(dsn: str, kind: str, limit: int) -> list[ClaimedEffect]:
    async def go() -> list[ClaimedEffect]:
        store = AsyncStore(make_async_engine(dsn))
        try:
            return await store.claim_many(
                EFFECT_QUEUE, [({"kind": kind}, limit)], owner="t", lease_seconds=30
            )
        finally:
            await store.dispose()

    return asyncio.run(go())


# -- one run per business key ---------------------------------------------------------


def test_a_business_key_starts_one_run_through_sql_and_python(db: Any, ob: Outbox) -> None:
    first = start_run(db, key="order-7")
    assert start_run(db, key="order-7") == first
    # the Python client finds the same run under the key (same agent, version, inputs)
    assert ob.start_run("shop", "1", {"order": 1}, key="order-7").id == first

    other_inputs = refused(
        db,
        "SELECT outbox_start_run('shop', '1', '{\"order\": 2}'::jsonb, key => 'order-7')",
    )
    assert other_inputs.sqlstate == "OB003"
    assert isinstance(typed(other_inputs), IdempotencyConflict)

    rejected = refused(
        db,
        "SELECT outbox_start_run('shop', '1', '{\"order\": 1}'::jsonb, key => 'order-7',"
        " on_conflict => 'reject')",
    )
    assert rejected.sqlstate == "OB010"
    error = typed(rejected)
    assert isinstance(error, RunExists) and str(error.run_id) == str(first)
    assert count(db, "outbox_runs") == 1

    bad = refused(db, "SELECT outbox_start_run('shop', '1', on_conflict => 'overwrite')")
    assert (bad.sqlstate, bad.diag.column_name) == ("OB001", "on_conflict")


def test_a_dry_run_started_through_sql_is_one_and_its_intents_never_reach_a_sink(
    db: Any, ob: Outbox
) -> None:
    dry = start_run(db, mode="dry_run", key="order-dry")
    assert ob.run(dry).record.dry_run is True
    db.execute("BEGIN")
    intend(db, "email.send", {"to": "ap"}, run_id=dry, step_id="notify", step_index=0)
    commit_step(db, dry, "notify")
    db.commit()
    (effect,) = ob.effects(run_id=dry)
    assert effect.kind.startswith("dry-run:"), effect.kind
    # the same key or run id in the other mode is refused, never answered with this run
    other_mode = refused(
        db,
        "SELECT outbox_start_run('shop', '1', '{\"order\": 1}'::jsonb, key => 'order-dry')",
    )
    assert other_mode.sqlstate == "OB003" and "other mode" in str(other_mode)
    with pytest.raises(IdempotencyConflict, match="other mode"):
        ob.start_run("shop", "1", {"order": 1}, key="order-dry")
    by_id = refused(
        db,
        "SELECT outbox_start_run('shop', '1', '{\"order\": 1}'::jsonb, run_id => %s)",
        (dry,),
    )
    assert (by_id.sqlstate, by_id.diag.column_name) == ("OB001", "run_id")
    assert "mode" in str(by_id)
    assert start_run(db, mode="dry_run", run_id=dry) == dry
    bad = refused(db, "SELECT outbox_start_run('shop', '1', mode => 'rehearsal')")
    assert (bad.sqlstate, bad.diag.column_name) == ("OB001", "mode")
    assert count(db, "outbox_runs") == 1


# -- priorities and fairness keys -------------------------------------------------------


def test_runs_and_intents_carry_priority_and_fairness_key(db: Any, ob: Outbox, dsn: str) -> None:
    run_id = start_run(db, priority=5, fairness_key="tenant-a")
    commit_step(
        db,
        run_id,
        "s",
        intents=[
            {"kind": "k.lane", "payload": {"n": "inherit"}},
            {"kind": "k.lane", "payload": {"n": "own"}, "priority": -3, "fairness_key": "prov"},
        ],
    )
    intend(db, "k.lane", {"n": "no run"})
    intend(db, "k.lane", {"n": "urgent"}, priority=9)
    db.commit()

    record = ob.run(run_id).record
    assert (record.priority, record.fairness_key) == (5, "tenant-a")
    lanes = {e.payload["n"]: (e.priority, e.fairness_key) for e in ob.effects(kind="k.lane")}
    assert lanes == {
        "inherit": (5, "tenant-a"),
        "own": (-3, "prov"),
        "no run": (0, ""),
        "urgent": (9, ""),
    }
    # claims take higher priority first, whoever wrote the intent
    assert [c.payload["n"] for c in claim(dsn, "k.lane", 4)] == [
        "urgent",
        "inherit",
        "no run",
        "own",
    ]

    for call, field in [
        ("SELECT outbox_start_run('a', '1', priority => 1001)", "priority"),
        ("SELECT outbox_intend('k.a', '{}'::jsonb, priority => -1001)", "priority"),
        (
            "SELECT outbox_intend('k.a', '{}'::jsonb, fairness_key => repeat('t', 201))",
            "fairness_key",
        ),
        ("SELECT outbox_start_run('a', '1', fairness_key => E'a\\nb')", "fairness_key"),
    ]:
        error = refused(db, call)
        assert (error.sqlstate, error.diag.column_name) == ("OB001", field), call


# -- pause and resume -------------------------------------------------------------------


def test_a_paused_run_refuses_sql_api_steps_and_holds_its_intents_until_resumed(
    db: Any, ob: Outbox
) -> None:
    run_id = start_run(db)
    commit_step(db, run_id, "s1", intents=[{"kind": "k.later", "payload": {"n": 1}}])
    db.commit()

    assert ob.pause(run_id, "customer asked to hold") == RunStatus.PAUSED
    assert [e.status for e in ob.effects(run_id=run_id)] == [EffectStatus.PAUSED]

    calls: tuple[Callable[[], object], ...] = (
        lambda: intend(db, "k.a", {}, run_id=run_id, step_id="s2"),
        lambda: commit_step(db, run_id, "s2"),
        lambda: db.execute("SELECT outbox_finish_run(%s, 'completed')", (run_id,)),
    )
    for call in calls:
        with pytest.raises(psycopg.Error) as caught:
            call()
        db.rollback()
        assert caught.value.sqlstate == "OB009"
        error = typed(caught.value)
        assert isinstance(error, RunPaused) and error.reason == "customer asked to hold"

    # a paused run still takes signals (its wait sees them at resume)
    signal = db.execute("SELECT * FROM outbox_signal(%s, 'approve')", (run_id,)).fetchone()
    db.commit()
    assert signal is not None and signal[1] is False

    assert ob.resume(run_id) == RunStatus.RUNNABLE
    assert [e.status for e in ob.effects(run_id=run_id)] == [EffectStatus.PENDING]
    commit_step(db, run_id, "s2", intents=[{"kind": "k.now", "payload": {}}])
    db.commit()
    statuses = {e.kind: e.status for e in ob.effects(run_id=run_id)}
    assert statuses == {"k.later": EffectStatus.PENDING, "k.now": EffectStatus.PENDING}


def test_intents_of_a_step_a_pause_waits_for_are_held(db: Any, ob: Outbox) -> None:
    run_id = start_run(db)
    # a worker holds the run: the pause waits for its step in flight
    db.execute(
        "UPDATE outbox_runs SET status = 'running', lease_owner = 'w', attempt = 1,"
        " lease_expires_at = now() + interval '1 minute' WHERE id = %s",
        (run_id,),
    )
    db.commit()
    assert ob.pause(run_id, "hold") == RunStatus.RUNNING

    commit_step(db, run_id, "s", intents=[{"kind": "k.held", "payload": {"n": 1}}])
    intend(db, "k.free", {"n": 2})  # an intent of no run is not held
    db.commit()
    assert [e.status for e in ob.effects(kind="k.held")] == [EffectStatus.PAUSED]
    assert [e.status for e in ob.effects(kind="k.free")] == [EffectStatus.PENDING]


def test_a_pause_during_an_open_sql_api_step_holds_the_step_s_intents(db: Any, ob: Outbox) -> None:
    run_id = start_run(db)
    intend(db, "k.a", {"n": 1}, run_id=run_id, step_id="s")  # the transaction stays open
    outcome: list[Any] = []
    pausing = threading.Thread(target=lambda: outcome.append(ob.pause(run_id, "ops")))
    pausing.start()
    # The pause locks the run row, which the open step's intent holds (its foreign
    # key): it waits for the step's transaction, so the two are ordered by that row.
    pausing.join(0.5)
    assert pausing.is_alive() and outcome == []
    commit_step(db, run_id, "s")
    db.commit()
    pausing.join(10)
    assert outcome == [RunStatus.PAUSED]
    assert [e.status for e in ob.effects(run_id=run_id)] == [EffectStatus.PAUSED]
    error = refused(db, "SELECT * FROM outbox_commit_step(%s, 's2')", (run_id,))
    assert error.sqlstate == "OB009"


# -- large values by reference ----------------------------------------------------------


def test_twenty_megabyte_values_through_the_sql_api_are_stored_by_reference(
    db: Any, ob: Outbox
) -> None:
    big = {"transcript": "model said: " + "x" * (20 * MB)}
    run_id = start_run(db, inputs=json.dumps(big))
    (step_seq, (effect_id,), _) = commit_step(
        db,
        run_id,
        "think",
        result=big,
        state=big,
        intents=[{"kind": "k.big", "payload": big}],
    )
    db.commit()
    assert step_seq is not None

    # one blob, the same sha256 (and text) the Python client would store
    assert count(db, "outbox_blobs") == 1
    sha = one(db, "SELECT sha256 FROM outbox_blobs")
    assert sha == content_hash(jsonb_text(big))
    assert one(db, "SELECT payload_hash FROM outbox_effects WHERE id = %s", (effect_id,)) == sha
    owners = {r[0] for r in db.execute("SELECT owner FROM outbox_blob_refs").fetchall()}
    assert owners == {run_id}

    rows = [
        one(db, "SELECT pg_column_size(r.*) FROM outbox_runs r WHERE id = %s", (run_id,)),
        one(db, "SELECT max(pg_column_size(s.*)) FROM outbox_steps s WHERE run_id = %s", (run_id,)),
        one(db, "SELECT pg_column_size(e.*) FROM outbox_effects e WHERE id = %s", (effect_id,)),
    ]
    assert all(size < 1024 for size in rows), rows

    # read back transparently: through the SQL readers and the Python client
    assert one(db, "SELECT result FROM outbox_step(%s, 'think')", (run_id,)) == big
    status = db.execute("SELECT inputs, state FROM outbox_run_status(%s)", (run_id,)).fetchone()
    assert status is not None and status[0] == big and status[1] == big
    loaded = ob.run(run_id)
    think = loaded.step("think")
    assert (
        loaded.inputs == big and loaded.state == big and think is not None and think.result == big
    )
    assert ob.effect(effect_id).payload == big

    # the same intent again (same key, same payload) is the same effect
    again = intend(
        db, "k.big", big, run_id=run_id, step_id="think2", key=ob.effect(effect_id).idempotency_key
    )
    db.rollback()
    assert again is not None and again[2] is False and again[0] == effect_id


def test_a_deliverer_gets_a_large_sql_api_payload_whole(db: Any, ob: Outbox, dsn: str) -> None:
    big = {"document": "y" * (2 * MB)}
    (effect_id, _, created) = intend(db, "k.doc", big)
    db.commit()
    assert created
    stored = one(db, "SELECT payload FROM outbox_effects WHERE id = %s", (effect_id,))
    assert is_reference(stored)
    # an intent of no run owns its blob itself
    assert one(db, "SELECT owner FROM outbox_blob_refs") == effect_id
    recorder = RecordingDeliverer("k.doc")
    with DaemonThread(dsn, {"k.doc": recorder}, poll_seconds=0.1):
        wait_for(lambda: ob.effect(effect_id).status == EffectStatus.SUCCEEDED, timeout=60)
    assert [d.payload for d in recorder.deliveries] == [big]


def test_a_value_shaped_like_a_reference_is_refused_by_the_sql_api(db: Any) -> None:
    forged = json.dumps({"__outbox_blob__": {"sha256": "0" * 64, "bytes": 1}})
    run_id = start_run(db)
    for call, params, field in [
        ("SELECT outbox_start_run('a', '1', %s::jsonb)", (forged,), "inputs"),
        ("SELECT outbox_commit_step(%s, 's', result => %s::jsonb)", (run_id, forged), "result"),
        ("SELECT outbox_commit_step(%s, 's', state => %s::jsonb)", (run_id, forged), "state"),
        ("SELECT outbox_signal(%s, 'n', %s::jsonb)", (run_id, forged), "payload"),
    ]:
        error = refused(db, call, params)
        assert (error.sqlstate, error.diag.column_name) == ("OB002", field), call


def test_the_agent_role_drives_run_control_through_the_sql_api(
    ob: Outbox,
    logins: dict[str, str],  # noqa: F811 (the fixture imported above)
) -> None:
    big = {"transcript": "z" * (100 * 1024)}
    with psycopg.connect(libpq_dsn(logins["agent"])) as agent:
        run_id = start_run(agent, inputs=json.dumps(big), key="ticket-9", fairness_key="t1")
        assert start_run(agent, inputs=json.dumps(big), key="ticket-9") == run_id
        commit_step(agent, run_id, "s", state=big, intents=[{"kind": "k.a", "payload": big}])
        agent.execute(
            "SELECT outbox_finish_run(%s, 'completed', result => %s::jsonb)",
            (run_id, json.dumps(big)),
        )
        agent.commit()
    loaded = ob.run(run_id)
    assert loaded.inputs == big and loaded.state == big
    assert loaded.status == RunStatus.COMPLETED and loaded.record.result == big
    (effect,) = ob.effects(run_id=run_id)
    assert effect.payload == big and effect.fairness_key == "t1"
