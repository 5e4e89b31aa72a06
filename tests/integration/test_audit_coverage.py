"""What `outbox audit verify` detects, and what it does not, held to docs/reference/audit.md.

Each label of the document's two lists has hand edits here, made with raw SQL on
a real database; a detected edit must make verify exit 1 naming where it is (and
export refuse to sign), an undetected one must leave verify intact. A label
added to or dropped from either list without a case here fails the first test.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import text

from deliverers.testing import RecordingDeliverer
from outbox import EffectStatus, Outbox, StoredValueAltered
from outbox.cli.audit import OUTSIDE_RUNS
from outbox.storage.dsn import libpq_dsn
from outbox.storage.engine import translate_errors
from tests.integration.test_audit import V1_CHAIN, history, in_process_cli  # noqa: F401
from tests.support import DaemonThread, wait_for

DOC = Path(__file__).resolve().parents[2] / "docs" / "reference" / "audit.md"
BIG = {"text": "x" * 40_000}


def doc_lists() -> tuple[set[str], set[str]]:
    """The labels of the document's "Detected" and "Not detected" lists."""
    text = DOC.read_text()
    section = text.split("### What verify detects and what it does not")[1]
    section = section.split("## An independent verifier")[0]
    detected, undetected = section.split("\nNot detected")

    def labels(part: str) -> set[str]:
        return set(re.findall(r"^- \*\*(.+?)\*\*", part, flags=re.M))

    return labels(detected), labels(undetected)


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def rewritten(where: str, payload: str) -> str:
    """An effect's payload rewritten with the payload_hash that matches it."""
    return (
        f"UPDATE outbox_effects SET payload = '{payload}', payload_hash = '{sha(payload)}' "
        f"WHERE {where}"
    )


def effect_where(n: int) -> str:
    return f"(SELECT id FROM outbox_effects WHERE payload->>'n' = '{n}')"


@pytest.fixture
def scene(ob: Outbox, dsn: str, request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """`history` (tests/integration/test_audit.py) and: a run with large values and open
    effects, an approved effect not yet delivered, an effect outside runs not yet
    attempted, and a cancelled run whose compensation is not yet attempted."""
    story = request.getfixturevalue("history")
    big = ob.start_run("big", "1", {"notes": BIG})

    def large(tx: Any) -> None:
        tx.set_state({"seen": BIG})
        tx.intend("k.later", {"n": 11})
        tx.intend("k.later", {"n": 12, **BIG})
        tx.intend("k.pay", {"n": 7})  # held by history's gate

    big.transaction("large", large)
    big.call("fetch-big", lambda: BIG)
    held = next(e for e in big.effects() if e.status == EffectStatus.AWAITING_APPROVAL)
    ob.approve_effect(held.id, digest=held.digest, note="ok", by="cfo")
    with ob.transaction() as tx:
        tx.intend("k.later", {"n": 5})
    trip = ob.start_run("travel", "1")
    trip.transaction(
        "book",
        lambda tx: tx.intend("k.book", {"n": 21}, compensate=("k.refund", {"n": 22})) and None,
    )
    with DaemonThread(dsn, {"k.book": RecordingDeliverer("k.book")}, poll_seconds=0.05):
        wait_for(lambda: trip.effects()[0].status == EffectStatus.SUCCEEDED)
    ob.cancel(trip.id, "changed plans")
    wait_for(lambda: any(e.compensates for e in ob.effects(run_id=trip.id)))
    yield {"history": story, "big": big, "trip": trip}


def recomputed_newest_row(n: int) -> str:
    """The newest attempt-log row of effect n rewritten with its own link recomputed."""
    return f"""
    UPDATE outbox_effect_attempts a SET detail = '{{"forged": true}}',
        hash = outbox_attempt_link(
            (SELECT p.hash FROM outbox_effect_attempts p
              WHERE p.effect_id = a.effect_id AND p.id < a.id ORDER BY p.id DESC LIMIT 1),
            a.effect_id, a.attempt, a.worker, a.started_at, a.finished_at, a.outcome,
            '{{"forged": true}}', a.effect_status, a.result_hash)
     WHERE a.id = (SELECT max(id) FROM outbox_effect_attempts WHERE effect_id = {effect_where(n)})
    """


#: How effect 9's attempt log looked when every row had a v1 link (before migration 0023).
V1_ATTEMPTS = f"""
DO $$
DECLARE
    a record;
    head bytea;
BEGIN
    SELECT outbox_effect_genesis(id, run_id, kind, idempotency_key, payload_hash) INTO head
      FROM outbox_effects WHERE id = {effect_where(9)};
    FOR a IN SELECT * FROM outbox_effect_attempts WHERE effect_id = {effect_where(9)}
              ORDER BY id LOOP
        head := outbox_attempt_hash(head, a.effect_id, a.attempt, a.worker, a.started_at,
                                    a.finished_at, a.outcome, a.detail);
        UPDATE outbox_effect_attempts SET hash = head, effect_status = NULL, result_hash = NULL
         WHERE id = a.id;
    END LOOP;
END
$$;
"""

HISTORY = "history"  # the breaks are the history run's
BIG_RUN = "big"
OUTSIDE = OUTSIDE_RUNS

#: label -> [(hand edit, whose breaks, what a break must say)]
DETECTED: dict[str, list[tuple[str, str, str]]] = {
    "attempt-log row edited": [
        (
            f"UPDATE outbox_effect_attempts SET worker = 'mallory' WHERE outcome = 'succeeded'"
            f" AND effect_id = {effect_where(1)}",
            HISTORY,
            r"attempt-log row \d+ \(succeeded\): its hash does not match",
        ),
    ],
    "attempt-log row removed": [
        (
            f"DELETE FROM outbox_effect_attempts WHERE outcome = 'approved'"
            f" AND effect_id = {effect_where(9)}",
            HISTORY,
            r"attempt-log row \d+ \(succeeded\): its hash does not match",
        ),
    ],
    "step edited": [
        (
            "UPDATE outbox_steps SET result = '{\"rows\": [1]}' WHERE step_id = 'fetch'",
            HISTORY,
            r"step 'fetch': its hash does not follow",
        ),
        (
            "UPDATE outbox_steps SET status = 'waiting' WHERE step_id = 'fetch'",
            HISTORY,
            r"step 'fetch': it has a hash but is waiting",
        ),
    ],
    "step removed": [
        (
            "DELETE FROM outbox_steps WHERE step_id = 'first'",
            HISTORY,
            r"step 'wait-go': its hash does not follow",
        ),
        (
            "DELETE FROM outbox_steps WHERE step_id = 'second'",
            HISTORY,
            r"step_head is not the last step's hash",
        ),
    ],
    "step inserted": [
        (
            "INSERT INTO outbox_steps (run_id, shard, seq, step_id, kind, result) "
            "SELECT id, shard, step_count + 1, 'refund', 'transaction', '{\"refunded\": 500}' "
            "FROM outbox_runs WHERE agent = 'auditor'",
            HISTORY,
            r"step 'refund': it is completed but has no hash",
        ),
    ],
    "intent deleted": [
        (
            f"DELETE FROM outbox_effect_attempts WHERE effect_id = {effect_where(3)};"
            "DELETE FROM outbox_effects WHERE payload->>'n' = '3'",
            HISTORY,
            r"step 'second': its hash does not follow",
        ),
    ],
    "intent rewritten": [
        (
            rewritten("payload->>'n' = '11'", '{"n": 900}'),
            BIG_RUN,
            r"step 'large': its hash does not follow",
        ),
        (
            "UPDATE outbox_effects SET idempotency_key = 'other' WHERE payload->>'n' = '11'",
            BIG_RUN,
            r"step 'large': its hash does not follow",
        ),
    ],
    "payload edited": [
        (
            "UPDATE outbox_effects SET payload = '{\"n\": 900}' WHERE payload->>'n' = '9'",
            HISTORY,
            r"effect \S+: its payload does not match payload_hash",
        ),
    ],
    "inputs edited": [
        (
            # the inputs never change: a trigger refuses it, unless triggers are off
            "SET session_replication_role = replica;"
            "UPDATE outbox_runs SET inputs = '{\"month\": \"2026-11\"}' WHERE agent = 'auditor'",
            HISTORY,
            r"its inputs do not match inputs_hash",
        ),
    ],
    "effect end forged": [
        (
            "UPDATE outbox_effects SET status = 'failed', result = '{\"forged\": true}', "
            "last_error = 'declined' WHERE payload->>'n' = '9'",
            HISTORY,
            r"effect \S+: it is failed but its newest attempt-log row \(\d+\) recorded succeeded",
        ),
        (
            "UPDATE outbox_effects SET result = '{\"forged\": true}' WHERE payload->>'n' = '9'",
            HISTORY,
            r"effect \S+: its result is not the one its newest attempt-log row \(\d+\) recorded",
        ),
        (
            "UPDATE outbox_effects SET status = 'pending', completed_at = NULL "
            "WHERE payload->>'n' = '9'",
            HISTORY,
            r"effect \S+: it is pending but its newest attempt-log row \(\d+\) recorded succeeded",
        ),
    ],
    "effect log emptied": [
        (
            f"DELETE FROM outbox_effect_attempts WHERE effect_id = {effect_where(3)}",
            HISTORY,
            r"effect \S+: it is succeeded but its attempt log is empty",
        ),
    ],
    "attempt counter raised": [
        (
            "UPDATE outbox_effects SET attempt = attempt + 1 WHERE payload->>'n' = '9'",
            HISTORY,
            r"effect \S+: its attempt counter 2 is above its attempt log's \(1\)",
        ),
    ],
    "compensated forged": [
        (
            "UPDATE outbox_effects SET status = 'compensated' WHERE payload->>'n' = '1'",
            HISTORY,
            r"effect \S+: it is compensated but no compensation succeeded",
        ),
    ],
    "stored value edited": [
        (
            'UPDATE outbox_blobs SET data = \'{"text": "forged"}\' '
            f"WHERE sha256 = '{sha(json.dumps(BIG))}'",
            BIG_RUN,
            r"step 'fetch-big' result: stored value sha256=\w+ does not match its text in "
            "outbox_blobs",
        ),
        (
            'UPDATE outbox_blobs SET data = \'{"notes": "forged"}\' '
            f"WHERE sha256 = '{sha(json.dumps({'notes': BIG}))}'",
            BIG_RUN,
            r"run \S+ inputs: stored value sha256=\w+ does not match",
        ),
        (
            'UPDATE outbox_blobs SET data = \'{"n": 12, "text": "forged"}\' '
            f"WHERE sha256 = '{sha(json.dumps({'n': 12, **BIG}))}'",
            BIG_RUN,
            r"effect \S+ payload: stored value sha256=\w+ does not match",
        ),
    ],
    "effect outside runs edited": [
        (
            "UPDATE outbox_effect_attempts SET detail = '{\"forged\": true}' WHERE effect_id = "
            f"{effect_where(4)}",
            OUTSIDE,
            r"effect \S+ attempt-log row \d+ \(succeeded\): its hash does not match",
        ),
        (
            "UPDATE outbox_effects SET status = 'failed' WHERE payload->>'n' = '4'",
            OUTSIDE,
            r"effect \S+: it is failed but its newest attempt-log row",
        ),
    ],
}

UNDETECTED: dict[str, list[str]] = {
    "chain recomputed": [recomputed_newest_row(9)],
    "open effect's newest rows removed": [
        f"DELETE FROM outbox_effect_attempts WHERE effect_id = {effect_where(7)}"
    ],
    "effect outside runs deleted": ["DELETE FROM outbox_effects WHERE payload->>'n' = '4'"],
    "effect outside runs rewritten": [rewritten("payload->>'n' = '5'", '{"n": 500}')],
    "compensation rewritten": [rewritten("compensates IS NOT NULL", '{"n": 220}')],
    "run row edited": [
        "UPDATE outbox_runs SET result = '{\"done\": false}', state = '{\"paid\": true}' "
        "WHERE agent = 'auditor'"
    ],
    "signal edited": ['UPDATE outbox_signals SET payload = \'{"by": "intern"}\''],
    "waiting step inserted": [
        "INSERT INTO outbox_steps (run_id, shard, seq, step_id, kind, status) "
        "SELECT id, shard, step_count + 1, 'wait-more', 'signal', 'waiting' "
        "FROM outbox_runs WHERE agent = 'auditor'"
    ],
    "old links": [
        "{v1_steps}; UPDATE outbox_steps SET state = '{{\"paid\": true}}' WHERE step_id = 'first'",
        V1_ATTEMPTS
        + "; UPDATE outbox_effects SET status = 'failed', result = '{\"forged\": true}' "
        "WHERE payload->>'n' = '9'",
    ],
    "whole run deleted": ["DELETE FROM outbox_runs WHERE agent = 'travel'"],
}


def test_the_documented_lists_are_the_cases_here() -> None:
    detected, undetected = doc_lists()
    assert detected == set(DETECTED)
    assert undetected == set(UNDETECTED)


def run_sql(dsn: str, statements: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(statements.encode())  # no parameters: several statements may go at once


@pytest.mark.parametrize(
    ("label", "index"), [(k, i) for k, edits in DETECTED.items() for i in range(len(edits))]
)
def test_a_detected_edit_breaks_verify_and_export(
    ob: Outbox, dsn: str, scene: dict[str, Any], tmp_path: Path, label: str, index: int
) -> None:
    statement, whose, says = DETECTED[label][index]
    assert in_process_cli(dsn, "audit", "verify")[0] == 0, "intact before the edit"
    run_sql(dsn, statement)
    code, out = in_process_cli(dsn, "audit", "verify", "--json")
    assert code == 1, out
    broken = json.loads(out)["broken"]
    key = OUTSIDE_RUNS if whose == OUTSIDE else str(scene[whose].id)
    assert key in broken, broken
    assert any(re.search(says, b) for b in broken[key]), broken[key]
    if whose != OUTSIDE:
        assert any(re.search(says, str(b)) for b in ob.verify_run(key))
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519

        pem = ed25519.Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        (tmp_path / "audit.key").write_bytes(pem)
        code, out = in_process_cli(
            dsn, "audit", "export", key, "--key", str(tmp_path / "audit.key")
        )
        assert code == 1 and "does not verify, not exported" in out, out


@pytest.mark.parametrize(
    ("label", "index"), [(k, i) for k, edits in UNDETECTED.items() for i in range(len(edits))]
)
def test_an_undetected_edit_leaves_verify_intact(
    ob: Outbox, dsn: str, scene: dict[str, Any], label: str, index: int
) -> None:
    statement = UNDETECTED[label][index]
    if "{v1_steps}" in statement:
        statement = statement.format(v1_steps=V1_CHAIN.format(run=scene["history"].id))
    run_sql(dsn, statement)
    code, out = in_process_cli(dsn, "audit", "verify", "--json")
    assert code == 0, out


def test_a_blob_is_hashed_on_read(ob: Outbox, dsn: str) -> None:
    run = ob.start_run("big", "1")
    run.transaction("large", lambda tx: tx.intend("k.later", {"n": 12, **BIG}) and None)
    (effect,) = run.effects()
    assert effect.payload == {"n": 12, **BIG}
    digest = sha(json.dumps({"n": 12, **BIG}))
    run_sql(dsn, f"UPDATE outbox_blobs SET data = '{{\"n\": 12}}' WHERE sha256 = '{digest}'")
    with pytest.raises(StoredValueAltered, match=f"sha256={digest}") as raised:
        ob.effect(effect.id)
    assert raised.value.sha256 == digest


def test_the_sql_api_hashes_a_blob_on_read_too(ob: Outbox, dsn: str) -> None:
    run = ob.start_run("big", "1")
    run.transaction("large", lambda tx: {"n": 13, **BIG})
    digest = sha(json.dumps({"n": 13, **BIG}))
    read = "SELECT result FROM outbox_step(%(run)s, 'large')"
    with psycopg.connect(libpq_dsn(dsn)) as conn:
        (intact,) = conn.execute(read, {"run": run.id}).fetchone() or (None,)
    assert intact == {"n": 13, **BIG}
    run_sql(dsn, f"UPDATE outbox_blobs SET data = '{{\"n\": 1}}' WHERE sha256 = '{digest}'")
    with psycopg.connect(libpq_dsn(dsn)) as conn, pytest.raises(psycopg.Error) as caught:
        conn.execute(read, {"run": run.id})
    assert caught.value.sqlstate == "OB012" and f"sha256={digest}" in str(caught.value)
    # a client of the SQL API gets the typed error naming the value
    with (
        pytest.raises(StoredValueAltered, match=f"sha256={digest}") as raised,
        translate_errors("reading a step"),
        ob.engine.connect() as conn,
    ):
        conn.execute(text("SELECT result FROM outbox_step(:run, 'large')"), {"run": run.id})
    assert raised.value.sha256 == digest


def test_a_compensated_run_verifies(ob: Outbox, dsn: str) -> None:
    trip = ob.start_run("travel", "1")
    trip.transaction(
        "book",
        lambda tx: tx.intend("k.book", {"n": 21}, compensate=("k.refund", {"n": 22})) and None,
    )
    sinks = {k: RecordingDeliverer(k) for k in ("k.book", "k.refund")}
    with DaemonThread(dsn, sinks, poll_seconds=0.05):
        wait_for(lambda: trip.effects()[0].status == EffectStatus.SUCCEEDED)
        ob.cancel(trip.id, "changed plans")
        wait_for(
            lambda: (
                ob.advance_stopping_runs() is not None
                and {e.status for e in ob.effects(run_id=trip.id)}
                == {EffectStatus.COMPENSATED, EffectStatus.SUCCEEDED}
            ),
            timeout=20,
        )
    assert ob.verify_run(trip.id) == []
