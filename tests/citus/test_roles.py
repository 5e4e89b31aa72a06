"""`outbox roles` on a cluster: each login does its job on the node holding its rows.

Citus propagates the roles and their grants to the workers. What does not work
yet is marked so, strictly (it fails the day it works): Citus refuses a
transaction that touches a shard's rows as two users, and the chain writers run
as the tables' owner beside the agent's own statements (docs/howto/citus.md).
"""

from __future__ import annotations

import uuid
from decimal import Decimal
from typing import Any

import pytest

from deliverers.testing import RecordingDeliverer
from outbox import DatabaseError, EffectStatus, Outbox, RunStatus, StepTransaction
from outbox.shards import SHARDS, on_shard, shard_of
from tests.integration.test_roles import denied, logins  # noqa: F401 (a fixture)
from tests.support import DaemonThread, wait_for


@pytest.mark.xfail(
    strict=True,
    raises=DatabaseError,
    reason="a fork's chain is written as the owner where the agent wrote the fork: Citus "
    "refuses placements modified in this transaction by a different user",
)
def test_an_agent_login_writes_steps_and_forks_a_deliverer_login_delivers(
    ob: Outbox,
    dsn: str,
    logins: dict[str, str],  # noqa: F811
) -> None:
    with Outbox.connect(logins["agent"]) as agent:
        run = agent.start_run("billing", "1", {"invoice": 7}, budget=10)

        def charge(tx: StepTransaction) -> str:
            tx.spend(1, "llm")
            return str(tx.intend("k.bill", {"n": 1}, cost=2).id)

        effect_id = uuid.UUID(run.transaction("charge", charge))
        run.call("notify", lambda: {"sent": True})
        elsewhere = on_shard(uuid.uuid4(), (shard_of(run.id) + 1) % SHARDS)
        fork = agent.fork(run.id, "notify", fork_id=elsewhere)
        assert fork.completed_steps == ["charge"] and fork.record.spent == 1
        fork.call("notify", lambda: {"sent": "again"})
        assert ob.verify_run(run.id) == [] and ob.verify_run(fork.id) == []
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
    record = ob.run(run.id).record
    assert (record.spent, record.reserved) == (Decimal(3), Decimal(0)), "the cost committed once"
    denied(
        logins["deliverer"],
        "SELECT outbox_commit_step(%(id)s, 'forged')",
        {"id": run.id},
    )


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
