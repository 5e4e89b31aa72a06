"""Large values (stored by reference, on their owner's shard) on a cluster: a held
payload approved by its digest, histories with every kind of large value verified,
forks on the run's shard and on another, as the owner and as an agent login."""

from __future__ import annotations

import uuid
from typing import Any

from outbox import EffectStatus, Outbox, StepTransaction
from outbox.governance.gates import Gate
from outbox.shards import SHARDS, on_shard, shard_of
from tests.integration.test_roles import logins  # noqa: F401 (a fixture)

BIG = "x" * 20_000


def test_a_large_held_payload_is_approved_by_its_digest(ob: Outbox) -> None:
    gate = Gate(name="big-pay", kind="big.pay", when=[{"pointer": "/n", "op": "ge", "value": 0}])
    ob.apply_gates([gate])
    try:
        run = ob.start_run("big", "1")
        effect_id = run.transaction(
            "pay", lambda tx: str(tx.intend("big.pay", {"n": 1, "big": BIG}).id)
        )
        held = ob.effect(effect_id)
        assert held.status == EffectStatus.AWAITING_APPROVAL
        approved = ob.approve_effect(held.id, digest=held.digest, note="ok", by="cfo")
        assert approved.status == EffectStatus.PENDING
        assert ob.verify_run(run.id) == []
    finally:
        ob.apply_gates([], prune=True)


def large_history(who: Outbox) -> list[uuid.UUID]:
    """A run with large inputs, state, plan, result, payload and signal, and two forks."""
    run = who.start_run("big-history", "1", {"big": BIG})

    def step(tx: StepTransaction) -> Any:
        tx.set_state({"s": BIG})
        tx.set_plan([BIG + "p"])
        tx.intend("big.post", {"big": BIG + "e"})
        return {"r": BIG + "r"}

    run.transaction("one", step)
    run.sleep("nap", 0)
    who.signal(run.id, "go", {"by": "ops", "big": BIG + "sig", "n": 1.5})
    run.wait_signal("w", name="go")
    run.call("two", lambda: {"r2": BIG + "2"})
    ids = [run.id]
    for shard in (shard_of(run.id), (shard_of(run.id) + 1) % SHARDS):
        fork = who.fork(run.id, "two", fork_id=on_shard(uuid.uuid4(), shard))
        fork.call("two", lambda: {"again": BIG})
        ids.append(fork.id)
    return ids


def test_large_values_verify_written_by_the_owner_and_by_an_agent_login(
    ob: Outbox,
    logins: dict[str, str],  # noqa: F811
) -> None:
    with Outbox.connect(logins["agent"]) as agent:
        for who in (ob, agent):
            for run_id in large_history(who):
                assert ob.verify_run(run_id) == [], run_id
