"""Under `outbox roles`, what a gate holds or an operator ended cannot be undone by hand.

Each attack is a statement a login's grants allowed before: an agent's INSERT of
a gated payment as ``pending``, or of an intent into a run an operator cancelled
or paused; a deliverer's UPDATE of a rejected, failed or cancelled effect back to
``pending``; an agent's UPDATE of a cancelled run back to live. And a gated kind
declared as a compensation is held like the same intent written by a step.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import psycopg
import pytest

from deliverers.testing import RecordingDeliverer
from outbox import EffectStatus, Outbox, RunStatus, StepTransaction
from outbox.governance.gates import Gate
from outbox.storage.dsn import libpq_dsn
from tests.integration.test_roles import logins  # noqa: F401 (a fixture)
from tests.support import DaemonThread, wait_for

BIG = Gate(name="big", kind="payments.send", when=[{"pointer": "/amount", "op": "gt", "value": 10}])
_INSERT = (
    "INSERT INTO outbox_effects (id, run_id, kind, payload, payload_hash, idempotency_key, status,"
    " shard) SELECT i, %(run)s, 'payments.send', %(payload)s::jsonb, 'h', %(key)s, %(status)s,"
    " outbox_shard_of(coalesce(%(run)s, i)) FROM (SELECT outbox_uuid7() AS i) AS n"
)


def _refused(dsn: str, sql: str, params: dict[str, Any], words: str) -> None:
    with psycopg.connect(libpq_dsn(dsn)) as conn, pytest.raises(psycopg.Error) as caught:
        conn.execute(sql, params)
    assert words in str(caught.value), caught.value


def _changed(dsn: str, sql: str, params: dict[str, Any]) -> int:
    with psycopg.connect(libpq_dsn(dsn)) as conn:
        return conn.execute(sql, params).rowcount


def test_an_agent_cannot_insert_past_a_gate_or_into_a_stopped_run(
    ob: Outbox,
    logins: dict[str, str],  # noqa: F811
) -> None:
    ob.apply_gates([BIG])
    agent = logins["agent"]
    row = {"run": None, "payload": '{"amount": 500}', "key": "raw-1", "status": "pending"}
    _refused(agent, _INSERT, row, "row-level security")
    # below the gate's threshold, or held for approval, it goes in
    assert _changed(agent, _INSERT, {**row, "payload": '{"amount": 5}'}) == 1
    cancelled, paused = ob.start_run("a", "1"), ob.start_run("a", "1")
    ob.cancel(cancelled.id, "no")
    ob.pause(paused.id, "hold")
    for run in (cancelled, paused):
        small = {**row, "run": run.id, "payload": '{"amount": 1}', "key": f"k-{run.id}"}
        _refused(agent, _INSERT, small, "row-level security")
    assert [e.idempotency_key for e in ob.effects()] == ["raw-1"]


def test_a_deliverer_reopens_nothing_an_operator_ended(
    ob: Outbox,
    logins: dict[str, str],  # noqa: F811
) -> None:
    run = ob.start_run("a", "1")
    ids = run.transaction("s", lambda tx: [str(tx.intend("k.x", {"n": n}).id) for n in range(3)])
    failed, cancelled, held = (uuid.UUID(i) for i in ids)
    with ob.engine.begin() as conn:  # the owner sets the scene: one failed, one held
        conn.exec_driver_sql(
            "UPDATE outbox_effects SET status = 'failed' WHERE id = %(id)s", {"id": failed}
        )
        conn.exec_driver_sql(
            "UPDATE outbox_effects SET status = 'awaiting_approval',"
            ' approval = \'{"gate": "g"}\' WHERE id = %(id)s',
            {"id": held},
        )
    with Outbox.connect(logins["operator"]) as operator:
        operator.reject_effect(held, note="no", by="ops")
        operator.cancel(run.id, "stop")
    assert ob.effect(cancelled).status == EffectStatus.CANCELLED
    reopen = "UPDATE outbox_effects SET status = 'pending' WHERE id = %(id)s"
    for effect in (failed, cancelled, held):
        _refused(logins["deliverer"], reopen, {"id": effect}, "only an operator reopens")
    assert [ob.effect(e).status for e in (failed, cancelled, held)] == [
        EffectStatus.FAILED,
        EffectStatus.CANCELLED,
        EffectStatus.REJECTED,
    ]


def test_an_agent_cannot_bring_a_cancelled_run_back(
    ob: Outbox,
    logins: dict[str, str],  # noqa: F811
) -> None:
    run = ob.start_run("a", "1")
    ob.cancel(run.id, "stop")
    for status in ("runnable", "running", "completed"):
        _refused(
            logins["agent"],
            "UPDATE outbox_runs SET status = %(s)s WHERE id = %(id)s",
            {"s": status, "id": run.id},
            "cannot become",
        )
    assert ob.run(run.id).status == RunStatus.CANCELLED


def test_a_gated_compensation_waits_for_an_approval(ob: Outbox, dsn: str) -> None:
    ob.apply_gates([BIG])
    run = ob.start_run("a", "1")

    def note(tx: StepTransaction) -> None:
        tx.intend("notes.add", {"n": 1}, compensate=("payments.send", {"amount": 500}))

    run.transaction("s", note)
    with DaemonThread(dsn, {"notes.add": RecordingDeliverer("notes.add")}, poll_seconds=0.05):
        wait_for(lambda: ob.effects(run_id=run.id)[0].status == EffectStatus.SUCCEEDED)
    assert ob.cancel(run.id, "stop") == RunStatus.COMPENSATING
    (refund,) = [e for e in ob.effects(run_id=run.id) if e.compensates is not None]
    assert refund.status == EffectStatus.AWAITING_APPROVAL
    assert refund.approval is not None and refund.approval["gate"] == "big"


def test_a_declared_compensation_is_never_a_reference_to_a_stored_value(
    ob: Outbox, dsn: str
) -> None:
    # its gate judges what it sends as written: a reference would hide the amount
    ob.apply_gates([BIG])
    run = ob.start_run("a", "1")
    reference = {"__outbox_blob__": {"bytes": 20000, "sha256": "0" * 64}}
    with psycopg.connect(libpq_dsn(dsn)) as conn, pytest.raises(psycopg.Error) as caught:
        conn.execute(
            "SELECT * FROM outbox_intend(kind => 'notes.add', payload => '{}'::jsonb,"
            " run_id => %(run)s, step_id => 's', compensate => %(comp)s::jsonb)",
            {"run": run.id, "comp": json.dumps({"kind": "payments.send", "payload": reference})},
        )
    assert "compensate.payload" in str(caught.value) and "reserved" in str(caught.value)
