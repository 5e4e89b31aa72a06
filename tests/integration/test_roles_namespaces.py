"""`outbox roles --namespace`: a login confined to a namespace reaches only its runs.

Two namespaces (two teams) get their roles from the real command; each role has a
real password login. What one team's logins do to the other's runs, effects,
steps and signals is refused or finds nothing, by the tables' policies for what
they send themselves and by the step writers, which run as the tables' owner.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from sqlalchemy import text
from sqlalchemy.engine import make_url

from deliverers.testing import IdempotentHttpSink
from outbox import (
    DatabaseError,
    EffectNotFound,
    Outbox,
    RunNotFound,
    RunStatus,
    StepTransaction,
)
from outbox.cli import cli
from outbox.shards import SHARDS, on_shard, shard_of
from outbox.storage.admin.roles import ROLES, namespace_prefix
from outbox.storage.async_store import AsyncStore
from outbox.storage.dsn import libpq_dsn
from outbox.storage.engine import make_async_engine, make_engine
from tests.integration.test_roles import deliver_as
from tests.support import wait_for

PASSWORD = "a-test-password"


@pytest.fixture
def teams(dsn: str) -> Iterator[dict[str, dict[str, str]]]:
    """Per team (billing, support): its namespace and one login DSN per role."""
    suffix = uuid.uuid4().hex[:6]
    # a dot and a dash: a namespace need not be an SQL identifier
    namespaces = {"billing": f"billing-{suffix}", "support": f"support.{suffix}"}
    out: dict[str, dict[str, str]] = {}
    with psycopg.connect(libpq_dsn(dsn), autocommit=True) as conn:
        for team, namespace in namespaces.items():
            # (run again, it changes nothing: test_roles.py)
            done = CliRunner().invoke(
                cli, ["--dsn", dsn, "roles", "--namespace", namespace, "--json"]
            )
            assert done.exit_code == 0, done.output
            report = json.loads(done.stdout)
            prefix = namespace_prefix(namespace)
            assert report["namespace"] == namespace
            assert [r["role"] for r in report["roles"]] == [f"{prefix}{s.suffix}" for s in ROLES]
            out[team] = {"namespace": namespace}
            for spec in ROLES:
                login = f"t_{team}_{spec.suffix}_{suffix}"
                conn.execute(
                    f"CREATE ROLE {login} LOGIN PASSWORD '{PASSWORD}' IN ROLE {prefix}{spec.suffix}"
                )
                url = make_url(dsn).set(username=login, password=PASSWORD)
                out[team][spec.suffix] = url.render_as_string(hide_password=False)
    yield out
    with psycopg.connect(libpq_dsn(dsn), autocommit=True) as conn:
        for team in namespaces:
            for spec in ROLES:
                conn.execute(f"DROP ROLE IF EXISTS t_{team}_{spec.suffix}_{suffix}")


def confined_error(dsn: str, sql: str, params: dict[str, Any]) -> str:
    """Run one statement as a login; it must be refused for lack of a privilege."""
    with psycopg.connect(libpq_dsn(dsn)) as conn, pytest.raises(psycopg.Error) as caught:
        conn.execute(sql, params)
    assert caught.value.sqlstate == "42501", caught.value
    return str(caught.value)


def counted(dsn: str, table: str) -> int:
    with psycopg.connect(libpq_dsn(dsn)) as conn:
        row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
    assert row is not None
    return int(row[0])


def step_ids(ob: Outbox, run_id: uuid.UUID) -> list[str]:
    with ob.engine.connect() as conn:
        found = conn.execute(
            text("SELECT step_id FROM outbox_steps WHERE run_id = :r ORDER BY seq"), {"r": run_id}
        )
        return list(found.scalars())


def test_a_confined_agent_drives_its_own_runs_and_reaches_no_other_namespaces(
    ob: Outbox, teams: dict[str, dict[str, str]]
) -> None:
    billing, support = teams["billing"], teams["support"]
    with Outbox.connect(support["agent"], namespace=support["namespace"]) as theirs_ob:
        theirs = theirs_ob.start_run("triage", "1", key="ticket-9")
        theirs.transaction("s1", lambda tx: tx.intend("k.x", {"n": 1}) and None)
        theirs_ob.signal(theirs.id, "approve", {"by": "support"})
    with Outbox.connect(billing["agent"], namespace=billing["namespace"]) as agent:
        mine = agent.start_run("billing", "1", key="invoice-7", budget=10)
        agent.signal(mine.id, "approve", {"by": "ops"})

        def step(tx: Any) -> None:
            tx.spend(1, "llm")
            tx.intend("k.x", {"n": 2}, key="charge-7")

        mine.transaction("s1", step)
        assert mine.wait_signal("w1", name="approve") == {"by": "ops"}
        mine.sleep("nap", 0)
        fork = agent.fork(mine.id, "nap")
        fork.complete({"forked": True})
        mine.complete({"ok": True})
        # the other team's run is not there for it, nor are its rows
        with pytest.raises(RunNotFound):
            agent.run(theirs.id)
        assert {r.id for r in agent.runs()} == {mine.id, fork.id}
        assert [e.run_id for e in agent.effects()] == [mine.id]
        # a client set to the other namespace cannot start a run there
    with (
        Outbox.connect(billing["agent"], namespace=support["namespace"]) as astray,
        pytest.raises(DatabaseError, match="row-level security"),
    ):
        astray.start_run("triage", "1")
    agent_dsn, owner = billing["agent"], str(ob.settings.dsn)
    for table, theirs_too in (
        ("outbox_runs", 1),
        ("outbox_steps", 1),
        ("outbox_effects", 1),
        ("outbox_signals", 1),
        ("outbox_run_keys", 1),
    ):
        assert counted(owner, table) - counted(agent_dsn, table) == theirs_too, table
    # Each step writer runs as the tables' owner, and refuses a run of another
    # namespace by itself: a step, a wait's end, a signal taken, a fork chained.
    shard = {"run": theirs.id}
    for call in (
        "SELECT * FROM outbox_commit_step(%(run)s, 'forged', intents => "
        '\'[{"kind": "k.x", "payload": {"n": 666}}]\')',
        "SELECT * FROM outbox_complete_wait(outbox_shard_of(%(run)s), %(run)s, 's1', '1')",
        "SELECT * FROM outbox_take_signal(outbox_shard_of(%(run)s), %(run)s, 'w', 'approve')",
        "SELECT outbox_chain_fork(outbox_shard_of(%(run)s), %(run)s, '{s1}')",
    ):
        message = confined_error(agent_dsn, call, shard)
        assert f"confined to namespace {billing['namespace']}" in message, message
        assert f"in namespace {support['namespace']}" in message, message
    # switching to its own group role sheds nothing (on Citus a role that may not
    # log in cannot reach the workers at all)
    with psycopg.connect(libpq_dsn(agent_dsn)) as conn, pytest.raises(psycopg.Error) as caught:
        conn.execute(f"SET ROLE {namespace_prefix(billing['namespace'])}agent")
        distributed = conn.execute("SELECT outbox_distributed()").fetchone() == (True,)
        conn.execute("SELECT * FROM outbox_commit_step(%(run)s, 'forged')", shard)
    assert caught.value.sqlstate == ("08006" if distributed else "42501"), caught.value
    # what it sends itself meets the tables' policies: a signal, a run, a takeover
    for sql in (
        "INSERT INTO outbox_signals (id, run_id, shard, name, dedup_key) VALUES "
        "(gen_random_uuid(), %(run)s, outbox_shard_of(%(run)s), 'approve', 'forged')",
        "INSERT INTO outbox_runs (id, shard, agent, agent_version, status, namespace) VALUES "
        "(%(run)s::uuid, outbox_shard_of(%(run)s::uuid), 'x', '1', 'running', 'default')",
    ):
        assert "row-level security" in confined_error(agent_dsn, sql, {"run": uuid.uuid4()})
    with psycopg.connect(libpq_dsn(agent_dsn)) as conn:
        moved = conn.execute(
            "UPDATE outbox_runs SET lease_owner = 'me', status = 'running' WHERE id = %(run)s",
            shard,
        )
        assert moved.rowcount == 0
    # nothing of theirs changed, and their record verifies
    assert step_ids(ob, theirs.id) == ["s1"]
    assert ob.run(theirs.id).status == RunStatus.RUNNABLE
    assert ob.verify_run(theirs.id) == [] and ob.verify_run(fork.id) == []
    assert ob.verify_run(mine.id) == []


def test_confined_operators_and_readers_see_and_change_only_their_namespace(
    ob: Outbox, teams: dict[str, dict[str, str]]
) -> None:
    billing, support = teams["billing"], teams["support"]
    started: dict[str, tuple[uuid.UUID, uuid.UUID]] = {}
    for team in ("billing", "support"):
        with Outbox.connect(teams[team]["agent"], namespace=teams[team]["namespace"]) as agent:
            run = agent.start_run("job", "1")
            run.transaction("s1", lambda tx: tx.intend("k.x", {"n": 1}) and None)
            started[team] = (run.id, run.effects()[0].id)
    (mine, my_effect), (theirs, their_effect) = started["billing"], started["support"]
    runner = CliRunner(env={"OUTBOX_DSN": billing["reader"]})
    listed = runner.invoke(cli, ["runs", "list", "--json"])
    assert listed.exit_code == 0, (listed.output, listed.exception)
    assert [r["id"] for r in json.loads(listed.stdout)] == [str(mine)], listed.output
    effects = runner.invoke(cli, ["effects", "list", "--json"])
    assert effects.exit_code == 0, (effects.output, effects.exception)
    assert [e["id"] for e in json.loads(effects.stdout)] == [str(my_effect)], effects.output
    operator = CliRunner(env={"OUTBOX_DSN": billing["operator"]})
    for args in (
        ["runs", "cancel", str(theirs), "--reason", "not ours"],
        ["runs", "pause", str(theirs), "--reason", "not ours"],
        ["effects", "resolve", str(their_effect), "--as", "failed", "--note", "x"],
        ["effects", "retry", str(their_effect)],
    ):
        done = operator.invoke(cli, args)
        assert isinstance(done.exception, RunNotFound | EffectNotFound), (args, done.exception)
    with psycopg.connect(libpq_dsn(billing["operator"])) as conn:
        for sql in (
            "DELETE FROM outbox_steps WHERE run_id = %(run)s",
            "DELETE FROM outbox_runs WHERE id = %(run)s",
            "UPDATE outbox_effects SET status = 'cancelled' WHERE run_id = %(run)s",
        ):
            assert conn.execute(sql, {"run": theirs}).rowcount == 0, sql
    # its own namespace it manages as an operator does
    done = operator.invoke(cli, ["runs", "cancel", str(mine), "--reason", "ours"])
    assert done.exit_code == 0, done.output
    assert ob.run(theirs).status == RunStatus.RUNNABLE
    assert ob.effect(their_effect).status == "pending"
    assert step_ids(ob, theirs) == ["s1"]
    # and a support login sees billing's no more than billing sees support's
    with psycopg.connect(libpq_dsn(support["reader"])) as conn:
        seen = conn.execute("SELECT id FROM outbox_runs").fetchall()
    assert [r[0] for r in seen] == [theirs]


@pytest.mark.slow
def test_a_confined_deliverer_delivers_only_its_namespaces_effects(
    ob: Outbox, teams: dict[str, dict[str, str]], tmp_path: Path
) -> None:
    billing, support = teams["billing"], teams["support"]
    config = tmp_path / "deliverers.toml"
    config.write_text('[kinds."http.request"]\nallow_private = ["127.0.0.1"]\n')
    with IdempotentHttpSink() as sink:
        for team in ("billing", "support"):
            with Outbox.connect(teams[team]["agent"], namespace=teams[team]["namespace"]) as a:
                run = a.start_run("pay", "1")
                for i in range(3):
                    intent = {"url": f"{sink.url}/ledger", "json": {"operation": f"{team}-{i}"}}

                    def step(tx: StepTransaction, intent: dict[str, Any] = intent) -> None:
                        tx.intend("http.request", intent)

                    run.transaction(f"s{i}", step)
                with a.transaction() as tx:  # and an intent of no run
                    tx.intend(
                        "http.request",
                        {"url": f"{sink.url}/ledger", "json": {"operation": f"{team}-9"}},
                    )
        deliverer = deliver_as(billing["deliverer"], config, tmp_path / "deliver.log")
        try:
            wait_for(
                lambda: len(sink.state.operations) == 4,
                timeout=60,
                message="the billing deliverer to deliver billing's four effects",
            )
            # a few more polls (0.1 s each): support's effects stay where they were
            time.sleep(1.5)
        finally:
            deliverer.terminate()
            deliverer.wait(timeout=30)
        assert sorted(sink.state.operations) == [f"billing-{i}" for i in (0, 1, 2, 9)]
    statuses = {e.payload["json"]["operation"]: e.status for e in ob.effects()}
    assert {op for op, status in statuses.items() if status == "succeeded"} == {
        f"billing-{i}" for i in (0, 1, 2, 9)
    }
    assert {op for op, status in statuses.items() if status == "pending"} == {
        f"support-{i}" for i in (0, 1, 2, 9)
    }
    with ob.engine.connect() as conn:
        attempts = conn.execute(
            text(
                "SELECT count(*) FROM outbox_effect_attempts a JOIN outbox_effects e "
                "ON e.id = a.effect_id WHERE e.namespace = :ns"
            ),
            {"ns": support["namespace"]},
        ).scalar_one()
    assert attempts == 0


def test_outbox_roles_again_after_the_upgrade_brings_the_policies_of_0038(dsn: str) -> None:
    """Before 0038 `outbox roles` made three check functions of its own and a
    restrictive policy using them; run again, it leaves only permissive policies
    and the function files' checks."""
    engine = make_engine(dsn)
    try:
        with engine.begin() as conn:
            for old in (
                "outbox_gates_clear(kind text, payload jsonb, s text, a jsonb)",
                "outbox_run_takes_intent(run uuid, s text)",
                "outbox_is_declared_compensation(o uuid, run uuid, k text, p jsonb)",
            ):
                conn.execute(
                    text(
                        f"CREATE OR REPLACE FUNCTION {old} RETURNS boolean"
                        " LANGUAGE sql AS 'SELECT true'"
                    )
                )
            conn.execute(text("ALTER TABLE outbox_effects ENABLE ROW LEVEL SECURITY"))
            for policy in ("outbox_every_row", "outbox_intents"):
                conn.execute(text(f"DROP POLICY IF EXISTS {policy} ON outbox_effects"))
            conn.execute(
                text(
                    "CREATE POLICY outbox_every_row ON outbox_effects AS PERMISSIVE FOR ALL"
                    " TO PUBLIC USING (true) WITH CHECK (true)"
                )
            )
            conn.execute(
                text(
                    "CREATE POLICY outbox_intents ON outbox_effects AS RESTRICTIVE FOR INSERT"
                    " TO PUBLIC WITH CHECK (outbox_gates_clear(kind, payload, status, approval)"
                    " AND outbox_run_takes_intent(run_id, status)"
                    " AND outbox_is_declared_compensation(id, run_id, kind, payload))"
                )
            )
        done = CliRunner().invoke(cli, ["--dsn", dsn, "roles", "--json"])
        assert done.exit_code == 0, done.output
        with engine.connect() as conn:
            kinds = conn.execute(
                text("SELECT DISTINCT polpermissive FROM pg_policy WHERE polname LIKE 'outbox_%'")
            ).scalars()
            assert set(kinds) == {True}
            left = conn.execute(
                text(
                    "SELECT proname FROM pg_proc WHERE proname IN ('outbox_gates_clear',"
                    " 'outbox_run_takes_intent', 'outbox_is_declared_compensation')"
                )
            ).scalars()
            assert list(left) == []
    finally:
        engine.dispose()


def test_a_confined_login_cannot_write_into_another_namespaces_run(
    ob: Outbox, teams: dict[str, dict[str, str]]
) -> None:
    """An effect is its run's namespace's: one of A's namespace written into B's run
    (A's policies see only the new row) would be delivered, and break B's record."""
    billing, support = teams["billing"], teams["support"]
    with Outbox.connect(support["agent"], namespace=support["namespace"]) as theirs_ob:
        theirs = theirs_ob.start_run("triage", "1")
        theirs.transaction(
            "s1", lambda tx: tx.intend("k.x", {"n": 1}, compensate=("k.undo", {"n": 1})) and None
        )
    forged = (
        "INSERT INTO outbox_effects (id, run_id, step_id, step_index, kind, payload,"
        " payload_hash, idempotency_key, status, shard, namespace, compensates) VALUES"
        " (outbox_on_shard(gen_random_uuid(), outbox_shard_of(%(run)s)), %(run)s, 's1', 7,"
        " %(kind)s, %(payload)s, 'h', %(key)s, 'pending', outbox_shard_of(%(run)s), %(ns)s,"
        " %(original)s)"
    )
    with ob.engine.begin() as conn:  # their effect succeeded, their run is being cancelled
        conn.execute(
            text("UPDATE outbox_effects SET status = 'succeeded' WHERE run_id = :r"),
            {"r": theirs.id},
        )
        conn.execute(
            text("UPDATE outbox_runs SET status = 'cancelling' WHERE id = :r"), {"r": theirs.id}
        )
    original = ob.effects(run_id=theirs.id)[0].id
    for who, kind, payload, compensates in (
        ("agent", "k.x", '{"n": 666}', None),  # an intent into their run
        ("deliverer", "k.undo", '{"n": 1}', original),  # their declared compensation
        ("operator", "k.undo", '{"n": 1}', original),
    ):
        params = {
            "run": theirs.id,
            "kind": kind,
            "payload": payload,
            "key": f"forged-{who}",
            "ns": billing["namespace"],
            "original": compensates,
        }
        message = confined_error(billing[who], forged, params)
        assert "row-level security" in message, message
    assert len(ob.effects(run_id=theirs.id)) == 1


def test_a_confined_operators_gc_leaves_the_large_values_every_namespace_shares(
    ob: Outbox, teams: dict[str, dict[str, str]]
) -> None:
    billing, support = teams["billing"], teams["support"]
    # a value no other test stores: on a cluster a value is a row per shard, and an
    # earlier test's equal value on the run's shard would be shared, not added
    big = {"text": uuid.uuid4().hex + "g" * 40_000}
    tables = ("outbox_blobs", "outbox_blob_refs")
    # (on a cluster, the module's earlier tests left theirs)
    before = {table: counted(str(ob.settings.dsn), table) for table in tables}
    with Outbox.connect(support["agent"], namespace=support["namespace"]) as theirs_ob:
        run = theirs_ob.start_run("triage", "1")
        effect_id = uuid.UUID(run.transaction("s1", lambda tx: str(tx.intend("k.x", big).id)))
    done = CliRunner(env={"OUTBOX_DSN": billing["operator"]}).invoke(
        cli, ["gc", "--older-than", "0s", "--json"]
    )
    assert done.exit_code == 0, (done.output, done.exception)
    assert json.loads(done.stdout)["values_left"] is True
    assert ob.effect(effect_id).payload == big
    for table in tables:
        assert counted(str(ob.settings.dsn), table) == before[table] + 1, table
        message = confined_error(billing["operator"], f"DELETE FROM {table}", {})
        assert "permission denied" in message


def test_a_confined_login_cannot_shadow_what_its_policies_call(
    dsn: str, teams: dict[str, dict[str, str]]
) -> None:
    """A login with a schema of its own puts a function of the same name first on
    its search path: the policies call what they were made with."""
    billing, support = teams["billing"], teams["support"]
    with Outbox.connect(support["agent"], namespace=support["namespace"]) as theirs_ob:
        theirs_ob.start_run("triage", "1")
    login = make_url(billing["operator"]).username
    with psycopg.connect(libpq_dsn(dsn), autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {login} AUTHORIZATION {login}")
    try:
        seen, changed = shadowed(billing["operator"], str(login))
    finally:
        with psycopg.connect(libpq_dsn(dsn), autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {login} CASCADE")
    assert seen == (0,) and changed == 0


def shadowed(operator: str, login: str) -> tuple[Any, int]:
    """As ``operator``: its own functions first on its path, then what it sees and changes."""
    with psycopg.connect(libpq_dsn(operator)) as conn:
        conn.execute(f"SET search_path = {login}, public")
        for name, result in (
            ("outbox_session_namespaces", "text[] LANGUAGE sql AS 'SELECT NULL::text[]'"),
            ("pg_has_role", "boolean LANGUAGE sql AS 'SELECT false'"),
        ):
            conn.execute(
                f"CREATE FUNCTION {login}.{name}(a name, b text, c text) RETURNS {result}"
                if name == "pg_has_role"
                else f"CREATE FUNCTION {login}.{name}() RETURNS {result}"
            )
        seen = conn.execute("SELECT count(*) FROM outbox_runs").fetchone()
        changed = conn.execute("UPDATE outbox_runs SET pause_reason = 'x'").rowcount
    return seen, changed


def test_two_namespaces_cannot_share_one_set_of_roles(dsn: str) -> None:
    runner = CliRunner()
    suffix = uuid.uuid4().hex[:6]
    first = runner.invoke(cli, ["--dsn", dsn, "roles", "--namespace", f"a-{suffix}"])
    assert first.exit_code == 0, first.output
    second = runner.invoke(cli, ["--dsn", dsn, "roles", "--namespace", f"a.{suffix}"])
    assert second.exit_code == 1
    assert "is confined to another namespace" in str(second.exception)
    long = runner.invoke(cli, ["--dsn", dsn, "roles", "--namespace", "n" * 40])
    assert long.exit_code == 1 and "--prefix" in str(long.exception)


def test_the_plain_roles_pay_nothing_for_the_namespace_policies(
    dsn: str, teams: dict[str, dict[str, str]]
) -> None:
    """With namespaces confined, the policies for other roles ask pg_has_role of each
    row; a plain `outbox roles` login's own policy is `true`, which PostgreSQL folds
    them into: its claim's plan filters on nothing of theirs."""
    done = CliRunner().invoke(cli, ["--dsn", dsn, "roles"])
    assert done.exit_code == 0, done.output
    plain, own = (f"t_{who}_{uuid.uuid4().hex[:6]}" for who in ("plain", "own"))
    claim = (
        "EXPLAIN SELECT id FROM outbox_effects WHERE status = 'pending'"
        " ORDER BY available_at LIMIT 10 FOR UPDATE SKIP LOCKED"
    )
    with psycopg.connect(libpq_dsn(dsn), autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {plain} IN ROLE outbox_deliverer")
        conn.execute(f"CREATE ROLE {own}")
        conn.execute(f"GRANT SELECT, UPDATE ON outbox_effects TO {own}")
        try:
            plans = {}
            for role in (plain, own):
                conn.execute(f"SET ROLE {role}")
                plans[role] = "\n".join(row[0] for row in conn.execute(claim))
                conn.execute("RESET ROLE")
        finally:
            conn.execute("RESET ROLE")
            conn.execute(f"DROP OWNED BY {own}")
            for role in (plain, own):
                conn.execute(f"DROP ROLE {role}")
    assert "pg_has_role" not in plans[plain], plans[plain]
    assert "pg_has_role" in plans[own], plans[own]  # (what the plain role is spared)


def as_login(dsn: str, sql: str, params: dict[str, Any]) -> Any:
    """One statement's first row, as a login (its own transaction, committed)."""
    with psycopg.connect(libpq_dsn(dsn)) as conn:
        return conn.execute(sql, params).fetchone()


def one_run(team: dict[str, str], *, compensated: bool = False) -> tuple[uuid.UUID, uuid.UUID]:
    """A run of the team's namespace with one intent (declaring a compensation, or not)."""
    with Outbox.connect(team["agent"], namespace=team["namespace"]) as agent:
        run = agent.start_run("triage", "1")
        compensate = ("k.undo", {"n": 1}) if compensated else None
        run.transaction("s1", lambda tx: tx.intend("k.x", {"n": 1}, compensate=compensate) and None)
        return run.id, run.effects()[0].id


# What each check the policies call tells a caller about run `run` (effect `effect`)
# of namespace `ns`: the one a stopping run's compensation `k.undo {"n": 1}` is of.
CHECKS = {
    "row_in_namespace(run)": (
        "SELECT outbox_row_in_namespace('outbox_runs', outbox_shard_of(%(run)s), %(run)s, %(ns)s)"
    ),
    "row_in_namespace(effect)": (
        "SELECT outbox_row_in_namespace('outbox_effects', outbox_shard_of(%(run)s), %(effect)s,"
        " %(ns)s)"
    ),
    "intent_of_live_run": "SELECT outbox_intent_of_live_run(%(live)s, 'pending', %(ns)s)",
    "compensation_declared": (
        "SELECT outbox_compensation_declared(%(effect)s, %(run)s, 'k.undo', '{\"n\": 1}', %(ns)s)"
    ),
    "run_holds": "SELECT paused, stopping FROM outbox_run_holds(%(run)s, outbox_shard_of(%(run)s))",
}


def stopping_with_a_succeeded_effect(ob: Outbox, run: uuid.UUID) -> None:
    with ob.engine.begin() as conn:
        conn.execute(
            text("UPDATE outbox_effects SET status = 'succeeded' WHERE run_id = :r"), {"r": run}
        )
        conn.execute(text("UPDATE outbox_runs SET status = 'cancelling' WHERE id = :r"), {"r": run})


@pytest.mark.parametrize("check", list(CHECKS))
def test_the_policies_checks_tell_a_confined_login_nothing_of_another_namespace(
    ob: Outbox, teams: dict[str, dict[str, str]], check: str
) -> None:
    """The checks run as the tables' owner and every login may call them: asked
    about another namespace's rows, they answered what the policies hide (a run
    there exists, is live, is stopping; an effect succeeded, and what it declared)."""
    billing, support = teams["billing"], teams["support"]
    answers: dict[str, dict[str, Any]] = {}
    for team in (billing, support):
        run, effect = one_run(team, compensated=True)
        live, _ = one_run(team)
        stopping_with_a_succeeded_effect(ob, run)
        answers[team["namespace"]] = {"run": run, "effect": effect, "live": live}
    truth = (False, True) if check == "run_holds" else (True,)
    sql = CHECKS[check]
    theirs = {**answers[support["namespace"]], "ns": support["namespace"]}
    mine = {**answers[billing["namespace"]], "ns": billing["namespace"]}
    # a session no namespace confines is told, and so is the rows' own namespace's
    assert as_login(str(ob.settings.dsn), sql, theirs) == truth
    assert as_login(billing["agent"], sql, mine) == truth
    assert as_login(support["reader"], sql, theirs) == truth
    for role in ("agent", "deliverer", "operator", "reader"):
        if check == "run_holds":  # (a trigger asks it: refused, not told "no such run")
            message = confined_error(billing[role], sql, theirs)
            assert f"confined to namespace {billing['namespace']}" in message, message
            assert f"run {theirs['run']} is not in it" in message, message
            assert support["namespace"] not in message, message
        else:
            assert as_login(billing[role], sql, theirs) == (False,), role
            # (naming its own namespace for their rows: false before the fix too)
            assert as_login(billing[role], sql, {**theirs, "ns": mine["ns"]}) == (False,), role


def test_a_confined_login_still_inserts_and_reopens_its_own_namespaces_effects(
    ob: Outbox, teams: dict[str, dict[str, str]]
) -> None:
    """What the policies and the trigger call the checks for, with the login's own
    rows: an agent's hand-written intent, a deliverer's declared compensation, a
    reader's steps, an effect of a paused run put back to pending."""
    billing = teams["billing"]
    ns = billing["namespace"]
    live, _ = one_run(billing)
    stopping, original = one_run(billing, compensated=True)
    stopping_with_a_succeeded_effect(ob, stopping)
    insert = (
        "INSERT INTO outbox_effects (id, run_id, step_id, step_index, kind, payload,"
        " payload_hash, idempotency_key, status, shard, namespace, compensates) VALUES"
        " (outbox_on_shard(gen_random_uuid(), outbox_shard_of(%(run)s)), %(run)s, 's1', 7,"
        " %(kind)s, %(payload)s, 'h', %(key)s, 'pending', outbox_shard_of(%(run)s), %(ns)s,"
        " %(original)s) RETURNING id"
    )
    for who, run, kind, compensates in (
        ("agent", live, "k.x", None),
        ("deliverer", stopping, "k.undo", original),
    ):
        params = {
            "run": run,
            "kind": kind,
            "payload": '{"n": 1}',
            "key": f"by-hand-{who}",
            "ns": ns,
            "original": compensates,
        }
        assert as_login(billing[who], insert, params) is not None, who
    assert len(ob.effects(run_id=live)) == 2 and len(ob.effects(run_id=stopping)) == 2
    assert as_login(billing["reader"], "SELECT count(*) FROM outbox_steps", {}) == (2,)
    # a failed effect its operator retries while the run is paused: held, not sent
    paused, effect = one_run(billing)
    ob.pause(paused, reason="held")
    with ob.engine.begin() as conn:
        conn.execute(
            text("UPDATE outbox_effects SET status = 'failed' WHERE id = :e"), {"e": effect}
        )
    retried = as_login(
        billing["operator"],
        "UPDATE outbox_effects SET status = 'pending' WHERE id = %(e)s RETURNING status",
        {"e": effect},
    )
    assert retried == ("paused",) and ob.effect(effect).status == "paused"


def test_a_role_given_a_namespace_by_hand_tells_its_confined_member_nothing(
    ob: Outbox, teams: dict[str, dict[str, str]]
) -> None:
    """Only the group roles `outbox roles --namespace` made count: a role that was
    given outbox.namespace by hand confines nothing through the policies, so a
    billing login in one is still told nothing of that namespace's rows."""
    billing, support = teams["billing"], teams["support"]
    live, _ = one_run(support)
    hand = f"by_hand_{uuid.uuid4().hex[:6]}"
    login = make_url(billing["agent"]).username
    with psycopg.connect(libpq_dsn(str(ob.settings.dsn)), autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {hand}")
        conn.execute(f"ALTER ROLE {hand} SET outbox.namespace = '{support['namespace']}'")
        conn.execute(f"GRANT {hand} TO {login}")
    try:
        params = {"live": live, "ns": support["namespace"]}
        assert as_login(billing["agent"], CHECKS["intent_of_live_run"], params) == (False,)
        assert as_login(billing["agent"], "SELECT count(*) FROM outbox_runs", {}) == (0,)
    finally:
        with psycopg.connect(libpq_dsn(str(ob.settings.dsn)), autocommit=True) as conn:
            conn.execute(f"DROP ROLE {hand}")


def namespace_lookups(dsn: str, run: uuid.UUID, step: str) -> int:
    """One step of ``run`` as a login: how often it read the namespaces' role settings."""
    with psycopg.connect(libpq_dsn(dsn)) as conn:
        conn.execute("SELECT * FROM outbox_commit_step(%s, %s)", (run, step))
        row = conn.execute(
            "SELECT coalesce(sum(calls), 0) FROM pg_stat_xact_user_functions"
            " WHERE funcname = 'outbox_session_namespaces'"
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_session_no_namespace_confines_records_a_step_without_the_namespace_lookup(
    ob: Outbox, teams: dict[str, dict[str, str]]
) -> None:
    """Once one namespace was confined, every step of every session read the
    namespaces' role settings (60-70 us a step), superusers' and plain logins' too;
    only a session in a confined role needs them."""
    dsn = str(ob.settings.dsn)
    done = CliRunner().invoke(cli, ["--dsn", dsn, "roles"])
    assert done.exit_code == 0, done.output
    plain = f"t_plain_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(libpq_dsn(dsn), autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {plain} LOGIN PASSWORD '{PASSWORD}' IN ROLE outbox_agent")
        # (track_functions is a superuser's to set: for these logins, on the role)
        for login in (plain, make_url(teams["billing"]["agent"]).username):
            conn.execute(f"ALTER ROLE {login} SET track_functions = 'all'")
    plain_dsn = make_url(dsn).set(username=plain, password=PASSWORD)
    billing = teams["billing"]
    try:
        with Outbox.connect(billing["agent"], namespace=billing["namespace"]) as agent:
            confined_run = agent.start_run("triage", "1").id
        unconfined_run = ob.start_run("triage", "1").id
        assert namespace_lookups(billing["agent"], confined_run, "s1") >= 1
        assert namespace_lookups(plain_dsn.render_as_string(False), unconfined_run, "s1") == 0
        with psycopg.connect(libpq_dsn(dsn)) as conn:
            conn.execute("SET track_functions = 'all'")
            conn.execute("SELECT * FROM outbox_commit_step(%s, 's2')", (unconfined_run,))
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_xact_user_functions"
                " WHERE funcname = 'outbox_session_namespaces'"
            ).fetchone()
            assert row == (0,)
            # (and the calls are counted: the step's own function is there)
            assert conn.execute(
                "SELECT calls FROM pg_stat_xact_user_functions WHERE funcname = 'outbox_write_step'"
            ).fetchone() == (1,)
        # still confined where it counts: another namespace's run is refused
        message = confined_error(
            billing["agent"], "SELECT * FROM outbox_commit_step(%(r)s, 's3')", {"r": unconfined_run}
        )
        assert "confined to namespace" in message, message
    finally:
        with psycopg.connect(libpq_dsn(dsn), autocommit=True) as conn:
            conn.execute(f"DROP OWNED BY {plain}")
            conn.execute(f"DROP ROLE {plain}")


def stored_hashes(dsn: str) -> set[str]:
    with psycopg.connect(libpq_dsn(dsn)) as conn:
        return {row[0] for row in conn.execute("SELECT sha256 FROM outbox_blobs")}


def test_a_confined_login_reads_only_the_large_values_its_namespace_uses(
    ob: Outbox, teams: dict[str, dict[str, str]]
) -> None:
    """Large values are stored once for every namespace (by their sha256): a
    confined login read every namespace's payloads, inputs and results there."""
    billing, support = teams["billing"], teams["support"]
    secret, shared, own = ({"text": c * 40_000} for c in "xyz")

    def intents(team: dict[str, str], *payloads: dict[str, str]) -> list[uuid.UUID]:
        with Outbox.connect(team["agent"], namespace=team["namespace"]) as agent:
            run = agent.start_run("triage", "1", inputs={"n": 1})
            ids = run.transaction("s1", lambda tx: [str(tx.intend("k.x", p).id) for p in payloads])
            return [uuid.UUID(i) for i in ids]

    theirs = intents(support, secret, shared)
    mine = intents(billing, shared, own)
    owner = str(ob.settings.dsn)
    secret_sha, shared_sha, own_sha = (
        as_login(
            owner, "SELECT sha256 FROM outbox_blobs WHERE data LIKE %(t)s", {"t": f"%{c}{c}%"}
        )[0]
        for c in "xyz"
    )
    assert {secret_sha, shared_sha, own_sha} <= stored_hashes(owner)
    for role in ("agent", "deliverer", "operator", "reader"):
        seen = stored_hashes(billing[role])
        assert secret_sha not in seen, role
        assert seen == {shared_sha, own_sha}, role
        with psycopg.connect(libpq_dsn(billing[role])) as conn:
            refs = conn.execute("SELECT owner, sha256 FROM outbox_blob_refs").fetchall()
            # their run's uses are not shown: only our run's, of our two values
            assert len({owner for owner, _ in refs}) == 1, role
            assert sorted(sha for _, sha in refs) == sorted([shared_sha, own_sha]), role
            with pytest.raises(psycopg.Error, match="missing from outbox_blobs"):
                conn.execute("SELECT outbox_stored_text(%s, NULL)", (secret_sha,))
        asked = (
            "SELECT outbox_blob_in_namespace(shard, sha256, %(ns)s) FROM outbox_blobs"
            " WHERE sha256 = %(s)s"
        )
        assert as_login(billing[role], asked, {"ns": support["namespace"], "s": secret_sha}) is None
    # their own values still read back, whoever stored the shared one first
    assert stored_hashes(support["reader"]) == {secret_sha, shared_sha}
    with Outbox.connect(billing["reader"], namespace=billing["namespace"]) as reader:
        assert [reader.effect(i).payload for i in mine] == [shared, own]
    with Outbox.connect(support["reader"], namespace=support["namespace"]) as reader:
        assert [reader.effect(i).payload for i in theirs] == [secret, shared]
    assert as_login(
        str(ob.settings.dsn),
        "SELECT outbox_blob_in_namespace(shard, sha256, %(ns)s) FROM outbox_blobs"
        " WHERE sha256 = %(s)s",
        {"ns": support["namespace"], "s": secret_sha},
    ) == (True,)
    # a fork on another shard copies the values its original uses there, as ours
    big_inputs = {"text": "w" * 40_000}
    with Outbox.connect(billing["agent"], namespace=billing["namespace"]) as agent:
        original = agent.start_run("triage", "1", inputs=big_inputs)
        for step in ("s1", "s2"):
            original.transaction(step, lambda tx: None)
        other = (shard_of(original.id) + 1) % SHARDS
        fork = agent.fork(original.id, "s2", fork_id=on_shard(uuid.uuid4(), other))
    with Outbox.connect(billing["reader"], namespace=billing["namespace"]) as reader:
        assert reader.run(fork.id).inputs == big_inputs
    assert stored_hashes(support["reader"]) == {secret_sha, shared_sha}


def test_no_login_stores_a_text_under_another_values_sha256_or_unhides_one(
    ob: Outbox, teams: dict[str, dict[str, str]]
) -> None:
    """A login that wrote a text of its own under another value's sha256 first
    made that value unreadable to whoever stored it later (readers refuse a text
    that is not its sha256's); and what a confined login writes or touches of a
    value it lacks stays hidden from it."""
    billing, support = teams["billing"], teams["support"]
    canonical = '{"text": "' + "s" * 40_000 + '"}'
    sha = hashlib.sha256(canonical.encode()).hexdigest()
    with Outbox.connect(billing["agent"], namespace=billing["namespace"]) as agent:
        run = agent.start_run("triage", "1")
    store = (
        "INSERT INTO outbox_blobs (sha256, bytes, data, shard)"
        " VALUES (%(s)s, 2, %(t)s, outbox_shard_of(%(r)s)) ON CONFLICT DO NOTHING"
    )
    for dsn in (billing["agent"], str(ob.settings.dsn)):  # a confined login, the owner
        with psycopg.connect(libpq_dsn(dsn)) as conn, pytest.raises(psycopg.Error) as caught:
            conn.execute(store, {"s": sha, "t": "{}", "r": run.id})
        assert caught.value.sqlstate == "23514", caught.value
        assert f"sha256={sha} is not the sha256 of the text" in str(caught.value)
    # their value, stored; the same text stored again by us later reads back for both
    before = stored_hashes(str(ob.settings.dsn))  # (on a cluster, earlier tests' values)
    count = counted(str(ob.settings.dsn), "outbox_blobs")
    with Outbox.connect(support["agent"], namespace=support["namespace"]) as theirs_ob:
        theirs = theirs_ob.start_run("triage", "1", run_id=on_shard(uuid.uuid4(), shard_of(run.id)))
        effect = uuid.UUID(
            theirs.transaction("s1", lambda tx: str(tx.intend("k.x", {"text": "s" * 40_000}).id))
        )
    (their_sha,) = stored_hashes(str(ob.settings.dsn)) - before
    # a confined login touching it without using it does not come to see it: the
    # policies hide it from an update (nothing found) and it writes no written_in
    with psycopg.connect(libpq_dsn(billing["agent"])) as conn:
        assert (
            conn.execute(
                "INSERT INTO outbox_blobs (sha256, bytes, data, shard)"
                " SELECT sha256, bytes, data, shard FROM outbox_blobs ON CONFLICT DO NOTHING"
            ).rowcount
            == 0
        )
        assert conn.execute("SELECT count(*) FROM outbox_blobs").fetchone() == (0,)
    operator = billing["operator"]
    with psycopg.connect(libpq_dsn(operator)) as conn:
        assert conn.execute("UPDATE outbox_blobs SET used_at = now()").rowcount == 0
        assert conn.execute("SELECT count(*) FROM outbox_blobs").fetchone() == (0,)
    message = confined_error(
        operator, "UPDATE outbox_blobs SET written_in = '00000000-0000-4000-8000-000000000000'", {}
    )
    assert "permission denied" in message, message
    assert stored_hashes(billing["reader"]) == set()
    # the same text stored by us: one row still, read by both namespaces
    with Outbox.connect(billing["agent"], namespace=billing["namespace"]) as agent:
        ours = uuid.UUID(
            agent.run(run.id).transaction(
                "s1", lambda tx: str(tx.intend("k.x", {"text": "s" * 40_000}).id)
            )
        )
    assert counted(str(ob.settings.dsn), "outbox_blobs") == count + 1
    assert stored_hashes(billing["reader"]) == {their_sha} == stored_hashes(support["reader"])
    with Outbox.connect(billing["reader"], namespace=billing["namespace"]) as reader:
        assert reader.effect(ours).payload == {"text": "s" * 40_000}
    with Outbox.connect(support["reader"], namespace=support["namespace"]) as reader:
        assert reader.effect(effect).payload == {"text": "s" * 40_000}


def test_a_mark_read_off_a_shared_value_shows_a_confined_login_nothing_more(
    ob: Outbox, teams: dict[str, dict[str, str]]
) -> None:
    """A value two namespaces use shows both the mark of the transaction that stored
    it (written_in). A mark a session could set (a token in a setting, as first
    written) let a billing login take support's and read what that transaction
    wrote: support's other values and their uses."""
    billing, support = teams["billing"], teams["support"]
    shared, secret = {"text": "h" * 40_000}, {"text": "p" * 40_000}
    with Outbox.connect(support["agent"], namespace=support["namespace"]) as theirs_ob:
        theirs = theirs_ob.start_run("triage", "1")
        theirs.transaction(
            "s1", lambda tx: [tx.intend("k.x", v) and None for v in (shared, secret)]
        )
    with Outbox.connect(billing["agent"], namespace=billing["namespace"]) as agent:
        ours = agent.start_run("triage", "1", run_id=on_shard(uuid.uuid4(), shard_of(theirs.id)))
        ours.transaction("s1", lambda tx: tx.intend("k.x", shared) and None)
    with psycopg.connect(libpq_dsn(billing["reader"])) as conn:
        marks = [row[0] for row in conn.execute("SELECT written_in FROM outbox_blobs")]
        assert len(marks) == 1 and marks[0] is not None  # the shared value, as support stored it
        for setting in ("outbox.write_token", "outbox.write_mark"):
            conn.execute("SELECT set_config(%s, %s, false)", (setting, str(marks[0])))
            conn.execute("SELECT pg_current_xact_id()")  # (a transaction that has an id)
            assert conn.execute("SELECT count(*) FROM outbox_blobs").fetchone() == (1,)
            refs = conn.execute("SELECT owner FROM outbox_blob_refs").fetchall()
            assert {owner for (owner,) in refs} == {ours.id}
            conn.rollback()


def test_a_login_that_may_create_objects_cannot_stand_in_for_what_the_policies_run(
    ob: Outbox, teams: dict[str, dict[str, str]]
) -> None:
    """The functions a policy, a trigger or a check runs in a login's session looked
    names up in the session's search path: a login with CREATE on some schema put
    an `=` that always holds before pg_catalog and read every namespace's stored
    values, a has_function_privilege that always says yes and resumed an
    operator's pause, or a get_byte of its own and wrote a run on another shard
    than its id's. (Every login has CREATE on `public` before PostgreSQL 15.)"""
    billing, support = teams["billing"], teams["support"]
    with Outbox.connect(support["agent"], namespace=support["namespace"]) as theirs_ob:
        theirs_ob.start_run("triage", "1", inputs={"text": "q" * 40_000})
    with Outbox.connect(billing["agent"], namespace=billing["namespace"]) as agent:
        paused = agent.start_run("triage", "1")
    ob.pause(paused.id, "audit")
    schema = f"scratch_{uuid.uuid4().hex[:6]}"
    login = make_url(billing["agent"]).username
    with psycopg.connect(libpq_dsn(str(ob.settings.dsn)), autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(f"GRANT USAGE, CREATE ON SCHEMA {schema} TO {login}")
    try:
        with psycopg.connect(libpq_dsn(billing["agent"])) as conn:
            conn.execute(
                f"CREATE FUNCTION {schema}.yes(uuid, uuid) RETURNS boolean"
                " LANGUAGE sql AS 'SELECT true'"
            )
            conn.execute(
                f"CREATE OPERATOR {schema}.= (LEFTARG = uuid, RIGHTARG = uuid,"
                f" FUNCTION = {schema}.yes)"
            )
            conn.execute(
                f"CREATE FUNCTION {schema}.has_function_privilege(text, text) RETURNS boolean"
                " LANGUAGE sql AS 'SELECT true'"
            )
            conn.execute(
                f"CREATE FUNCTION {schema}.get_byte(bytea, integer) RETURNS integer"
                " LANGUAGE sql AS 'SELECT 7'"
            )
            conn.commit()
            conn.execute(f"SET search_path = {schema}, pg_catalog, public")
            # a run's row on a shard that is not its id's (the table's check reads it)
            wrong = on_shard(uuid.uuid4(), 5)
            with pytest.raises(psycopg.Error, match="outbox_runs_shard_check"):
                conn.execute(
                    "INSERT INTO public.outbox_runs (id, shard, namespace, agent, agent_version,"
                    " inputs, inputs_hash, status) VALUES (%s, 7, %s, 'a', '1', 'null', 'h',"
                    " 'runnable')",
                    (wrong, billing["namespace"]),
                )
            conn.rollback()
            conn.execute(f"SET search_path = {schema}, pg_catalog, public")
            conn.execute("SELECT pg_current_xact_id()")
            assert conn.execute("SELECT count(*) FROM outbox_blobs").fetchone() == (0,)
            with pytest.raises(psycopg.Error, match="paused by an operator"):
                conn.execute(
                    # (its own `=` named: the login's would stand in for this one too)
                    "UPDATE public.outbox_runs SET status = 'runnable'"
                    " WHERE id OPERATOR(pg_catalog.=) %s",
                    (paused.id,),
                )
    finally:
        with psycopg.connect(libpq_dsn(str(ob.settings.dsn)), autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")
    assert ob.run(paused.id).status == RunStatus.PAUSED


def test_no_login_may_attach_the_stored_value_trigger_elsewhere(
    teams: dict[str, dict[str, str]],
) -> None:
    """The trigger that checks and holds a stored value runs as the tables' owner: a
    login that could attach it to a table of its own would hold values through it."""
    for team in teams.values():
        for role in ("agent", "deliverer", "operator", "reader"):
            held = as_login(
                team[role],
                "SELECT has_function_privilege('outbox_blobs_written()', 'EXECUTE')",
                {},
            )
            assert held == (False,), (team["namespace"], role)


def test_a_confined_deliverer_forgets_no_gone_deliverer_that_holds_another_namespaces_effect(
    dsn: str, teams: dict[str, dict[str, str]]
) -> None:
    """The owners' registry is shared; a login confined to billing sees only billing's
    effects. Forgetting a gone support deliverer that still holds an attempt would end
    support's early recovery of it: its attempt would wait out the lease instead."""
    billing, support = teams["billing"], teams["support"]
    with Outbox.connect(support["agent"], namespace=support["namespace"]) as agent:
        run = agent.start_run("support-agent", "1")
        run.transaction("s", lambda tx: tx.intend("k.held", {"n": 1}) and None)
    gone = f"support-gone-{uuid.uuid4().hex[:6]}"
    with psycopg.connect(libpq_dsn(dsn), autocommit=True) as conn:
        conn.execute(
            "UPDATE outbox_effects SET status = 'in_flight', attempt = 1, lease_owner = %s,"
            " lease_expires_at = now() + interval '1 hour', attempt_started_at = now()"
            " WHERE run_id = %s",
            [gone, run.id],
        )
        conn.execute(
            "INSERT INTO outbox_owners (owner, registered_at)"
            " VALUES (%s, now() - interval '5 minutes')",
            [gone],
        )

    def forget(login: str) -> int:
        async def main() -> int:
            store = AsyncStore(make_async_engine(login))
            try:
                return await store.forget_gone_owners([gone], restart_grace=0)
            finally:
                await store.dispose()

        return asyncio.run(main())

    def registered() -> bool:
        with psycopg.connect(libpq_dsn(dsn)) as conn:
            found = conn.execute("SELECT 1 FROM outbox_owners WHERE owner = %s", [gone])
            return found.fetchone() is not None

    assert forget(billing["deliverer"]) == 0 and registered(), "forgotten while it holds"
    assert forget(support["deliverer"]) == 0 and registered()
    with psycopg.connect(libpq_dsn(dsn), autocommit=True) as conn:
        conn.execute(
            "UPDATE outbox_effects SET status = 'pending', lease_owner = NULL,"
            " lease_expires_at = NULL WHERE run_id = %s",
            [run.id],
        )
    assert forget(billing["deliverer"]) == 1 and not registered(), "holding nothing, it goes"
    # who holds what in other namespaces is read as the tables' owner: for the
    # roles that unregister gone deliverers alone
    for role in ("agent", "reader"):
        with (
            psycopg.connect(libpq_dsn(billing[role])) as conn,
            pytest.raises(psycopg.errors.InsufficientPrivilege),
        ):
            conn.execute("SELECT outbox_owners_holding(ARRAY['x'])")
