"""Approval gates in one process: held intents, digests, decisions taken once, deadlines."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from outbox import (
    ApprovalRefused,
    AsyncOutbox,
    EffectRejected,
    EffectStatus,
    Outbox,
    RunStatus,
    ValidationError,
)
from outbox.errors import ConfigurationError
from outbox.governance.gates import Gate


def pay(ob: Outbox, amount: Any, *, kind: str = "payments.send", **options: Any) -> Any:
    run = ob.start_run("payer", "1")
    effect_id = run.transaction(
        "pay", lambda tx: str(tx.intend(kind, {"json": {"amount": amount}}, **options).id)
    )
    return run, ob.effect(effect_id)


@pytest.fixture
def gated(ob: Outbox) -> Outbox:
    ob.apply_gates(
        [
            Gate(
                name="large-payments",
                kind="payments.send",
                when=[{"pointer": "/json/amount", "op": "gt", "value": 10_000}],
            )
        ]
    )
    return ob


def outcomes(ob: Outbox, effect_id: Any) -> list[str]:
    return [a.outcome for a in ob.store.attempts(effect_id)]


def test_only_intents_that_meet_the_gate_are_held(gated: Outbox) -> None:
    _, small = pay(gated, 500)
    _, large = pay(gated, 12_500)
    _, other = pay(gated, 12_500, kind="payments.quote")
    assert small.status == EffectStatus.PENDING
    assert other.status == EffectStatus.PENDING
    assert large.status == EffectStatus.AWAITING_APPROVAL
    assert large.approval["gate"] == "large-payments"
    assert large.digest == large.payload_hash and len(large.digest) == 64


def test_an_approval_of_another_payload_releases_nothing(gated: Outbox) -> None:
    _, large = pay(gated, 12_500)
    _, other = pay(gated, 99_000)
    with pytest.raises(ApprovalRefused, match="names another payload"):
        gated.approve_effect(large.id, digest=other.digest, note="ok", by="cfo")
    assert gated.effect(large.id).status == EffectStatus.AWAITING_APPROVAL
    assert outcomes(gated, large.id) == ["approval_refused"]
    refusal = gated.store.attempts(large.id)[0]
    assert refusal.worker == "cfo" and refusal.detail["digest"] == other.digest

    approved = gated.approve_effect(large.id, digest=large.digest, note="within Q3 plan", by="cfo")
    assert approved.status == EffectStatus.PENDING
    assert outcomes(gated, large.id) == ["approval_refused", "approved"]
    assert gated.store.attempts(large.id)[1].detail["note"] == "within Q3 plan"
    # Used once: a second approval (or a rejection) changes nothing.
    with pytest.raises(ApprovalRefused, match="not awaiting approval"):
        gated.approve_effect(large.id, digest=large.digest, note="again", by="cfo")
    with pytest.raises(ApprovalRefused, match="not awaiting approval"):
        gated.reject_effect(large.id, note="too late", by="cfo")
    assert gated.effect(large.id).status == EffectStatus.PENDING


def test_a_rejection_is_terminal_and_the_awaiting_run_sees_it(gated: Outbox) -> None:
    run, large = pay(gated, 12_500)
    gated.reject_effect(large.id, note="vendor not on the list", by="cfo")
    assert gated.effect(large.id).status == EffectStatus.REJECTED
    with pytest.raises(EffectRejected, match="vendor not on the list"):
        run.await_effect(large, timeout=5)
    # Recorded: a replay raises it again.
    with pytest.raises(EffectRejected):
        gated.run(run.id).await_effect(large, timeout=5)


def test_an_intent_may_ask_for_approval_itself(ob: Outbox) -> None:
    _, held = pay(ob, 5, approval={"timeout": "1h", "on_timeout": "escalate"})
    assert held.status == EffectStatus.AWAITING_APPROVAL
    assert held.approval == {
        "gate": "intent",
        "timeout": 3600.0,
        "on_timeout": "escalate",
        "escalate_to": None,
    }
    assert held.approval_deadline is not None
    with pytest.raises(ValidationError, match="on_timeout"):
        pay(ob, 5, approval={"on_timeout": "shrug"})


def test_bad_approvals_are_refused_before_anything_is_read(gated: Outbox) -> None:
    _, large = pay(gated, 12_500)
    with pytest.raises(ValidationError, match="digest"):
        gated.approve_effect(large.id, digest="abc", note="ok", by="cfo")
    with pytest.raises(ValidationError, match="note"):
        gated.approve_effect(large.id, digest=large.digest, note=" ", by="cfo")
    assert outcomes(gated, large.id) == []


@pytest.mark.parametrize(
    ("on_timeout", "effect_status", "run_status"),
    [
        ("reject", EffectStatus.REJECTED, RunStatus.RUNNABLE),
        ("cancel_run", EffectStatus.CANCELLED, RunStatus.CANCELLED),
        ("escalate", EffectStatus.AWAITING_APPROVAL, RunStatus.RUNNABLE),
    ],
)
def test_an_approval_past_the_deadline_is_refused_and_on_timeout_happens(
    ob: Outbox, on_timeout: str, effect_status: EffectStatus, run_status: RunStatus
) -> None:
    ob.apply_gates(
        [
            Gate(
                name="g",
                kind="payments.send",
                timeout=0.3,
                on_timeout=on_timeout,
                escalate_to="treasury@example.com",
            )
        ]
    )
    run, held = pay(ob, 1)
    time.sleep(0.5)
    if on_timeout == "escalate":
        # Escalated, it waits on without a deadline: an approval is accepted.
        assert ob.expire_approvals() == {"awaiting_approval": 1}
        assert ob.effect(held.id).approval_deadline is None
        assert ob.effect(held.id).approval["escalated_at"]
        assert outcomes(ob, held.id) == ["timed_out"]
        assert ob.store.attempts(held.id)[0].detail["escalate_to"] == "treasury@example.com"
        ob.approve_effect(held.id, digest=held.digest, note="ok", by="treasury")
        assert ob.effect(held.id).status == EffectStatus.PENDING
        return
    with pytest.raises(ApprovalRefused, match="deadline passed"):
        ob.approve_effect(held.id, digest=held.digest, note="sorry I'm late", by="cfo")
    assert ob.effect(held.id).status == effect_status
    assert ob.run(run.id).status == run_status
    assert outcomes(ob, held.id)[-1] == "approval_refused"
    assert "timed_out" in outcomes(ob, held.id)


def test_the_sweep_acts_on_deadlines_nobody_looked_at(ob: Outbox) -> None:
    _, held = pay(ob, 1, approval={"timeout": 0.2})
    _, patient = pay(ob, 2, approval={"timeout": 3600})
    assert ob.expire_approvals() == {}
    time.sleep(0.4)
    assert ob.expire_approvals() == {"rejected": 1}
    assert ob.effect(held.id).status == EffectStatus.REJECTED
    assert ob.effect(held.id).last_error == "approval deadline passed"
    assert ob.effect(patient.id).status == EffectStatus.AWAITING_APPROVAL


def test_a_cancelled_run_cancels_its_held_effects(gated: Outbox) -> None:
    run, large = pay(gated, 12_500)
    assert gated.cancel(run.id, "changed our mind") == RunStatus.CANCELLED
    assert gated.effect(large.id).status == EffectStatus.CANCELLED


CONDITIONS: list[tuple[dict[str, Any], dict[str, Any], bool]] = [
    ({"pointer": "/a", "op": "eq", "value": 1}, {"a": 1.0}, True),
    ({"pointer": "/a", "op": "eq", "value": 1}, {"a": "1"}, True),
    ({"pointer": "/a", "op": "eq", "value": 1}, {"a": "2"}, False),
    ({"pointer": "/a", "op": "eq", "value": "USD"}, {"a": ["USD"]}, True),
    ({"pointer": "/a", "op": "eq", "value": None}, {"a": "x"}, False),
    ({"pointer": "/a", "op": "ne", "value": "prod"}, {"a": "prod"}, False),
    ({"pointer": "/a", "op": "ne", "value": "prod"}, {"a": ["prod"]}, True),
    ({"pointer": "/a", "op": "ne", "value": 1}, {"a": 2}, True),
    ({"pointer": "/a", "op": "ne", "value": 1}, {}, False),
    ({"pointer": "/a", "op": "gt", "value": 10}, {"a": 10.5}, True),
    ({"pointer": "/a", "op": "gt", "value": 10}, {"a": "99"}, True),
    ({"pointer": "/a", "op": "gt", "value": 10}, {"a": "9.5"}, False),
    ({"pointer": "/a", "op": "gt", "value": 10}, {"a": "1e3"}, True),
    ({"pointer": "/a", "op": "gt", "value": 10}, {"a": " 9"}, True),
    ({"pointer": "/a", "op": "gt", "value": 10}, {"a": "1e99999"}, True),
    ({"pointer": "/a", "op": "gt", "value": 10}, {"a": "9" * 101}, True),
    ({"pointer": "/a", "op": "gt", "value": 10}, {"a": [5]}, True),
    ({"pointer": "/a", "op": "gt", "value": 10}, {"a": {"v": 5}}, True),
    ({"pointer": "/a", "op": "gt", "value": 10}, {"a": None}, True),
    ({"pointer": "/a", "op": "gt", "value": 10}, {}, False),
    ({"pointer": "/a", "op": "ge", "value": 10}, {"a": 10}, True),
    ({"pointer": "/a", "op": "lt", "value": 0}, {"a": -1}, True),
    ({"pointer": "/a", "op": "le", "value": 0}, {"a": True}, True),
    ({"pointer": "/a", "op": "le", "value": 0}, {"a": 1}, False),
    ({"pointer": "/a", "op": "in", "value": ["EUR", "USD"]}, {"a": "USD"}, True),
    ({"pointer": "/a", "op": "in", "value": ["EUR", "USD"]}, {"a": "GBP"}, False),
    ({"pointer": "/a", "op": "in", "value": ["EUR", "USD"]}, {"a": ["USD"]}, True),
    ({"pointer": "/a", "op": "in", "value": [1, 2]}, {"a": "2"}, True),
    ({"pointer": "/a", "op": "in", "value": [1, 2]}, {"a": "3"}, False),
    ({"pointer": "/a", "op": "type", "value": "number"}, {"a": 5}, True),
    ({"pointer": "/a", "op": "type", "value": "number"}, {"a": "5"}, True),
    ({"pointer": "/a", "op": "type", "value": "array"}, {"a": []}, True),
    ({"pointer": "/a", "op": "type", "value": "number"}, {}, False),
    ({"pointer": "/a/0/b", "op": "eq", "value": "x"}, {"a": [{"b": "x"}]}, True),
    ({"pointer": "/a~1b", "op": "exists"}, {"a/b": None}, True),
    ({"pointer": "/a", "op": "exists"}, {"b": 1}, False),
    ({"pointer": "", "op": "eq", "value": {"k": [1]}}, {"k": [1]}, True),
]


@pytest.mark.parametrize(("condition", "payload", "held"), CONDITIONS)
def test_the_rule_language_as_postgresql_evaluates_it(
    ob: Outbox, condition: dict[str, Any], payload: dict[str, Any], held: bool
) -> None:
    ob.apply_gates([Gate(name="g", kind="k.rule", when=[condition])])
    run = ob.start_run("a", "1")
    effect_id = run.transaction("s", lambda tx: str(tx.intend("k.rule", payload).id))
    expected = EffectStatus.AWAITING_APPROVAL if held else EffectStatus.PENDING
    assert ob.effect(effect_id).status == expected


@pytest.mark.parametrize(
    ("amount", "held", "reason"),
    [
        (50_000, True, None),
        (5_000, False, None),
        ("50000", True, None),
        ("5000", False, None),
        ([50_000], True, "/json/amount is an array, not a number (gt 10000)"),
        ("50 000", True, "/json/amount is a string, not a number (gt 10000)"),
        (True, True, "/json/amount is a boolean, not a number (gt 10000)"),
    ],
)
def test_a_gate_is_not_passed_by_quoting_or_wrapping_the_number(
    gated: Outbox, amount: Any, held: bool, reason: str | None
) -> None:
    _, effect = pay(gated, amount)
    if not held:
        assert effect.status == EffectStatus.PENDING
        return
    assert effect.status == EffectStatus.AWAITING_APPROVAL
    assert effect.approval["gate"] == "large-payments"
    assert effect.approval.get("reason") == reason


def test_a_payload_stored_by_reference_meets_the_gate_too(gated: Outbox) -> None:
    run = gated.start_run("payer", "1")
    payload = {"json": {"amount": "50000"}, "memo": "x" * 20_000}
    effect_id = run.transaction("pay", lambda tx: str(tx.intend("payments.send", payload).id))
    assert gated.effect(effect_id).status == EffectStatus.AWAITING_APPROVAL


def test_the_strict_form_holds_every_amount_that_is_not_a_json_number(ob: Outbox) -> None:
    strict = [
        {"pointer": "/json/amount", "op": "type", "value": "number"},
        {"pointer": "/json/amount", "op": "gt", "value": 10_000},
    ]
    ob.apply_gates([Gate(name="strict", kind="payments.send", when=strict)])
    assert pay(ob, 5_000)[1].status == EffectStatus.PENDING
    assert pay(ob, 50_000)[1].status == EffectStatus.AWAITING_APPROVAL
    quoted = pay(ob, "5000")[1]
    assert quoted.status == EffectStatus.AWAITING_APPROVAL
    assert quoted.approval["reason"] == "/json/amount is a string, not a number"
    # a value no condition can judge names each reason
    listed = pay(ob, ["5000"])[1]
    assert listed.approval["reason"] == (
        "/json/amount is an array, not a number; /json/amount is an array, not a number (gt 10000)"
    )


@pytest.mark.parametrize(
    ("table", "error"),
    [
        ({"pointer": "a", "op": "eq", "value": 1}, "JSON Pointer"),
        ({"pointer": "/a", "op": "gt", "value": "10"}, "value must be a number"),
        ({"pointer": "/a", "op": "in", "value": []}, "non-empty list"),
        ({"pointer": "/a", "op": "like", "value": 1}, "op"),
        ({"pointer": "/a", "op": "type", "value": "int"}, "names a JSON type"),
        ({"pointer": "/a", "op": "type"}, "names a JSON type"),
    ],
)
def test_bad_conditions_are_refused_by_name(table: dict[str, Any], error: str) -> None:
    from deliverers.registry import parse_config

    with pytest.raises(ConfigurationError, match=rf"^approvals\[0\]\.when\[0\].*{error}"):
        parse_config({"approvals": [{"name": "g", "kind": "k", "when": [table]}]})


def test_gates_are_stored_replaced_listed_and_pruned(ob: Outbox) -> None:
    first = Gate(name="a", kind="k", when=[{"pointer": "/n", "op": "gt", "value": 1}], timeout="2h")
    ob.apply_gates([first, Gate(name="b", kind="k")])
    assert [g.name for g in ob.gates()] == ["a", "b"]
    assert ob.gates()[0] == first and ob.gates()[0].timeout == 7200
    ob.apply_gates([Gate(name="a", kind="k2")], prune=True)
    assert [(g.name, g.kind) for g in ob.gates()] == [("a", "k2")]
    assert ob.remove_gates(["a", "zzz"]) == ["a"]


def test_the_async_twin_approves_and_rejects(gated: Outbox, dsn: str) -> None:
    _, first = pay(gated, 20_000)
    _, second = pay(gated, 30_000)

    async def main() -> None:
        async with await AsyncOutbox.connect(dsn) as aob:
            with pytest.raises(ApprovalRefused):
                await aob.approve_effect(first.id, digest=second.digest, note="x", by="cfo")
            done = await aob.approve_effect(first.id, digest=first.digest, note="ok", by="cfo")
            assert done.status == EffectStatus.PENDING
            gone = await aob.reject_effect(second.id, note="no", by="cfo")
            assert gone.status == EffectStatus.REJECTED
            assert [g.name for g in await aob.gates()] == ["large-payments"]

    asyncio.run(main())


def test_the_async_twin_has_dry_runs_diffs_and_the_audit(ob: Outbox, dsn: str) -> None:
    live, _ = pay(ob, 7)

    async def main() -> None:
        async with await AsyncOutbox.connect(dsn) as aob:
            dry = await aob.start_run("payer", "1", mode="dry_run")
            assert dry.dry_run

            async def step(tx: Any) -> None:
                await tx.intend("payments.send", {"json": {"amount": 7}})

            await dry.transaction("pay", step)
            [effect] = await dry.effects()
            assert effect.kind == "dry-run:payments.send"
            assert (await aob.diff_runs(live.id, dry.id)).identical
            assert await aob.verify_run(dry.id) == []
            record = await aob.audit_record(dry.id)
            assert record["run"]["mode"] == "dry_run" and len(record["steps"]) == 1
            assert await aob.expire_approvals() == {}

    asyncio.run(main())


def test_a_held_effect_of_a_paused_run_stays_held_until_both_let_go(gated: Outbox) -> None:
    """Governance meets run control: a pause keeps a gate's hold, an approval the pause's."""
    run, large = pay(gated, 12_500)
    assert gated.pause(run.id, "legal review").value == "paused"
    # the pause does not turn the gate's hold into its own (resume would skip the approval)
    assert gated.effect(large.id).status == EffectStatus.AWAITING_APPROVAL
    approved = gated.approve_effect(large.id, digest=large.digest, note="ok", by="cfo")
    assert approved.status == EffectStatus.PAUSED  # approved, and held by the pause
    gated.resume(run.id)
    assert gated.effect(large.id).status == EffectStatus.PENDING
