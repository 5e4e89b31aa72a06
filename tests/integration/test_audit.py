"""The tamper-evident record: chains computed by PostgreSQL, recomputed by `outbox audit verify`;
a signed export checked by the independent script of docs/reference/audit.md."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner

from deliverers.testing import RecordingDeliverer
from outbox import EffectStatus, Outbox
from outbox.cli import cli as outbox_cli
from outbox.cli.audit import OUTSIDE_RUNS
from outbox.governance.chain import verify_record
from outbox.governance.gates import Gate
from outbox.shards import SHARDS, on_shard, shard_of
from outbox.storage.async_store import AsyncStore
from outbox.storage.attempts import Completion
from outbox.storage.engine import make_async_engine
from outbox.storage.sql.queue import EFFECT_QUEUE
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


def in_process_cli(dsn: str, *args: str) -> tuple[int, str]:
    """The CLI in this process (a subprocess costs seconds of start-up per case)."""
    done = CliRunner().invoke(outbox_cli, ["--dsn", dsn, *args], catch_exceptions=False)
    return done.exit_code, done.output


@pytest.fixture
def history(ob: Outbox, dsn: str) -> Iterator[Any]:
    """A run with a call, a wait on a signal, steps with effects, state and plan, deliveries
    and an approval; and an effect written outside any run, delivered."""
    ob.apply_gates(
        [Gate(name="big", kind="k.pay", when=[{"pointer": "/n", "op": "gt", "value": 5}])]
    )
    run = ob.start_run("auditor", "1", {"month": "2026-10", "note": "naïve ✓"})
    run.call("fetch", lambda: {"rows": [1, 2, 3]})

    def first(tx: Any) -> str:
        tx.set_state({"paid": False, "left": 9})
        tx.set_plan(["pay", "post"])
        tx.intend("k.post", {"n": 1})
        tx.intend("k.post", {"n": 2, "text": "ünïcode"})
        return str(tx.intend("k.pay", {"n": 9}).id)

    paid = run.transaction("first", first)
    threading.Timer(0.3, lambda: ob.signal(run.id, "go", {"by": "cfo"})).start()
    run.wait_signal("wait-go", name="go", timeout=30)
    run.transaction("second", lambda tx: tx.intend("k.post", {"n": 3}) and None)
    held = ob.effect(paid)
    ob.approve_effect(held.id, digest=held.digest, note="ok", by="cfo")
    with ob.transaction() as tx:
        outside = tx.intend("k.post", {"n": 4, "run": None}).id
    deliverers = {"k.post": RecordingDeliverer("k.post"), "k.pay": RecordingDeliverer("k.pay")}
    with DaemonThread(dsn, deliverers, poll_seconds=0.05):
        wait_for(
            lambda: (
                all(e.status == EffectStatus.SUCCEEDED for e in run.effects())
                and ob.effect(outside).status == EffectStatus.SUCCEEDED
            )
        )
    run.complete({"done": True})
    yield run


def sql(dsn: str, statement: str, *params: Any) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(statement, params)


def test_an_untouched_history_verifies(
    ob: Outbox, dsn: str, history: Any, sub_env: dict[str, str]
) -> None:
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
    assert "1 run(s) and 1 effect(s) outside runs" in in_process_cli(dsn, "audit", "verify")[1]
    steps = {s["step_id"]: s for s in record["steps"]}
    assert steps["first"]["state"] == {"paid": False, "left": 9}
    assert steps["first"]["plan"] == ["pay", "post"]


#: What is edited by hand, and the first break verify must report. The run's edits are
#: reported under its id, those of effects outside runs under OUTSIDE_RUNS.
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
    # what a fork restarts from, and the status, are part of the step's link
    "step state": (
        "UPDATE outbox_steps SET state = '{\"paid\": true, \"left\": 0}' WHERE step_id = 'first'",
        r"step 'first': its hash does not follow",
    ),
    "step plan": (
        "UPDATE outbox_steps SET plan = '[\"post\"]' WHERE step_id = 'first'",
        r"step 'first': its hash does not follow",
    ),
    "step state set where none was": (
        "UPDATE outbox_steps SET state = '{\"paid\": true}' WHERE step_id = 'second'",
        r"step 'second': its hash does not follow",
    ),
    "step status": (
        "UPDATE outbox_steps SET status = 'waiting' WHERE step_id = 'fetch'",
        r"step 'fetch': it has a hash but is waiting, not completed",
    ),
    # a step with no hash is only a wait under way
    "step inserted without a hash": (
        "INSERT INTO outbox_steps (run_id, shard, seq, step_id, kind, result) "
        "SELECT id, shard, step_count + 1, 'refund', 'transaction', '{\"refunded\": 500}' "
        "FROM outbox_runs",
        r"step 'refund': it is completed but has no hash",
    ),
    "step hash removed": (
        "UPDATE outbox_steps SET hash = NULL WHERE step_id = 'second'",
        r"step 'second': it is completed but has no hash",
    ),
    # effects written outside any run have chains too
    "attempt detail outside runs": (
        "UPDATE outbox_effect_attempts SET detail = '{\"forged\": true}' WHERE effect_id = "
        "(SELECT id FROM outbox_effects WHERE run_id IS NULL)",
        r"effect \S+ attempt-log row \d+ \(succeeded\): its hash does not match",
    ),
    "payload outside runs": (
        "UPDATE outbox_effects SET payload = '{\"n\": 400}' WHERE run_id IS NULL",
        r"effect \S+: its payload does not match payload_hash",
    ),
}


@pytest.mark.parametrize("what", sorted(TAMPERING))
def test_editing_a_row_by_hand_makes_verify_fail_and_name_it(
    ob: Outbox, dsn: str, history: Any, what: str
) -> None:
    statement, named = TAMPERING[what]
    sql(dsn, statement)
    # Without RUN verify checks every run and every effect outside runs.
    code, out = in_process_cli(dsn, "audit", "verify", "--json")
    assert code == 1, out
    report = json.loads(out)
    where = OUTSIDE_RUNS if what.endswith("outside runs") else str(history.id)
    assert report["intact"] is False and list(report["broken"]) == [where]
    first_break = report["broken"][where][0]
    assert re.search(named, first_break), first_break
    if where == OUTSIDE_RUNS:
        assert ob.verify_run(history.id) == []
        code, out = in_process_cli(dsn, "audit", "verify")
        assert code == 1 and "0 of 1 run(s); 1 break(s) in effects outside runs" in out, out
        return
    code, out = in_process_cli(dsn, "audit", "verify", str(history.id), "--json")
    assert code == 1 and re.search(named, json.loads(out)["broken"][where][0]), out
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


# How every step was chained before migration 0021 (what 0010's backfill did): v1 links.
V1_CHAIN = """
DO $$
DECLARE
    s record;
    head bytea;
BEGIN
    SELECT outbox_run_genesis(id, agent, inputs_hash) INTO head FROM outbox_runs WHERE id = '{run}';
    FOR s IN SELECT * FROM outbox_steps WHERE run_id = '{run}' AND status = 'completed'
              ORDER BY seq LOOP
        head := outbox_step_hash(head, s.run_id, s.step_id, s.kind, s.result, s.error,
                                 s.completed_at);
        UPDATE outbox_steps SET hash = head WHERE run_id = s.run_id AND step_id = s.step_id;
    END LOOP;
    UPDATE outbox_runs SET step_head = head WHERE id = '{run}';
END
$$
"""


def signed(record: dict[str, Any]) -> str:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    from outbox.governance.chain_signing import sign_record

    pem = ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return json.dumps(sign_record(record, pem))


def test_steps_chained_before_0021_still_verify_and_new_steps_follow_them(
    ob: Outbox, dsn: str, tmp_path: Path
) -> None:
    run = ob.start_run("a", "1")
    run.transaction("old", lambda tx: tx.set_state({"v": 1}))
    sql(dsn, V1_CHAIN.format(run=run.id))
    assert ob.verify_run(run.id) == []
    run.transaction("new", lambda tx: tx.set_state({"v": 2}))
    record = ob.audit_record(run.id)
    assert verify_record(record) == []
    script = independent_script(tmp_path)

    def script_verdict(text: str) -> subprocess.CompletedProcess[str]:
        path = tmp_path / "record.json"
        path.write_text(text)
        return subprocess.run(
            [sys.executable, str(script), str(path)], capture_output=True, text=True, timeout=60
        )

    mixed = script_verdict(signed(record))
    assert mixed.returncode == 0, mixed.stdout + mixed.stderr
    # The new step's v3 link covers its state, in the database and in a record.
    forged = json.loads(json.dumps(record))
    forged["steps"][1].update(state={"v": 3}, state_text='{"v": 3}', state_value_text='{"v": 3}')
    assert "step 'new' does not follow" in script_verdict(signed(forged)).stderr
    inserted = {**record["steps"][1], "step_id": "refund", "hash": None}
    forged["steps"] = [*record["steps"], inserted]
    assert "step 'refund' is completed with hash None" in script_verdict(signed(forged)).stderr
    sql(dsn, "UPDATE outbox_steps SET state = '{\"v\": 3}' WHERE step_id = 'new'")
    assert "step 'new': its hash does not follow" in str(ob.verify_run(run.id)[0])


def test_a_step_recorded_through_sql_covers_its_state_and_plan(ob: Outbox, dsn: str) -> None:
    # outbox_commit_step (the SQL API, migration 0021) computes the same v2 link as Python.
    run = ob.start_run("a", "1")
    sql(
        dsn,
        "SELECT outbox_commit_step(%s, 'plan-it', result => '1', state => %s, plan => %s)",
        run.id,
        '{"stage": 1}',
        '["a", "b"]',
    )
    assert ob.verify_run(run.id) == []
    assert ob.audit_record(run.id)["steps"][0]["plan"] == ["a", "b"]
    sql(dsn, "UPDATE outbox_steps SET plan = '[\"b\"]' WHERE step_id = 'plan-it'")
    assert "step 'plan-it': its hash does not follow" in str(ob.verify_run(run.id)[0])


def test_a_completion_links_its_attempts_itself_and_a_stale_report_chains_after(
    ob: Outbox, dsn: str
) -> None:
    """The completion computes the link of each attempt that changed its effect in its own
    statement (the chain trigger does not run for it); a stale report of the same effect
    in the same batch, or the same outcome twice, is chained by the trigger, after it.
    Verify recomputes every link."""
    run = ob.start_run("auditor", "1")
    run.transaction("s", lambda tx: [tx.intend("k.post", {"n": i}) for i in range(3)] and None)
    sql(dsn, f"ALTER DATABASE {ob.engine.url.database} SET track_functions = 'all'")

    async def deliver() -> tuple[Any, list[tuple[Any, str]]]:
        store = AsyncStore(make_async_engine(dsn))
        try:
            held = await store.claim_many(
                EFFECT_QUEUE, [({"kind": "k.post"}, 3)], owner="w", lease_seconds=30
            )
            assert len(held) == 3
            done = [
                Completion(e.id, e.attempt, "succeeded", "succeeded", result_json=f'{{"n": {i}}}')
                for i, e in enumerate(held)
            ]
            # a late outcome of an earlier attempt of the first effect, first in the
            # batch, and the second effect's outcome twice
            late = Completion(held[0].id, held[0].attempt - 1, "failed", "failed")
            return held[0].id, await store.complete("w", [late, *done, done[1]])
        finally:
            await store.dispose()

    first, logged = asyncio.run(deliver())
    assert sorted(o for _, o in logged) == ["stale", *["succeeded"] * 4]
    with psycopg.connect(dsn, autocommit=True) as conn:
        outcomes = conn.execute(
            "SELECT outcome FROM outbox_effect_attempts WHERE effect_id = %s ORDER BY id",
            [first],
        ).fetchall()

        def calls() -> int:
            row = conn.execute(
                "SELECT calls FROM pg_stat_user_functions WHERE funcname = 'outbox_attempts_chain'"
            ).fetchone()
            return 0 if row is None else int(row[0])

        # A backend reports its function counts when it ends, and the store's backends
        # may still be ending when their connections are closed: wait for the report.
        chained = wait_for(calls, timeout=10, message="the trigger's calls reported")
    assert [o for (o,) in outcomes] == ["succeeded", "stale"], "the stale report chains after"
    assert chained == 2, "the trigger chained the stale report and the repeat alone"
    assert ob.verify_run(run.id) == []


def test_a_large_signal_a_wait_took_verifies_in_the_run_its_fork_and_the_export(
    ob: Outbox, sub_env: dict[str, str], tmp_path: Path
) -> None:
    """The client stores a large signal's payload as canonical JSON; the wait that
    takes it links that text, so verify, a fork's and the exported record's script
    agree (they reported 'result_value_text differs' on an untouched run)."""
    run = ob.start_run("audit-signal", "1")
    ob.signal(run.id, "approve", {"by": "ops", "big": "x" * 20_000, "n": 1.5})
    assert run.wait_signal("ok", name="approve")["by"] == "ops"
    run.call("notify", lambda: {"sent": True})
    stored = ob.engine.connect().exec_driver_sql(
        "SELECT result::text FROM outbox_steps WHERE step_id = 'ok' AND run_id = %(r)s",
        {"r": run.id},
    )
    assert "__outbox_blob__" in stored.scalar_one(), "stored by reference"
    assert ob.verify_run(run.id) == []
    for shard in (shard_of(run.id), (shard_of(run.id) + 1) % SHARDS):
        fork = ob.fork(run.id, "notify", fork_id=on_shard(uuid.uuid4(), shard))
        assert ob.verify_run(fork.id) == []
    key, out = tmp_path / "audit.key", tmp_path / "run.json"
    made = cli(sub_env, "audit", "keygen", "--out", str(key))
    assert made.returncode == 0, made.stderr
    exported = cli(sub_env, "audit", "export", str(run.id), "--key", str(key), "--out", str(out))
    assert exported.returncode == 0, exported.stderr
    checked = subprocess.run(
        [sys.executable, str(independent_script(tmp_path)), str(out), made.stdout.strip()],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_a_wait_linked_before_0036_over_the_rendering_of_a_client_blob_verifies(
    ob: Outbox, sub_env: dict[str, str], tmp_path: Path
) -> None:
    """Before migration 0036 a wait's link hashed PostgreSQL's rendering of a blob
    the client stored as canonical JSON: such a link, and the steps after it, still
    verify, in the database and in the exported record."""
    run = ob.start_run("audit-signal", "1")
    ob.signal(run.id, "approve", {"by": "ops", "big": "x" * 20_000})
    run.wait_signal("w", name="approve")
    # the link as outbox_complete_wait wrote it then (the wait is the first step)
    with ob.engine.begin() as conn:
        conn.exec_driver_sql(
            "UPDATE outbox_steps AS s SET hash = outbox_step_link("
            " outbox_run_genesis(r.id, r.agent, r.inputs_hash), r.id, s.step_id, s.kind,"
            " outbox_resolve(s.result)::text, outbox_resolve(s.error)::text, NULL, NULL,"
            " s.completed_at, '') FROM outbox_runs AS r"
            " WHERE r.id = s.run_id AND s.run_id = %(r)s AND s.step_id = 'w'",
            {"r": run.id},
        )
        conn.exec_driver_sql(
            "UPDATE outbox_runs SET step_head = (SELECT hash FROM outbox_steps"
            " WHERE run_id = %(r)s AND step_id = 'w') WHERE id = %(r)s",
            {"r": run.id},
        )
    run.call("after", lambda: {"n": 1})
    assert ob.verify_run(run.id) == []
    fork = ob.fork(run.id, "after")
    assert ob.verify_run(fork.id) == []
    # the rendering stands for the same value only: edited, the step breaks
    key, out = tmp_path / "audit.key", tmp_path / "run.json"
    made = cli(sub_env, "audit", "keygen", "--out", str(key))
    exported = cli(sub_env, "audit", "export", str(run.id), "--key", str(key), "--out", str(out))
    assert exported.returncode == 0, exported.stderr
    script = independent_script(tmp_path)
    checked = subprocess.run(
        [sys.executable, str(script), str(out), made.stdout.strip()],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    record = json.loads(out.read_text())
    step = next(s for s in record["steps"] if s["step_id"] == "w")
    assert step["result_rendered_text"] is not None
    step["result_rendered_text"] = step["result_rendered_text"].replace('"ops"', '"cfo"')
    assert any("rendered_text" in b.reason for b in verify_record(record))
