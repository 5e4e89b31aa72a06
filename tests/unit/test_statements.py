"""The statement builders compile to the SQL we mean (no database needed)."""

from __future__ import annotations

from sqlalchemy.dialects import postgresql

from outbox.storage.sql import steps as statements


def _sql(stmt: object) -> str:
    return str(stmt.compile(dialect=postgresql.dialect()))  # type: ignore[attr-defined]


def test_commit_step_is_one_statement_with_chained_parts() -> None:
    sql = _sql(statements.commit_step(fenced=False, notify=False))
    assert sql.startswith("WITH run_upd AS")
    # each part only happens when the one before it did
    assert "FROM run_upd RETURNING outbox_steps.seq" in sql
    assert "JOIN step_ins ON true" in sql
    # plain inserts: a conflict is a unique violation (no speculative insertion's WAL)
    assert "ON CONFLICT" not in sql
    assert "pg_notify" not in sql
    assert "lease_owner" not in sql


def test_commit_step_variants() -> None:
    fenced = _sql(statements.commit_step(fenced=True, notify=True))
    assert "outbox_runs.lease_owner = %(fence_owner)s" in fenced
    assert "outbox_runs.attempt = %(fence_attempt)s" in fenced
    assert "pg_notify" in fenced


def test_commit_step_refuses_steps_of_ended_runs_and_over_budget() -> None:
    sql = _sql(statements.commit_step(fenced=False, notify=False))
    assert "outbox_runs.status IN ('runnable', 'running', 'waiting')" in sql
    assert "outbox_runs.budget IS NULL OR" in sql


def test_no_parameter_shadows_a_runs_column() -> None:
    # SQLAlchemy adds execute() parameters named like a column to an UPDATE's SET.
    from outbox.storage.schema import runs

    compiled = statements.commit_step(fenced=True, notify=True).compile(
        dialect=postgresql.dialect()
    )
    assert not set(compiled.params) & set(runs.c.keys())
