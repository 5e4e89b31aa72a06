"""What ``outbox check`` asks of storage: scratch databases, the audit, a dead owner's leases."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from outbox import Outbox, RunStatus
from outbox.check.check import scratch_server
from outbox.errors import DatabaseError
from outbox.storage.admin.scratch import ScratchDatabases
from outbox.storage.dsn import redacted_dsn
from outbox.storage.sql.queue import EFFECT_QUEUE, claim, claim_params


def databases(admin_dsn: str) -> list[str]:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        return [r[0] for r in conn.execute("SELECT datname FROM pg_database")]


def test_scratch_databases_are_migrated_clones_dropped_at_the_end(admin_dsn: str) -> None:
    scratch = ScratchDatabases(admin_dsn, prefix="kit_test")
    try:
        first, second = scratch.clone(), scratch.clone()
        assert first != second
        with Outbox.connect(first) as ob:  # migrated: usable at once
            assert ob.start_run("a", "1").status == RunStatus.RUNNABLE
        made = [d for d in databases(admin_dsn) if d.startswith("kit_test")]
        assert len(made) == 3  # the template and two clones
        scratch.drop(second)
        with pytest.raises(ValueError, match="not made here"):
            scratch.drop(admin_dsn)
    finally:
        scratch.drop_all()
    assert [d for d in databases(admin_dsn) if d.startswith("kit_test")] == []


def test_the_default_scratch_server_is_an_embedded_one_started_and_removed() -> None:
    # As a user runs it from a fresh clone: no DSN. Run as root (CI, containers),
    # the server's OS user must be able to enter the directory the check made.
    with scratch_server() as dsn:
        socket_dir = Path(str(psycopg.conninfo.conninfo_to_dict(dsn)["host"]))
        home = next(p for p in socket_dir.parents if p.name.startswith("outbox-check-"))
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
        scratch = ScratchDatabases(dsn, prefix="kit_default")
        with Outbox.connect(scratch.clone()) as ob:
            assert ob.start_run("a", "1").status == RunStatus.RUNNABLE
        scratch.drop_all()
    assert not home.exists()


def test_a_server_that_refuses_is_one_clear_error() -> None:
    scratch = ScratchDatabases("postgresql://nobody@/nowhere?host=/nonexistent")
    with pytest.raises(DatabaseError, match="connecting to make scratch databases"):
        scratch.clone()


def test_a_printed_dsn_hides_its_password() -> None:
    assert redacted_dsn("postgresql://me:secret@db:5432/app") == "postgresql://me:***@db:5432/app"


def test_the_audit_reads_everything_and_a_dead_owners_leases_end_now(ob: Outbox) -> None:
    run = ob.start_run("a", "1")
    run.transaction("s", lambda tx: tx.intend("http.request", {"url": "http://x/"}) and None)
    audit = ob.store.audit()
    assert [e["kind"] for e in audit["effects"]] == ["http.request"]
    assert [(s["step_id"], s["status"]) for s in audit["steps"]] == [("s", "completed")]
    assert audit["attempts"] == []
    assert ob.store.effect_kinds() == ["http.request"]
    assert ob.store.effect_counts() == {"pending": 1}

    (claimed,) = ob.store.claim_runs(
        [({"agent": "a", "agent_version": "1"}, 1)], owner="host:4242:abc", lease_seconds=300
    )
    with ob.engine.begin() as conn:
        params = claim_params({"kind": "http.request"}, limit=1, owner="host:4242:abc",
                              lease_seconds=300)  # fmt: skip
        assert len(conn.execute(claim(EFFECT_QUEUE), params).all()) == 1
    assert ob.store.rescue_expired_runs() == 0, "a live lease of 300 s"
    assert ob.store.expire_leases_of("%:9999:%") == 0, "another process's leases are left alone"
    assert ob.store.expire_leases_of("%:4242:%") == 2  # the run and the effect
    assert ob.store.rescue_expired_runs() == 1
    assert ob.run(claimed.id).status == RunStatus.RUNNABLE
    (effect,) = ob.effects()
    assert effect.status.value == "in_flight"  # the reconciler takes it from here
