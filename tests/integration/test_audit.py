"""The tamper-evident record: chains computed by PostgreSQL, recomputed by `outbox audit verify`;
a signed export checked by the independent script of docs/reference/audit.md."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from deliverers.testing import RecordingDeliverer
from outbox import EffectStatus, Outbox
from outbox.chain import verify_record
from outbox.gates import Gate
from tests.support import DaemonThread, wait_for

ROOT = Path(__file__).resolve().parents[2]


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def history(ob: Outbox, dsn: str) -> Iterator[Any]:
    """A run with a call, a wait on a signal, steps with effects, deliveries and an approval."""
    ob.apply_gates(
        [Gate(name="big", kind="k.pay", when=[{"pointer": "/n", "op": "gt", "value": 5}])]
    )
    run = ob.start_run("auditor", "1", {"month": "2026-10", "note": "naïve ✓"})
    run.call("fetch", lambda: {"rows": [1, 2, 3]})

    def first(tx: Any) -> str:
        tx.intend("k.post", {"n": 1})
        tx.intend("k.post", {"n": 2, "text": "ünïcode"})
        return str(tx.intend("k.pay", {"n": 9}).id)

    paid = run.transaction("first", first)
    threading.Timer(0.3, lambda: ob.signal(run.id, "go", {"by": "cfo"})).start()
    run.wait_signal("wait-go", name="go", timeout=30)
    run.transaction("second", lambda tx: tx.intend("k.post", {"n": 3}) and None)
    held = ob.effect(paid)
    ob.approve_effect(held.id, digest=held.digest, note="ok", by="cfo")
    deliverers = {"k.post": RecordingDeliverer("k.post"), "k.pay": RecordingDeliverer("k.pay")}
    with DaemonThread(dsn, deliverers, poll_seconds=0.05):
        wait_for(lambda: all(e.status == EffectStatus.SUCCEEDED for e in run.effects()))
    run.complete({"done": True})
    yield run


def sql(dsn: str, statement: str, *params: Any) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(statement, params)


def test_an_untouched_history_verifies(ob: Outbox, history: Any, sub_env: dict[str, str]) -> None:
    record = ob.audit_record(history.id)
    assert verify_record(record) == []
    assert [s["step_id"] for s in record["steps"]] == ["fetch", "first", "wait-go", "second"]
    assert all(s["hash"] for s in record["steps"])
    assert record["run"]["step_head"] == record["steps"][-1]["hash"]
    assert [a["outcome"] for a in record["approvals"]] == ["approved"]
    done = cli(sub_env, "audit", "verify", str(history.id))
    assert done.returncode == 0 and "intact" in done.stdout, done.stdout + done.stderr
    everything = json.loads(cli(sub_env, "audit", "verify", "--json").stdout)
    assert everything == {"runs_checked": 1, "intact": True, "broken": {}}


TAMPERING = {
    "attempt detail": (
        "UPDATE outbox_effect_attempts SET detail = '{\"forged\": true}' "
        "WHERE id = (SELECT min(id) FROM outbox_effect_attempts WHERE outcome = 'succeeded')",
        r"effect \S+ attempt-log row \d+ \(succeeded\): its hash does not match",
    ),
    "attempt outcome": (
        "UPDATE outbox_effect_attempts SET outcome = 'rejected' WHERE outcome = 'approved'",
        r"attempt-log row \d+ \(rejected\): its hash does not match",
    ),
    "approval removed": (
        "DELETE FROM outbox_effect_attempts WHERE outcome = 'approved'",
        r"attempt-log row \d+ \(succeeded\): its hash does not match",
    ),
    "step result": (
        "UPDATE outbox_steps SET result = '{\"rows\": [1]}' WHERE step_id = 'fetch'",
        r"step 'fetch': its hash does not follow",
    ),
    "step removed": (
        "DELETE FROM outbox_steps WHERE step_id = 'first'",
        r"step 'wait-go': its hash does not follow",
    ),
    "newest step removed": (
        "DELETE FROM outbox_steps WHERE step_id = 'second'",
        r"step_head is not the last step's hash",
    ),
    "payload": (
        "UPDATE outbox_effects SET payload = '{\"n\": 900}' WHERE payload->>'n' = '9'",
        r"effect \S+: its payload does not match payload_hash",
    ),
}


@pytest.mark.parametrize("what", sorted(TAMPERING))
def test_editing_a_row_by_hand_makes_verify_fail_and_name_it(
    ob: Outbox, dsn: str, history: Any, sub_env: dict[str, str], what: str
) -> None:
    statement, named = TAMPERING[what]
    sql(dsn, statement)
    found = cli(sub_env, "audit", "verify", str(history.id), "--json")
    assert found.returncode == 1, found.stdout + found.stderr
    report = json.loads(found.stdout)
    assert report["intact"] is False and list(report["broken"]) == [str(history.id)]
    first_break = report["broken"][str(history.id)][0]
    assert re.search(named, first_break), first_break
    assert re.search(named, str(ob.verify_run(history.id)[0]))


def independent_script(tmp_path: Path) -> Path:
    """The verifier exactly as docs/reference/audit.md shows it."""
    text = (ROOT / "docs" / "reference" / "audit.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    script = next(b for b in blocks if "NOT VERIFIED" in b)
    path = tmp_path / "verify_record.py"
    path.write_text(script)
    return path


def test_an_exported_record_verifies_with_the_independent_script(
    ob: Outbox, history: Any, sub_env: dict[str, str], tmp_path: Path
) -> None:
    key = tmp_path / "audit.key"
    made = cli(sub_env, "audit", "keygen", "--out", str(key))
    assert made.returncode == 0, made.stderr
    public = made.stdout.strip()
    assert key.stat().st_mode & 0o077 == 0, "the private key is the owner's only"
    out = tmp_path / "run.json"
    exported = cli(
        sub_env, "audit", "export", str(history.id), "--key", str(key), "--out", str(out)
    )
    assert exported.returncode == 0, exported.stderr
    record = json.loads(out.read_text())
    assert record["signature"]["public_key"] == public
    assert record["run"]["inputs"] == {"month": "2026-10", "note": "naïve ✓"}
    assert {a["outcome"] for e in record["effects"] for a in e["attempts"]} >= {
        "approved",
        "succeeded",
    }

    script = independent_script(tmp_path)
    checked = subprocess.run(
        [sys.executable, str(script), str(out), public], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.startswith(f"verified: run {history.id}")

    # A record changed after signing fails; so does one signed by another key.
    record["approvals"][0]["note"] = "approved by the board"
    forged = tmp_path / "forged.json"
    forged.write_text(json.dumps(record))
    refused = subprocess.run(
        [sys.executable, str(script), str(forged)], capture_output=True, text=True
    )
    assert refused.returncode != 0 and "signature" in refused.stderr
    other = subprocess.run(
        [sys.executable, str(script), str(out), "00" * 32], capture_output=True, text=True
    )
    assert other.returncode != 0 and "another key" in other.stderr


def test_a_run_that_does_not_verify_is_not_exported(
    ob: Outbox, dsn: str, history: Any, sub_env: dict[str, str], tmp_path: Path
) -> None:
    key = tmp_path / "audit.key"
    assert cli(sub_env, "audit", "keygen", "--out", str(key)).returncode == 0
    sql(dsn, "UPDATE outbox_steps SET result = '1' WHERE step_id = 'second'")
    refused = cli(sub_env, "audit", "export", str(history.id), "--key", str(key))
    assert refused.returncode == 1 and "does not verify" in refused.stderr
    assert "\n" not in refused.stderr.strip()


def test_migrated_history_is_chained_by_the_migration(ob: Outbox) -> None:
    # Rows written through every path (steps, waits, attempts) verify; the migration's
    # backfill uses the same functions (tests/integration/test_migrations.py checks they agree).
    run = ob.start_run("a", "1")
    run.sleep("nap", 0.01)
    assert verify_record(ob.audit_record(run.id)) == []
