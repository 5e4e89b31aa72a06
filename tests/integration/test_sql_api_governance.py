"""The SQL API under governance (migration 0010): the same gates, dry runs and step chain.

An intent written through ``outbox_intend`` is held by the gates the Python
client's statement evaluates (``outbox_gates``) and may ask for approval itself;
a held intent is released only by an approval naming its digest. In a dry run
the intent goes to the dry-run namespace and asks for no approval. Steps
recorded through ``outbox_commit_step`` join the run's hash chain, so ``outbox
audit verify`` checks a run driven from another language like any other.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from sqlalchemy import text

from outbox import ApprovalRefused, EffectStatus, Outbox, ValidationError
from outbox.governance.gates import Gate
from outbox.governance.intent_rules import RESERVED_KIND_PREFIXES
from outbox.models import DRY_RUN_KIND_PREFIX
from outbox.payloads import content_hash, jsonb_text
from outbox.storage.engine import translate_errors
from tests.sql_api_support import intend, sqlstate_of, start_run

PAYMENT = {"to": "acct-7", "amount": 12_500}
LARGE = Gate(
    name="large-payments",
    kind="payments.send",
    when=[{"pointer": "/amount", "op": "gt", "value": 10_000}],
    timeout=3600,
    on_timeout="reject",
)


@pytest.fixture
def db(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn) as conn:
        yield conn


def _step(db: Any, run_id: uuid.UUID, step_id: str, *intents: dict[str, Any]) -> list[Any]:
    rows = [
        intend(db, item["kind"], item["payload"], run_id=run_id, step_id=step_id, **item["kw"])
        for item in intents
    ]
    db.execute("SELECT outbox_commit_step(%s, %s, result => %s)", [run_id, step_id, "{}"])
    db.commit()
    return rows


def test_a_gate_holds_an_intent_written_through_sql_until_its_own_digest_is_approved(
    db: Any, ob: Outbox
) -> None:
    ob.apply_gates([LARGE])
    run_id = start_run(db)
    small, large = _step(
        db,
        run_id,
        "pay",
        {"kind": "payments.send", "payload": {**PAYMENT, "amount": 500}, "kw": {}},
        {"kind": "payments.send", "payload": PAYMENT, "kw": {}},
    )
    assert ob.effect(small[0]).status == EffectStatus.PENDING
    held = ob.effect(large[0])
    assert held.status == EffectStatus.AWAITING_APPROVAL
    assert held.approval["gate"] == "large-payments"
    assert held.approval["on_timeout"] == "reject"
    assert held.approval_deadline is not None
    left = (held.approval_deadline - datetime.now(UTC)).total_seconds()
    assert 3500 < left <= 3600
    # the digest SQL recorded is the one the Python client computes and an approver names
    assert held.digest == content_hash(jsonb_text(PAYMENT))

    other = content_hash(jsonb_text({**PAYMENT, "amount": 125}))
    with pytest.raises(ApprovalRefused):
        ob.approve_effect(held.id, digest=other, note="ok", by="cfo")
    assert ob.effect(held.id).status == EffectStatus.AWAITING_APPROVAL
    approved = ob.approve_effect(held.id, digest=held.digest, note="minute 14", by="cfo")
    assert approved.status == EffectStatus.PENDING
    status = db.execute("SELECT status FROM outbox_effect_status(%s)", [held.id]).fetchone()
    assert status == ("pending",)


@pytest.mark.parametrize(
    ("amount", "reason"),
    [
        ("50000", None),
        ([50_000], "/amount is an array, not a number (gt 10000)"),
        ({"value": 50_000}, "/amount is an object, not a number (gt 10000)"),
        (None, "/amount is null, not a number (gt 10000)"),
    ],
)
def test_a_gate_is_not_passed_through_sql_by_quoting_or_wrapping_the_number(
    db: Any, ob: Outbox, amount: Any, reason: str | None
) -> None:
    ob.apply_gates([LARGE])
    payload = {**PAYMENT, "amount": amount}
    run_id = start_run(db)
    (staged,) = _step(db, run_id, "pay", {"kind": "payments.send", "payload": payload, "kw": {}})
    inline = db.execute(
        "SELECT effect_ids[1] FROM outbox_commit_step(%s, 'pay-inline', result => '{}',"
        " intents => %s)",
        [run_id, json.dumps([{"kind": "payments.send", "payload": payload}])],
    ).fetchone()
    no_run = intend(db, "payments.send", payload)
    db.commit()
    assert inline is not None
    for effect_id in (staged[0], inline[0], no_run[0]):
        held = ob.effect(effect_id)
        assert held.status == EffectStatus.AWAITING_APPROVAL
        assert held.approval["gate"] == "large-payments"
        assert held.approval.get("reason") == reason


def test_an_intent_of_no_run_is_held_by_a_gate_too(db: Any, ob: Outbox) -> None:
    ob.apply_gates([LARGE])
    row = intend(db, "payments.send", PAYMENT)
    db.commit()
    assert ob.effect(row[0]).status == EffectStatus.AWAITING_APPROVAL


def test_an_intent_can_ask_for_approval_itself_and_a_gate_wins(db: Any, ob: Outbox) -> None:
    policy = {"timeout": 60, "on_timeout": "cancel_run", "escalate_to": "treasury"}
    own = intend(db, "report.send", {"n": 1}, approval=json.dumps(policy))
    plain = intend(db, "report.send", {"n": 2}, approval="true")
    db.commit()
    held = ob.effect(own[0])
    assert held.status == EffectStatus.AWAITING_APPROVAL
    assert held.approval == {"gate": "intent", **policy}
    assert ob.effect(plain[0]).approval == {
        "gate": "intent",
        "timeout": None,
        "on_timeout": "reject",
        "escalate_to": None,
    }
    assert ob.effect(plain[0]).approval_deadline is None

    # a config gate wins over the intent's own (looser) policy
    ob.apply_gates([LARGE])
    both = intend(db, "payments.send", PAYMENT, approval=json.dumps({"timeout": 999_999}))
    db.commit()
    assert ob.effect(both[0]).approval["gate"] == "large-payments"


@pytest.mark.parametrize(
    ("approval", "field"),
    [
        ('"yes"', "approval"),
        ('{"timeout": -1}', "approval.timeout"),
        ('{"timeout": "24h"}', "approval.timeout"),
        ('{"on_timeout": "shrug"}', "approval.on_timeout"),
        ('{"deadline": 5}', "approval.deadline"),
        ('{"escalate_to": "a\\nb"}', "approval.escalate_to"),
    ],
)
def test_a_bad_approval_policy_is_refused_naming_the_field(
    ob: Outbox, approval: str, field: str
) -> None:
    with (
        pytest.raises(ValidationError) as caught,
        translate_errors("intending"),
        ob.engine.begin() as conn,
    ):
        conn.execute(
            text("SELECT outbox_intend('report.send', '{}', approval => :a)"), {"a": approval}
        )
    assert caught.value.field == field


def test_in_a_dry_run_sql_intents_go_to_the_dry_run_namespace_and_are_not_held(
    db: Any, ob: Outbox
) -> None:
    ob.apply_gates([LARGE])
    run = ob.start_run("shop", "1", {"order": 2}, mode="dry_run")
    (row,) = _step(db, run.id, "pay", {"kind": "payments.send", "payload": PAYMENT, "kw": {}})
    effect = ob.effect(row[0])
    assert effect.kind == DRY_RUN_KIND_PREFIX + "payments.send"
    assert effect.status == EffectStatus.PENDING and effect.approval is None
    # a caller's key is namespaced per dry run, as the Python client does
    (keyed,) = _step(
        db, run.id, "again", {"kind": "payments.send", "payload": PAYMENT, "kw": {"key": "k1"}}
    )
    assert keyed[1] == f"{DRY_RUN_KIND_PREFIX}{run.id}:k1"


def test_a_caller_cannot_name_a_dry_run_kind(db: Any) -> None:
    assert sqlstate_of(lambda: intend(db, "dry-run:payments.send", PAYMENT)) == "OB001"
    db.rollback()
    row = db.execute("SELECT outbox_reserved_kind_prefixes()").fetchone()
    assert tuple(row[0]) == RESERVED_KIND_PREFIXES


def test_steps_recorded_through_sql_join_the_runs_hash_chain(db: Any, ob: Outbox) -> None:
    run_id = start_run(db)
    _step(db, run_id, "one", {"kind": "report.send", "payload": {"n": 1}, "kw": {}})
    _step(db, run_id, "two")
    hashes = db.execute(
        "SELECT hash FROM outbox_steps WHERE run_id = %s ORDER BY seq", [run_id]
    ).fetchall()
    assert len(hashes) == 2 and all(h[0] is not None for h in hashes)
    assert ob.verify_run(run_id) == []
    # an edit by hand is found and named
    db.execute(
        "UPDATE outbox_steps SET result = %s WHERE run_id = %s AND step_id = 'one'",
        ['{"forged": true}', run_id],
    )
    db.commit()
    breaks = ob.verify_run(run_id)
    assert breaks and "one" in str(breaks[0])
