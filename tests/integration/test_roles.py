"""`outbox roles`: each role, logged in for real, does its job and nothing more.

The roles are created by the real command; logins are real PostgreSQL roles
with passwords, members of one group role each; the deliverer is a real
``outbox deliver`` process delivering to a real HTTP sink.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from sqlalchemy import text
from sqlalchemy.engine import make_url

from deliverers.testing import Fault, IdempotentHttpSink
from outbox import DatabaseError, EffectTimeout, Outbox, Run, RunStatus
from outbox.cli import cli
from outbox.shards import SHARDS, shard_of
from outbox.storage.admin.roles import ROLES, STEP_WRITERS, namespace_prefix
from outbox.storage.dsn import libpq_dsn
from outbox.storage.engine import make_engine, translate_errors
from outbox.storage.migrate import migrate
from tests.support import WorkerThread, wait_for

PASSWORD = "a-test-password"


def outbox_cli(dsn: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "outbox", *args],
        env={**os.environ, "OUTBOX_DSN": dsn, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    if check:
        assert done.returncode == 0, done.stderr
    return done


def refused(dsn: str, *args: str) -> str:
    """Run a CLI command that must be refused for lack of a privilege; return its stderr."""
    done = outbox_cli(dsn, *args, check=False)
    assert done.returncode == 1, (args, done.stdout, done.stderr)
    assert "permission denied" in done.stderr or "row-level security" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    return done.stderr


def denied(dsn: str, sql: str, params: dict[str, Any] | None = None) -> str:
    """Run one statement as a login; it must be refused by a privilege or the policy."""
    with psycopg.connect(libpq_dsn(dsn)) as conn, pytest.raises(psycopg.Error) as caught:
        conn.execute(sql, params)
    message = str(caught.value)
    assert "permission denied" in message or "row-level security" in message, message
    return message


@pytest.fixture
def logins(dsn: str) -> Iterator[dict[str, str]]:
    """A DSN per role: ``outbox roles`` run as the owner, then one password login per role."""
    done = CliRunner().invoke(cli, ["--dsn", dsn, "roles", "--json"])
    assert done.exit_code == 0, done.output
    created = json.loads(done.stdout)["roles"]
    assert [r["role"] for r in created] == [f"outbox_{spec.suffix}" for spec in ROLES]
    suffix = uuid.uuid4().hex[:8]
    out: dict[str, str] = {}
    with psycopg.connect(libpq_dsn(dsn), autocommit=True) as conn:
        for spec in ROLES:
            login = f"t_{spec.suffix}_{suffix}"
            conn.execute(
                f"CREATE ROLE {login} LOGIN PASSWORD '{PASSWORD}' IN ROLE outbox_{spec.suffix}"
            )
            url = make_url(dsn).set(username=login, password=PASSWORD)
            out[spec.suffix] = url.render_as_string(hide_password=False)
    yield out
    with psycopg.connect(libpq_dsn(dsn), autocommit=True) as conn:
        for spec in ROLES:
            conn.execute(f"DROP ROLE IF EXISTS t_{spec.suffix}_{suffix}")


@pytest.fixture
def sink() -> Iterator[IdempotentHttpSink]:
    with IdempotentHttpSink() as running:
        yield running


def deliver_as(dsn: str, config: Path, log: Path) -> subprocess.Popen[bytes]:
    """``outbox deliver`` (polling every 0.1 s) as the login of ``dsn``, its output in ``log``."""
    with log.open("wb") as handle:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "outbox", "deliver", "--config", str(config), "--poll", "0.1"],
            env={**os.environ, "OUTBOX_DSN": dsn, "PYTHONUNBUFFERED": "1"},
            stdout=handle,
            stderr=subprocess.STDOUT,
        )


def http_intent(sink: IdempotentHttpSink, op: str) -> dict[str, Any]:
    return {"url": f"{sink.url}/ledger", "json": {"operation": op}}


def test_the_agent_drives_runs_and_cannot_complete_an_effect(
    ob: Outbox, logins: dict[str, str]
) -> None:
    agent_dsn = logins["agent"]
    with Outbox.connect(agent_dsn) as agent:
        run = agent.start_run("billing", "1", {"invoice": 7}, budget=10)
        agent.signal(run.id, "approve", {"by": "ops"}, request_id="req-1")

        def step(tx: Any) -> None:
            tx.spend(1, "llm")
            tx.intend("k.x", {"n": 1}, cost=2, compensate=("k.undo", {"n": 1}))

        run.transaction("s1", step)
        assert run.wait_signal("w1", name="approve") == {"by": "ops"}
        effect = run.effects()[0]
        with pytest.raises(EffectTimeout):
            run.await_effect(effect, timeout=0.05)
        run.sleep("nap", 0)
        run.complete({"ok": True})
        with agent.transaction() as tx:
            tx.intend("k.x", {"n": 2}, key="runless-1")
        assert len(agent.effects()) == 2

        # A worker logged in as the agent claims, drives, parks and finishes runs.
        def handler(r: Run) -> str:
            r.transaction("t", lambda tx: tx.intend("k.x", {"r": str(r.id)}) and None)
            return "done"

        with WorkerThread(agent, "worker-agent", "1", handler):
            worked = agent.start_run("worker-agent", "1")
            wait_for(lambda: ob.run(worked.id).status == RunStatus.COMPLETED)

        # ...and nothing more.
        with pytest.raises(DatabaseError, match="permission denied"):
            agent.resolve_effect(effect.id, outcome="succeeded", note="no", operator="agent")
        with pytest.raises(DatabaseError, match="permission denied"):
            agent.cancel(agent.start_run("billing", "1").id, "not mine either")
    # a budget is the operator's: the agent cannot give itself more of it back
    denied(agent_dsn, "UPDATE outbox_runs SET spent = 0 WHERE id = %(id)s", {"id": run.id})
    denied(agent_dsn, "UPDATE outbox_runs SET reserved = 0 WHERE id = %(id)s", {"id": run.id})
    denied(
        agent_dsn,
        "UPDATE outbox_effects SET status = 'succeeded' WHERE id = %(id)s",
        {"id": effect.id},
    )
    denied(
        agent_dsn,
        "INSERT INTO outbox_effects (id, kind, payload, payload_hash, idempotency_key, status)"
        " VALUES (gen_random_uuid(), 'k.x', '{}', 'h', 'forged', 'succeeded')",
    )
    denied(
        agent_dsn,
        "INSERT INTO outbox_effect_attempts (effect_id, attempt, outcome) "
        "VALUES (%(id)s, 1, 'succeeded')",
        {"id": effect.id},
    )
    denied(agent_dsn, "DELETE FROM outbox_runs")
    assert ob.effect(effect.id).status == "pending"


@pytest.mark.slow
def test_the_deliverer_delivers_and_moves_stopping_runs_on_but_intends_nothing(
    ob: Outbox, logins: dict[str, str], sink: IdempotentHttpSink, tmp_path: Path
) -> None:
    config = tmp_path / "deliverers.toml"
    config.write_text('[kinds."http.request"]\nallow_private = ["127.0.0.1"]\n')
    agent = Outbox.connect(logins["agent"])
    paid = agent.start_run("billing", "1")
    undo = {"url": f"{sink.url}/ledger", "json": {"operation": "refund"}}

    def charge(tx: Any) -> None:
        tx.intend("http.request", http_intent(sink, "charge"), compensate=("http.request", undo))

    def notes(tx: Any) -> None:
        for i in range(3):
            tx.intend("http.request", http_intent(sink, f"note-{i}"))

    paid.transaction("charge", charge)
    plain = agent.start_run("billing", "1")
    plain.transaction("notes", notes)
    deliverer = deliver_as(logins["deliverer"], config, tmp_path / "deliver.log")
    try:
        wait_for(
            lambda: [e.status for e in ob.effects()] == ["succeeded"] * 4,
            timeout=60,
            message="the deliverer role to deliver every intent",
        )
        # Cancelled while a call is in flight: the operator's cancel cannot finish the
        # job; the deliverer's daemon does once the call ends, intending the refund.
        # Long enough for the operator's command to start on a busy machine, shorter
        # than the call's 10 s timeout.
        sink.inject(Fault("hang", times=1, hang_seconds=8))
        paid.transaction("ship", lambda tx: tx.intend("http.request", http_intent(sink, "ship")))
        wait_for(
            lambda: any(e.status == "in_flight" for e in ob.effects(run_id=paid.id)),
            message="the slow call",
        )
        cancel = outbox_cli(logins["operator"], "runs", "cancel", str(paid.id), "--reason", "x")
        assert "cancelling" in cancel.stdout, cancel.stdout
        assert len(ob.effects(run_id=paid.id)) == 2, "the operator intended nothing yet"
        wait_for(
            lambda: ob.run(paid.id).status == RunStatus.COMPENSATED,
            timeout=60,
            message="the deliverer to intend and deliver the refund",
        )
    finally:
        deliverer.terminate()
        deliverer.wait(30)
        agent.close()
    assert deliverer.returncode == 0, (tmp_path / "deliver.log").read_text()[-3000:]
    assert sink.stats()["duplicate_keys_applied"] == []
    original, _, refund = ob.effects(run_id=paid.id)
    assert refund.compensates == original.id and refund.status == "succeeded"
    assert refund.idempotency_key in sink.state.applied

    dsn = logins["deliverer"]
    with Outbox.connect(dsn) as deliverer_ob:
        with (
            pytest.raises(DatabaseError, match="row-level security"),
            deliverer_ob.transaction() as tx,
        ):
            tx.intend("http.request", http_intent(sink, "forged"))
        with pytest.raises(DatabaseError, match="permission denied"):
            deliverer_ob.start_run("billing", "1")
        with pytest.raises(DatabaseError, match="permission denied"):
            deliverer_ob.signal(plain.id, "go")
    charged = next(e for e in ob.effects(run_id=paid.id) if e.compensates is None)
    # Not even a "compensation" the agent never declared.
    denied(
        dsn,
        "INSERT INTO outbox_effects (id, run_id, kind, payload, payload_hash, idempotency_key,"
        " status, compensates) VALUES (gen_random_uuid(), %(run)s, 'http.request',"
        " '{\"url\": \"http://127.0.0.1:1/x\"}', 'h', 'forged-2', 'pending', %(orig)s)",
        {"run": paid.id, "orig": charged.id},
    )
    denied(dsn, "UPDATE outbox_effects SET payload = '{}' WHERE id = %(id)s", {"id": charged.id})
    denied(dsn, "DELETE FROM outbox_effect_attempts")
    denied(dsn, "UPDATE outbox_runs SET state = '{}'")


def test_the_operator_resolves_retries_cancels_and_collects_garbage(
    ob: Outbox, logins: dict[str, str], tmp_path: Path
) -> None:
    run = ob.start_run("billing", "1", key="invoice-7")
    run.transaction(
        "s", lambda tx: [tx.intend("k.x", {"n": i}, key=f"n-{i}") for i in range(3)] and None
    )
    first, second, third = ob.effects(run_id=run.id)
    with ob.transaction() as tx:
        stuck = tx.intend("http.request", {"url": "http://127.0.0.1:9/x"}, key="stuck")
    with ob.engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE outbox_effects SET status = 'in_flight', attempt = 1, lease_owner = 'gone',"
                " lease_expires_at = now() - interval '1 minute' WHERE id = :id"
            ),
            {"id": stuck.id},
        )
        conn.execute(
            text("UPDATE outbox_effects SET status = 'unknown', awaited_by = :run WHERE id = :id"),
            {"id": first.id, "run": run.id},
        )
        # the run parked on the unknown effect (run.await_effect): the resolve wakes it
        conn.execute(
            text("UPDATE outbox_runs SET status = 'waiting', wait_effect = :id WHERE id = :run"),
            {"id": first.id, "run": run.id},
        )
        conn.execute(
            text(
                "UPDATE outbox_effects SET status = 'failed', completed_at = now() WHERE id = :id"
            ),
            {"id": second.id},
        )
    dsn = logins["operator"]
    outbox_cli(dsn, "effects", "resolve", str(first.id), "--as", "succeeded", "--note", "in log")
    outbox_cli(dsn, "effects", "retry", str(second.id))
    assert ob.effect(first.id).status == "succeeded" and ob.effect(second.id).status == "pending"
    assert ob.run(run.id).status == RunStatus.RUNNABLE
    outbox_cli(dsn, "reconcile")
    assert ob.effect(stuck.id).status in ("pending", "unknown")
    outbox_cli(dsn, "runs", "cancel", str(run.id), "--reason", "customer left", "--by", "carol")
    assert ob.run(run.id).status == RunStatus.CANCELLED
    # Each effect the cancel stopped has who and why in its attempt log.
    for stopped in (second, third):
        assert ob.effect(stopped.id).status == "cancelled"
        last = ob.store.attempts(stopped.id)[-1]
        assert (last.outcome, last.worker) == ("cancelled", "carol")
        assert last.detail == {"note": "customer left", "by": "carol", "via": "cli"}
    archive = tmp_path / "gc.jsonl"
    gc = json.loads(
        outbox_cli(dsn, "gc", "--older-than", "0s", "--archive", str(archive), "--json").stdout
    )
    assert gc["deleted"]["outbox_runs"] == 1 and gc["deleted"]["outbox_effects"] == 3
    assert gc["deleted"]["outbox_effect_attempts"] >= 4
    # The callers' keys go with what they named: the run's and its three intents' (each
    # intent's with the copy on its run's shard, when the key hashes to another).
    assert gc["deleted"]["outbox_run_keys"] == 1 and gc["deleted"]["outbox_effect_keys"] >= 3
    with ob.engine.connect() as conn:
        left = conn.execute(
            text("SELECT key FROM outbox_effect_keys UNION ALL SELECT key FROM outbox_run_keys")
        )
        assert set(left.scalars()) == {"stuck"}
    # ...and nothing more.
    with Outbox.connect(dsn) as operator:
        with pytest.raises(DatabaseError, match="permission denied"):
            operator.start_run("billing", "1")
        with pytest.raises(DatabaseError, match="row-level security"), operator.transaction() as tx:
            tx.intend("k.x", {"forged": True})
    denied(dsn, "UPDATE outbox_effects SET payload = '{}'")
    denied(
        dsn,
        "INSERT INTO outbox_signals (id, run_id, name, dedup_key) "
        "VALUES (gen_random_uuid(), gen_random_uuid(), 'x', 'y')",
    )


def test_the_reader_reads_and_changes_nothing(ob: Outbox, logins: dict[str, str]) -> None:
    run = ob.start_run("billing", "1")
    run.transaction("s", lambda tx: tx.intend("k.x", {"n": 1}) and None)
    effect = ob.effects()[0]
    dsn = logins["reader"]
    runner = CliRunner(env={"OUTBOX_DSN": dsn})  # a password in --dsn is warned about
    listed = runner.invoke(cli, ["runs", "list", "--json"])
    assert [r["id"] for r in json.loads(listed.stdout)] == [str(run.id)]
    shown = runner.invoke(cli, ["effects", "show", str(effect.id), "--json"])
    assert json.loads(shown.stdout)["effect"]["id"] == str(effect.id), shown.output
    refused(dsn, "runs", "cancel", str(run.id), "--reason", "x")
    refused(dsn, "effects", "resolve", str(effect.id), "--as", "failed", "--note", "x")
    refused(dsn, "gc", "--older-than", "0s")
    with Outbox.connect(dsn) as reader, pytest.raises(DatabaseError, match="permission denied"):
        reader.start_run("billing", "1")
    for table in ("outbox_runs", "outbox_effects", "outbox_effect_attempts", "outbox_migrations"):
        denied(dsn, f"DELETE FROM {table}")


# Only the roles `outbox roles` makes, by name: roles and memberships are the
# server's, and the other worker's tests add logins to them meanwhile.
GRANTS_SEEN = {
    "policies": "SELECT tablename, policyname, permissive, roles::text, cmd, qual, with_check"
    " FROM pg_policies WHERE tablename LIKE 'outbox%%'",
    "members": "SELECT m.rolname, r.rolname FROM pg_auth_members a"
    " JOIN pg_roles m ON m.oid = a.member JOIN pg_roles r ON r.oid = a.roleid"
    " WHERE m.rolname = ANY(%(names)s)",
    "roles": "SELECT rolname, rolcanlogin, rolinherit, rolbypassrls, rolconfig::text"
    " FROM pg_roles WHERE rolname = ANY(%(names)s)",
    "tables": "SELECT grantee, table_name, privilege_type FROM information_schema.role_table_grants"
    " WHERE grantee = ANY(%(names)s)",
    "columns": "SELECT grantee, table_name, column_name, privilege_type"
    " FROM information_schema.column_privileges WHERE grantee = ANY(%(names)s)",
    "functions": "SELECT p.oid::regprocedure::text, p.proacl::text FROM pg_proc p"
    " WHERE p.proname LIKE 'outbox%%'",
    "settings": "SELECT r.rolname, s.setdatabase, s.setconfig::text FROM pg_db_role_setting s"
    " JOIN pg_roles r ON r.oid = s.setrole WHERE r.rolname = ANY(%(names)s)",
}


def granted(dsn: str, prefix: str) -> dict[str, list[tuple[Any, ...]]]:
    """What the roles of ``prefix`` are and may do, as the catalogs say, in a stable order."""
    names = [f"{prefix}{spec.suffix}" for spec in ROLES]
    with psycopg.connect(libpq_dsn(dsn)) as conn:
        return {
            name: sorted(conn.execute(sql, {"names": names}).fetchall(), key=repr)
            for name, sql in GRANTS_SEEN.items()
        }


@pytest.mark.parametrize("namespace", [None, "again-1.x"])
def test_outbox_roles_run_again_changes_nothing(dsn: str, namespace: str | None) -> None:
    """Run again (after every upgrade, by a deploy script), ``outbox roles`` leaves
    the roles, memberships, grants, policies and settings as they were."""
    args = ["--dsn", dsn, "roles", "--json"]
    prefix = "outbox_"
    if namespace is not None:
        args += ["--namespace", namespace]
        prefix = namespace_prefix(namespace)
    reports, seen = [], []
    for _ in range(2):
        done = CliRunner().invoke(cli, args)
        assert done.exit_code == 0, done.output
        reports.append(json.loads(done.stdout))
        seen.append(granted(dsn, prefix))
    assert reports[0] == reports[1]
    assert [r["role"] for r in reports[1]["roles"]] == [f"{prefix}{s.suffix}" for s in ROLES]
    assert all(seen[0][k] for k in ("roles", "tables", "columns", "functions", "policies"))
    assert seen[0] == seen[1]


def test_roles_print_shows_the_grants(dsn: str) -> None:
    script = outbox_cli(dsn, "roles", "--print", "--prefix", "app1_").stdout
    for spec in ROLES:
        assert f"CREATE ROLE app1_{spec.suffix} NOLOGIN" in script
    assert "UPDATE (awaited_by) ON public.outbox_effects TO app1_agent" in script
    assert "ENABLE ROW LEVEL SECURITY" in script
    bad = outbox_cli(dsn, "roles", "--print", "--prefix", "x; DROP TABLE y", check=False)
    assert bad.returncode == 1 and "prefix" in bad.stderr


def test_governance_under_the_roles_agent_holds_operator_decides_reader_cannot(
    ob: Outbox, logins: dict[str, str], tmp_path: Path
) -> None:
    from outbox import ApprovalRefused
    from outbox.governance.gates import Gate

    config = tmp_path / "deliverers.toml"
    config.write_text(
        '[kinds."payments.send"]\ntype = "http.request"\n\n'
        '[[approvals]]\nname = "all-payments"\nkind = "payments.send"\ntimeout = 3600\n'
    )
    outbox_cli(logins["operator"], "gates", "apply", "--config", str(config))
    assert [g.name for g in ob.gates()] == ["all-payments"]
    with Outbox.connect(logins["agent"]) as agent:
        run = agent.start_run("billing", "1")
        run.transaction("pay", lambda tx: tx.intend("payments.send", {"n": 1}) and None)
        (held,) = run.effects()
        assert held.status == "awaiting_approval"
        assert ob.verify_run(run.id) == [], "the agent's steps are chained"
        with pytest.raises(DatabaseError, match="permission denied"):
            agent.apply_gates([Gate(name="loose", kind="payments.send")])
    with (
        Outbox.connect(logins["reader"]) as reader,
        pytest.raises(DatabaseError, match="permission denied"),
    ):
        reader.approve_effect(held.id, digest=held.digest, note="no", by="reader")
    with Outbox.connect(logins["operator"]) as operator:
        with pytest.raises(ApprovalRefused):
            operator.approve_effect(held.id, digest="0" * 64, note="wrong", by="cfo")
        approved = operator.approve_effect(held.id, digest=held.digest, note="ok", by="cfo")
    assert approved.status == "pending"
    assert [a.outcome for a in ob.store.attempts(held.id)] == ["approval_refused", "approved"]


def refused_as(dsn: str, sql: str, params: dict[str, Any], words: str) -> None:
    """One statement as a login, refused with ``words`` in the message; nothing changed."""
    with psycopg.connect(libpq_dsn(dsn)) as conn, pytest.raises(psycopg.Error) as caught:
        conn.execute(sql, params)
    assert words in str(caught.value), caught.value


def test_a_role_cannot_use_its_column_grants_to_leave_its_lane(
    dsn: str, ob: Outbox, logins: dict[str, str]
) -> None:
    from outbox.governance.gates import Gate

    ob.apply_gates(
        [Gate(name="big", kind="k.pay", when=[{"pointer": "/n", "op": "gt", "value": 10}])]
    )
    run = ob.start_run("billing", "1")
    held_id = run.transaction("pay", lambda tx: str(tx.intend("k.pay", {"n": 99}).id))
    agent, deliverer = logins["agent"], logins["deliverer"]

    # agent: a recorded step's result cannot be rewritten (nor its hash with it): the
    # agent holds no UPDATE on outbox_steps (a role granted one meets the trigger)
    refused_as(
        agent,
        "UPDATE outbox_steps SET result = '\"forged\"', hash = '\\x00'"
        " WHERE run_id = %(run)s AND step_id = 'pay'",
        {"run": run.id},
        "permission denied",
    )
    # agent: a run an operator paused stays paused
    ob.pause(run.id, "audit")
    for sql in (
        "UPDATE outbox_runs SET status = 'runnable' WHERE id = %(run)s",
        "UPDATE outbox_runs SET status = 'running', lease_owner = 'me' WHERE id = %(run)s",
    ):
        refused_as(agent, sql, {"run": run.id}, "paused by an operator")
    assert ob.run(run.id).status == RunStatus.PAUSED
    # deliverer: an effect held for approval is released only by an approval
    for status in ("pending", "running", "succeeded"):
        refused_as(
            deliverer,
            "UPDATE outbox_effects SET status = %(status)s WHERE id = %(id)s",
            {"status": status, "id": held_id},
            "held for approval",
        )
    assert ob.effect(held_id).status == "awaiting_approval"
    # ...while the operator still approves and resumes
    with Outbox.connect(logins["operator"]) as operator:
        operator.approve_effect(held_id, digest=ob.effect(held_id).digest, note="ok", by="ops")
        operator.resume(run.id)
    assert ob.run(run.id).status == RunStatus.RUNNABLE

    # any login: a cap set for the session is only ever lowered
    with psycopg.connect(libpq_dsn(agent)) as conn:
        conn.execute("SET outbox.max_payload_bytes = '1000000000000'")
        conn.execute("SET outbox.max_step_id_length = '100000'")
        limits = conn.execute(
            "SELECT outbox_limit('max_payload_bytes'), outbox_limit('max_step_id_length')"
        ).fetchone()
        assert limits == (64 * 1024 * 1024, 200)
        conn.execute("SET outbox.max_step_id_length = '50'")
        assert conn.execute("SELECT outbox_limit('max_step_id_length')").fetchone() == (50,)
    # the database (its owner) raises a cap
    with psycopg.connect(libpq_dsn(dsn), autocommit=True) as conn:
        name = conn.execute("SELECT current_database()").fetchone()
        assert name is not None
        conn.execute(f'ALTER DATABASE "{name[0]}" SET outbox.max_step_id_length = 300')
    with psycopg.connect(libpq_dsn(agent)) as conn:
        conn.execute("SET outbox.max_step_id_length = '100000'")
        assert conn.execute("SELECT outbox_limit('max_step_id_length')").fetchone() == (300,)


def test_a_signal_is_consumed_only_by_a_wait_of_the_run_it_was_sent_to(
    ob: Outbox, logins: dict[str, str]
) -> None:
    from outbox import SignalTimeout, ValidationError

    mine, theirs = ob.start_run("billing", "1"), ob.start_run("billing", "1")
    ob.signal(theirs.id, "approve", {"by": "ops"})
    agent = logins["agent"]
    # no plain UPDATE marks it consumed (the run would never see it) ...
    for sql in (
        "UPDATE outbox_signals SET consumed_at = now() WHERE run_id = %(run)s",
        "UPDATE outbox_signals SET consumed_by = 'w' WHERE run_id = %(run)s",
    ):
        refused_as(agent, sql, {"run": theirs.id}, "permission denied")
    # ... nor an INSERT of one already consumed
    refused_as(
        agent,
        "INSERT INTO outbox_signals (id, run_id, shard, name, dedup_key, consumed_at)"
        " VALUES (gen_random_uuid(), %(run)s, outbox_shard_of(%(run)s), 'approve', 'x', now())",
        {"run": theirs.id},
        "permission denied",
    )
    # the function takes a run's signal only for a wait of that run for it, which
    # records it: not for another run's wait, not without a wait
    with Outbox.connect(agent) as agent_ob, pytest.raises(SignalTimeout):
        agent_ob.run(mine.id).wait_signal("w", name="approve", timeout=0)
    for run_id in (mine.id, theirs.id):
        with psycopg.connect(libpq_dsn(agent)) as conn, pytest.raises(psycopg.Error) as caught:
            conn.execute(
                "SELECT * FROM outbox_take_signal(outbox_shard_of(%(r)s), %(r)s, 'w', 'approve')",
                {"r": run_id},
            )
        assert caught.value.sqlstate in ("OB001", "OB006"), caught.value
    with Outbox.connect(agent) as agent_ob:
        with (
            pytest.raises(ValidationError, match="is not a wait of run"),
            agent_ob.engine.begin() as conn,
            translate_errors("taking a signal"),
        ):
            conn.execute(
                text(
                    "SELECT * FROM outbox_take_signal(outbox_shard_of(:run), :run, 'w', 'approve')"
                ),
                {"run": theirs.id},
            )
        # the run it was sent to gets it, recorded by its wait step (chained)
        theirs_h = agent_ob.run(theirs.id)
        assert theirs_h.wait_signal("w", name="approve") == {"by": "ops"}
    row = ob.engine.connect().execute(
        text("SELECT consumed_by FROM outbox_signals WHERE run_id = :run"), {"run": theirs.id}
    )
    assert row.scalar_one() == "w"
    assert ob.verify_run(theirs.id) == [] and ob.verify_run(mine.id) == []


def test_the_hash_chain_is_written_only_by_the_step_writers(
    ob: Outbox, logins: dict[str, str]
) -> None:
    agent = logins["agent"]
    with Outbox.connect(agent) as agent_ob:
        run = agent_ob.start_run("billing", "1")
        run.transaction("a", lambda tx: {"n": 1})
        run.sleep("nap", 0)
        run.transaction("b", lambda tx: {"n": 2})
        fork = agent_ob.fork(run.id, "b")
        fork.transaction("b", lambda tx: {"n": 3})
    assert ob.verify_run(run.id) == [] and ob.verify_run(fork.id) == []
    head = ob.engine.connect().execute(
        text("SELECT step_head FROM outbox_runs WHERE id = :run"), {"run": run.id}
    )
    before = head.scalar_one()
    # the agent recomputing a head with the public hash function: refused
    forged_head = (
        "UPDATE outbox_runs SET step_head = outbox_step_link(step_head, id, 'c', 'transaction',"
        " '\"forged\"', NULL, NULL, NULL, now(), '') WHERE id = %(run)s"
    )
    for sql in (
        forged_head,
        "UPDATE outbox_steps SET hash = '\\x00' WHERE run_id = %(run)s",
        # a step of its own making, linked by hand, in the middle of the history
        "INSERT INTO outbox_steps (run_id, shard, seq, step_id, kind, result, hash)"
        " VALUES (%(run)s, outbox_shard_of(%(run)s), 0, 'forged', 'transaction', '1', '\\x00')",
        "INSERT INTO outbox_runs (id, shard, agent, agent_version, inputs_hash, step_head)"
        " SELECT gen_random_uuid(), 0, 'x', '1', 'h', '\\x00' WHERE false",
    ):
        refused_as(agent, sql, {"run": run.id}, "permission denied")
    # the fork's writer refuses a run that is not a fork, and relinks no fork
    refused_as(
        agent,
        "SELECT outbox_chain_fork(outbox_shard_of(%(run)s), %(run)s, ARRAY['a', 'nap'])",
        {"run": run.id},
        "is not a fork",
    )
    heads = text("SELECT id, step_head FROM outbox_runs WHERE id IN (:run, :fork)")
    chained: dict[Any, Any] = dict(
        ob.engine.connect().execute(heads, {"run": run.id, "fork": fork.id}).all()
    )
    with psycopg.connect(libpq_dsn(agent)) as conn:
        conn.execute(
            "SELECT outbox_chain_fork(outbox_shard_of(%(run)s), %(run)s, ARRAY['a', 'nap'])",
            {"run": fork.id},
        )
        conn.commit()
    after: dict[Any, Any] = dict(
        ob.engine.connect().execute(heads, {"run": run.id, "fork": fork.id}).all()
    )
    assert after == chained and after[run.id] == before
    assert ob.verify_run(run.id) == [] and ob.verify_run(fork.id) == []
    # the writers run as the tables' owner: only a login that may record steps calls them
    for role in ("deliverer", "operator", "reader"):
        refused_as(
            logins[role],
            "SELECT * FROM outbox_commit_step(%(run)s, 'c', '1')",
            {"run": run.id},
            "permission denied",
        )
        refused_as(
            logins[role],
            "SELECT * FROM outbox_complete_wait(outbox_shard_of(%(run)s), %(run)s, 'nap')",
            {"run": run.id},
            "permission denied",
        )


# Every UPDATE column grant a role holds, and what it does with it on the rows
# seeded below (a paused run, an effect held for approval, and one row of each
# other table): "allowed: why it is the role's job" or "refused: words of the
# refusal". A grant added without an entry here fails the test below: decide
# whether it is a legitimate transition, or guard it.
ALLOWED_WORK = "allowed: a worker drives its run (leases, waits, results, costs)"
DELIVERY = "allowed: delivery records an attempt's outcome"
STOPPING = "allowed: moving a stopping run on (cancel, compensation, wake)"
APPROVAL_DECISION = "allowed: an approval decision, a deadline or an escalation"
UNPAUSE = "refused: paused by an operator"
RELEASE = "refused: held for approval"
COLUMN_GRANTS: dict[tuple[str, str], dict[str, str]] = {
    ("agent", "outbox_runs"): {
        **{
            c: ALLOWED_WORK
            for c in (
                "agent_version",
                "state",
                "plan",
                "current_step",
                "step_count",
                "result",
                "error",
                "available_at",
                "lease_owner",
                "lease_expires_at",
                "attempt",
                "updated_at",
                "wake_at",
                "wait_signal",
                "wait_effect",
                "step_retries",
                "upgrades",
            )
        },
        "status": UNPAUSE,
    },
    ("agent", "outbox_effects"): {"awaited_by": "allowed: a run awaits an effect"},
    ("agent", "outbox_effect_keys"): {
        c: "allowed: a caller's key registry (intent rows are checked against it)"
        for c in ("effect_id", "run_id", "kind", "payload_hash")
    },
    ("deliverer", "outbox_runs"): {
        **{
            c: STOPPING
            for c in (
                "cancel_reason",
                "available_at",
                "lease_owner",
                "lease_expires_at",
                "wake_at",
                "wait_signal",
                "wait_effect",
                "reserved",
                "spent",
                "updated_at",
                "paused_at",
                "pause_reason",
            )
        },
        "status": UNPAUSE,
    },
    ("deliverer", "outbox_effects"): {
        **{
            c: DELIVERY
            for c in (
                "result",
                "last_error",
                "available_at",
                "lease_owner",
                "lease_expires_at",
                "attempt",
                "attempt_started_at",
                "completed_at",
                "updated_at",
                "attempt_note",
            )
        },
        **{c: APPROVAL_DECISION for c in ("approval", "approval_deadline")},
        "status": RELEASE,
    },
    ("deliverer", "outbox_rate_limits"): {"tat": "allowed: a kind's shared rate"},
    ("deliverer", "outbox_owners"): {"registered_at": "allowed: a daemon's registration"},
    ("deliverer", "outbox_gates"): {
        c: "allowed: `outbox deliver` stores the config's gates"
        for c in (
            "name",
            "kind",
            "conditions",
            "timeout_seconds",
            "on_timeout",
            "escalate_to",
            "updated_at",
        )
    },
    ("operator", "outbox_runs"): {
        **{
            c: STOPPING
            for c in (
                "cancel_reason",
                "available_at",
                "lease_owner",
                "lease_expires_at",
                "wake_at",
                "wait_signal",
                "wait_effect",
                "reserved",
                "spent",
                "updated_at",
                "paused_at",
                "pause_reason",
            )
        },
        "status": "allowed: the operator resumes a paused run",
    },
    ("operator", "outbox_effects"): {
        **{
            c: "allowed: resolve, retry, reconcile"
            for c in (
                "result",
                "last_error",
                "available_at",
                "lease_owner",
                "lease_expires_at",
                "attempt",
                "attempt_started_at",
                "completed_at",
                "updated_at",
                "max_attempts",
            )
        },
        **{c: APPROVAL_DECISION for c in ("approval", "approval_deadline")},
        "status": "allowed: the operator approves a held effect",
    },
    ("operator", "outbox_blobs"): {"used_at": "allowed: gc locks a value nothing uses"},
    ("operator", "outbox_gates"): {
        c: "allowed: the operator manages gates"
        for c in (
            "name",
            "kind",
            "conditions",
            "timeout_seconds",
            "on_timeout",
            "escalate_to",
            "updated_at",
        )
    },
}
# The row each table's tries change (:run is the paused run, :held the held effect).
ROW_OF = {
    "outbox_runs": "id = :run",
    "outbox_effects": "id = :held",
    "outbox_blobs": "true",
    "outbox_effect_keys": "effect_id = :keyed",
    "outbox_rate_limits": "true",
    "outbox_owners": "true",
    "outbox_gates": "true",
}
# A different value of each type (a status: the transition a guard is for).
NEW_VALUE = {
    ("outbox_runs", "status"): "'runnable'",
    ("outbox_effects", "status"): "'pending'",
    ("outbox_gates", "on_timeout"): "'cancel_run'",
}
BY_TYPE = {
    "text": "{c} || '-forged'",
    "jsonb": "'{{\"forged\": true}}'::jsonb",
    "timestamp with time zone": "coalesce({c}, now()) + interval '1 day'",
    "integer": "coalesce({c}, 0) + 1",
    "bigint": "coalesce({c}, 0) + 1",
    "smallint": "coalesce({c}, 0) + 1",
    "numeric": "coalesce({c}, 0) + 1",
    "double precision": "coalesce({c}, 0) + 1",
    "uuid": "gen_random_uuid()",
    "boolean": "NOT {c}",
}


def test_every_update_grant_of_every_role_is_a_legitimate_transition_or_refused(
    dsn: str, ob: Outbox, logins: dict[str, str]
) -> None:
    from outbox.governance.gates import Gate

    ob.apply_gates(
        [Gate(name="big", kind="k.pay", when=[{"pointer": "/n", "op": "gt", "value": 10}])]
    )
    run = ob.start_run("billing", "1")
    held = run.transaction("pay", lambda tx: str(tx.intend("k.pay", {"n": 99}).id))
    keyed = run.transaction(
        "keyed", lambda tx: str(tx.intend("k.x", {"n": 1, "big": "x" * 40_000}, key="mine").id)
    )
    ob.pause(run.id, "audit")
    with psycopg.connect(libpq_dsn(dsn), autocommit=True) as conn:
        conn.execute("INSERT INTO outbox_rate_limits (kind, tat) VALUES ('k.x', now())")
        conn.execute("INSERT INTO outbox_owners (owner) VALUES ('d1')")
        types = dict(
            ((t, c), ty)
            for t, c, ty in conn.execute(
                "SELECT table_name, column_name, data_type FROM information_schema.columns"
                " WHERE table_name LIKE 'outbox%%'"
            )
        )
    params = {"run": run.id, "held": held, "keyed": keyed}
    outcomes: dict[tuple[str, str], dict[str, str]] = {}
    for spec in ROLES:
        login = logins[spec.suffix]
        with psycopg.connect(libpq_dsn(login)) as conn:
            grants = conn.execute(
                "SELECT table_name, column_name FROM information_schema.column_privileges"
                " WHERE grantee = %(role)s AND privilege_type = 'UPDATE'"
                " ORDER BY table_name, column_name",
                {"role": f"outbox_{spec.suffix}"},
            ).fetchall()
            for table, column in grants:
                value = NEW_VALUE.get((table, column)) or BY_TYPE[types[table, column]].format(
                    c=column
                )
                where = ROW_OF[table].replace(":run", "%(run)s").replace(":held", "%(held)s")
                where = where.replace(":keyed", "%(keyed)s")
                try:
                    # one transaction per try, rolled back: each starts from the seeded rows
                    changed = conn.execute(
                        f"UPDATE {table} SET {column} = {value} WHERE {where}", params
                    ).rowcount
                    outcome = "allowed" if changed else "no row"
                except psycopg.Error as exc:
                    outcome = f"refused: {exc.diag.message_primary}"
                conn.rollback()
                outcomes.setdefault((spec.suffix, table), {})[column] = outcome
    # every grant has an entry, and each entry is still a grant
    assert {k: set(v) for k, v in outcomes.items()} == {
        k: set(v) for k, v in COLUMN_GRANTS.items()
    }, outcomes
    for key, columns in COLUMN_GRANTS.items():
        for column, expected in columns.items():
            got = outcomes[key][column]
            if expected.startswith("allowed"):
                assert got == "allowed", (key, column, got)
            else:
                words = expected.removeprefix("refused: ")
                assert got.startswith("refused") and words in got, (key, column, got)


def test_an_upgrade_keeps_who_may_call_the_chain_writers(empty_dsn: str) -> None:
    """0036 gave the chain writers new argument lists (their run's shard first): the
    new ones are callable by whom the old ones were (after `outbox roles`: the agent
    role alone), not by PUBLIC."""
    engine = make_engine(empty_dsn)
    writers = [w for w in STEP_WRITERS if not w.startswith("outbox_write_step")]
    agent, other = (f"t_{who}_{uuid.uuid4().hex[:8]}" for who in ("agent", "other"))
    may = text(
        "SELECT r, has_function_privilege(r, s, 'EXECUTE')"
        " FROM unnest(CAST(:sigs AS text[])) AS s, unnest(CAST(:roles AS text[])) AS r"
    )
    try:
        migrate(engine, target=35)
        # what `outbox roles` of 0035 did to them (this code's refuses that schema)
        old = "outbox_complete_wait(uuid, text, jsonb, jsonb), outbox_take_signal(uuid, text,"
        old += " text), outbox_chain_fork(uuid, uuid)"
        with engine.begin() as conn:
            for role in (agent, other):
                conn.execute(text(f"CREATE ROLE {role}"))
            conn.execute(text(f"REVOKE ALL ON FUNCTION {old} FROM PUBLIC"))
            conn.execute(text(f"GRANT EXECUTE ON FUNCTION {old} TO {agent}"))
        migrate(engine)
        with engine.connect() as conn:
            granted = conn.execute(may, {"sigs": writers, "roles": [agent, other]}).all()
        assert len(granted) == 6
        assert set(granted) == {(agent, True), (other, False)}
    finally:
        with engine.begin() as conn:
            for role in (agent, other):
                conn.execute(text(f"DROP OWNED BY {role}"))
                conn.execute(text(f"DROP ROLE {role}"))
        engine.dispose()


def test_a_chain_writer_given_another_runs_shard_is_refused(
    ob: Outbox, logins: dict[str, str]
) -> None:
    with Outbox.connect(logins["agent"]) as agent:
        run = agent.start_run("billing", "1")
    wrong = (shard_of(run.id) + 1) % SHARDS
    for sql in (
        "SELECT * FROM outbox_complete_wait(%(s)s::smallint, %(run)s, 'nap')",
        "SELECT * FROM outbox_take_signal(%(s)s::smallint, %(run)s, 'nap', 'go')",
        "SELECT outbox_chain_fork(%(s)s::smallint, %(run)s, ARRAY['nap'])",
    ):
        refused_as(logins["agent"], sql, {"s": wrong, "run": run.id}, "is not the shard of run")
