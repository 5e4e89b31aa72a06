"""`outbox roles` on a cluster: each login does its job on the node holding its rows.

Citus propagates the roles and their grants to the workers. Citus refuses a
transaction that touches a shard's rows as two users, and the step writers run
as the tables' owner beside the agent's own statements: each is delegated to
the node holding its run's shard, where it runs in the agent's own session
(outbox/storage/functions/chain_writes.sql).
"""

from __future__ import annotations

import uuid
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url

from deliverers.testing import RecordingDeliverer
from outbox import (
    DatabaseError,
    EffectNotFound,
    EffectStatus,
    Outbox,
    RunStatus,
    StepTransaction,
)
from outbox.cli import cli
from outbox.shards import SHARDS, on_shard, shard_of
from outbox.storage.citus import DELEGATED, distribute
from outbox.storage.dsn import psycopg_url
from outbox.storage.migrate import migrate
from tests.citus_support import CitusDatabase
from tests.integration.test_roles import (  # noqa: F401 (a fixture, a test)
    PASSWORD,
    denied,
    logins,
    test_outbox_roles_run_again_changes_nothing,
)
from tests.support import DaemonThread, wait_for


def agent_work(agent: Outbox, ob: Outbox) -> uuid.UUID:
    """What an agent login does: steps with a cost, a sleep, a signal's wait, forks
    on its run's shard and on another; every history verified. Returns the effect."""
    run = agent.start_run("billing", "1", {"invoice": 7}, budget=10)

    def charge(tx: StepTransaction) -> str:
        tx.spend(1, "llm")
        return str(tx.intend("k.bill", {"n": 1}, cost=2).id)

    effect_id = uuid.UUID(run.transaction("charge", charge))
    run.sleep("nap", 0)
    agent.signal(run.id, "approve", {"by": "ops", "big": "x" * 20_000})
    assert run.wait_signal("ok", name="approve")["by"] == "ops"
    run.call("notify", lambda: {"sent": True})
    for shard in (shard_of(run.id), (shard_of(run.id) + 1) % SHARDS):
        fork = agent.fork(run.id, "notify", fork_id=on_shard(uuid.uuid4(), shard))
        assert fork.completed_steps == ["charge", "nap", "ok"] and fork.record.spent == 1
        fork.call("notify", lambda: {"sent": "again"})
        assert ob.verify_run(fork.id) == []
    assert ob.verify_run(run.id) == []
    return effect_id


def test_an_agent_login_writes_steps_waits_and_forks_a_deliverer_login_delivers(
    ob: Outbox,
    dsn: str,
    logins: dict[str, str],  # noqa: F811
) -> None:
    with Outbox.connect(logins["agent"]) as agent:
        effect_id = agent_work(agent, ob)
        with pytest.raises(DatabaseError, match="permission denied"):
            agent.resolve_effect(effect_id, outcome="succeeded", note="no", operator="agent")
    denied(
        logins["agent"],
        "UPDATE outbox_effects SET status = 'succeeded' WHERE id = %(id)s AND shard = %(s)s",
        {"id": effect_id, "s": shard_of(effect_id)},
    )

    sink = RecordingDeliverer("k.bill")
    with DaemonThread(logins["deliverer"], {"k.bill": sink}, poll_seconds=0.05):
        wait_for(lambda: ob.effect(effect_id).status == EffectStatus.SUCCEEDED)
    assert [d.effect_id for d in sink.deliveries] == [effect_id]
    run_id = ob.effect(effect_id).run_id
    assert run_id is not None
    record = ob.run(run_id).record
    assert (record.spent, record.reserved) == (Decimal(3), Decimal(0)), "the cost committed once"
    denied(
        logins["deliverer"],
        "SELECT outbox_commit_step(%(id)s, 'forged')",
        {"id": run_id},
    )


def test_an_upgrade_of_a_distributed_database_delegates_the_writers_it_recreates(
    citus_db: CitusDatabase,
) -> None:
    """0036 re-created the chain writers with new arguments: `outbox migrate` on a
    distributed database delegates them again, and an agent login works after it."""
    engine = create_engine(psycopg_url(citus_db.dsn))
    try:
        migrate(engine, target=35)
        distribute(engine)
        migrate(engine)
    finally:
        engine.dispose()
    with psycopg.connect(citus_db.dsn) as conn:
        delegated = conn.execute(
            "SELECT p.proname FROM pg_dist_object AS d JOIN pg_proc AS p ON p.oid = d.objid"
            " WHERE d.classid = 'pg_proc'::regclass AND d.distribution_argument_index = 0"
            "   AND d.force_delegation"
        ).fetchall()
    assert sorted(name for (name,) in delegated) == sorted(DELEGATED)
    done = CliRunner().invoke(cli, ["--dsn", citus_db.dsn, "roles", "--json"])
    assert done.exit_code == 0, done.output
    login = f"t_upgraded_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(citus_db.dsn, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {login} LOGIN PASSWORD '{PASSWORD}' IN ROLE outbox_agent")
    try:
        url = make_url(citus_db.dsn).set(username=login, password=PASSWORD)
        with (
            Outbox.connect(citus_db.dsn) as ob,
            Outbox.connect(url.render_as_string(hide_password=False)) as agent,
        ):
            agent_work(agent, ob)
    finally:
        with psycopg.connect(citus_db.dsn, autocommit=True) as conn:
            conn.execute(f"DROP ROLE {login}")


def test_an_operator_login_cancels_and_a_reader_changes_nothing(
    ob: Outbox,
    logins: dict[str, str],  # noqa: F811
) -> None:
    runs: list[Any] = [ob.start_run("billing", "1", {"n": n}) for n in range(3)]
    with Outbox.connect(logins["operator"]) as operator:
        for run in runs:
            assert operator.cancel(run.id, "not needed", by="ops") == RunStatus.CANCELLED
    denied(logins["reader"], "UPDATE outbox_runs SET status = 'running'")
    assert {ob.run(r.id).status for r in runs} == {RunStatus.CANCELLED}


def test_an_agent_cannot_insert_an_effect_that_never_ran_its_intents_and_compensations_go_in(
    ob: Outbox,
    logins: dict[str, str],  # noqa: F811
) -> None:
    """The checks on a login's inserts into outbox_effects hold on the shards.

    (Citus 14.0.1 creates a restrictive policy on the shards as a permissive one:
    before the policies were all permissive, an agent login inserted an effect
    already succeeded, one a sink never saw.)
    """
    forged = uuid.uuid4()
    denied(
        logins["agent"],
        "INSERT INTO outbox_effects (id, shard, kind, payload, payload_hash, idempotency_key,"
        " status) VALUES (%(id)s, %(s)s, 'k.x', '{}', 'h', 'forged', 'succeeded')",
        {"id": forged, "s": shard_of(forged)},
    )
    with Outbox.connect(logins["agent"]) as agent:
        # an intent of no run, and a run's with a compensation, go in as the agent's
        with agent.transaction() as tx:
            runless = tx.intend("k.bill", {"n": 0}).id
        run = agent.start_run("billing", "1")
        charged = uuid.UUID(
            run.transaction(
                "charge",
                lambda tx: str(tx.intend("k.bill", {"n": 1}, compensate=("k.refund", {"n": 1})).id),
            )
        )
    sink = RecordingDeliverer("k.bill")
    refunds = RecordingDeliverer("k.refund")
    with DaemonThread(
        logins["deliverer"], {"k.bill": sink, "k.refund": refunds}, poll_seconds=0.05
    ):
        wait_for(lambda: ob.effect(charged).status == EffectStatus.SUCCEEDED)
        with Outbox.connect(logins["operator"]) as operator:
            operator.cancel(run.id, "refund it", by="ops")
        # the deliverer login intends the declared refund and delivers it
        wait_for(lambda: ob.run(run.id).status == RunStatus.COMPENSATED, timeout=30)
    assert [d.payload for d in refunds.deliveries] == [{"n": 1}]
    assert ob.effect(runless).status == EffectStatus.SUCCEEDED
    with pytest.raises(EffectNotFound):
        ob.effect(forged)
