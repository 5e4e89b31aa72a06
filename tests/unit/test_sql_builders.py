"""Every statement builder compiles, and the rules every statement keeps hold (no database).

Builders are pure functions; this file calls each one that ``outbox.storage.sql``
exports (every variant of the parametrised ones) and checks what holds for all:
status literals are statuses the schema allows, no bound parameter shadows a
column of the table an UPDATE writes (SQLAlchemy would add it to the SET), and
the claim/lease/fence statements keep their compare-and-set.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Table
from sqlalchemy.dialects import postgresql
from sqlalchemy.sql.dml import Update

from outbox.models import AttemptOutcome, EffectStatus, RunStatus, StepStatus
from outbox.storage.sql import (
    blobs,
    control,
    dispatch,
    effects,
    governance,
    leases,
    maintenance,
    notes,
    operator_changes,
    queue,
    runs,
    steps,
)

MODULES = [
    steps,
    queue,
    leases,
    effects,
    operator_changes,
    notes,
    dispatch,
    runs,
    maintenance,
    control,
    blobs,
    governance,
]
# Literals a statement may compare a status (or an attempt-log outcome) with.
KNOWN = {str(v) for enum in (RunStatus, EffectStatus, StepStatus, AttemptOutcome) for v in enum}
VARIANTS: dict[str, list[dict[str, Any]]] = {
    "commit_step": [
        {"fenced": f, "notify": n, "ledger": led}
        for f in (False, True)
        for n in (False, True)
        for led in (False, True)
    ],
    "intend_without_run": [{"notify": False}, {"notify": True}],
    "insert_run": [{"notify": False}, {"notify": True}],
    "claim": [
        {"spec": spec, "rated": rated, "lanes": lanes}
        for spec in (queue.EFFECT_QUEUE, queue.RUN_QUEUE)
        for rated in (False, True)
        for lanes in (False, True)
        if spec is queue.EFFECT_QUEUE or not rated
    ],
    "ready_on_shard": [{"spec": dataclasses.replace(queue.EFFECT_QUEUE, sharded=True)}],
    "extend_leases": [
        {"spec": queue.EFFECT_QUEUE},
        {"spec": queue.RUN_QUEUE},
        {"spec": dataclasses.replace(queue.EFFECT_QUEUE, sharded=True)},
    ],
    "retry_failed": [{"sharded": False}, {"sharded": True}],
    "effect_shard": [{"named": False}, {"named": True}],
    "note_attempt": [{"named": False}, {"named": True}],
    "resolve_unknown": [{"reopen": r, "sharded": s} for r in (False, True) for s in (False, True)],
    "pause_run": [{"park": p, "first": f} for p in (False, True) for f in (False, True)],
    "resume_run": [{"parked": False}, {"parked": True}],
    "wake_due_timers": [{"sharded": False}, {"sharded": True}],
    "list_runs": [{}, {"status": "running", "agent": "a", "limit": 5}],
    "list_effects": [{}, {"status": "pending", "kind": "k", "limit": 5}],
    "delete_refs_of": [{"rows": r, "sharded": s} for r in (False, True) for s in (False, True)],
    "delete_orphan_refs": [{"rows": r, "sharded": s} for r in (False, True) for s in (False, True)],
    "delete_unused_blobs": [
        {"rows": r, "sharded": s} for r in (False, True) for s in (False, True)
    ],
    "delete_gates": [{"keep": False}, {"keep": True}],
}
NOT_BUILDERS = {
    "claim_params",
    "partition_params",
    "extend_params",
    "StateCounts",
    "held_rows",
    "QueueSpec",
    "Rate",
    # parts of statements, not statements
    "log_changes",
    "next_step_head",
    "on_shard",
}


def builders() -> Iterator[tuple[str, Any, dict[str, Any]]]:
    for module in MODULES:
        for name in module.__all__:
            fn = getattr(module, name)
            if name in NOT_BUILDERS or not callable(fn) or name.isupper():
                continue
            for kwargs in VARIANTS.get(name, [{}]):
                yield f"{module.__name__.rsplit('.', 1)[-1]}.{name}", fn, kwargs


CASES = list(builders())


def compile_(statement: Any) -> Any:
    if isinstance(statement, tuple):
        return [compile_(s) for s in statement]
    return statement.compile(dialect=postgresql.dialect())


def _case_id(case: tuple[str, Any, dict[str, Any] | None]) -> str:
    """A stable id (the same in every process: pytest-xdist compares them)."""

    def short(value: Any) -> str:
        table = getattr(value, "table", None)
        if table is None:
            return repr(value)
        return f"{table.name}{'@sharded' if getattr(value, 'sharded', False) else ''}"

    name, _, kwargs = case
    return name + "".join(f"[{k}={short(v)}]" for k, v in (kwargs or {}).items())


@pytest.mark.parametrize(("name", "fn", "kwargs"), CASES, ids=[_case_id(c) for c in CASES])
def test_builder_compiles_with_known_status_literals(
    name: str, fn: Any, kwargs: dict[str, Any]
) -> None:
    statement = fn(**kwargs)
    for compiled in compile_(statement) if isinstance(statement, tuple) else [compile_(statement)]:
        sql = str(compiled)
        assert sql.strip(), name
        for literal in re.findall(r"status (?:=|<>|!=) '([a-z_]+)'", sql):
            assert literal in KNOWN, f"{name}: unknown status literal {literal!r}"
        for group in re.findall(r"status IN \(([^)]*)\)", sql):
            for literal in re.findall(r"'([a-z_]+)'", group):
                assert literal in KNOWN, f"{name}: unknown status literal {literal!r}"


def _updates(statement: Any) -> Iterator[Update]:
    """Every UPDATE in a statement, its CTEs included."""
    seen: set[int] = set()
    stack = [statement]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, Update):
            yield node
        stack.extend(node.get_children()) if hasattr(node, "get_children") else None
        element = getattr(node, "element", None)
        if element is not None:
            stack.append(element)


@pytest.mark.parametrize(("name", "fn", "kwargs"), CASES, ids=[_case_id(c) for c in CASES])
def test_no_parameter_shadows_a_column_an_update_writes(
    name: str, fn: Any, kwargs: dict[str, Any]
) -> None:
    statement = fn(**kwargs)
    if isinstance(statement, tuple):
        return
    params = set(compile_(statement).params)
    for update in _updates(statement):
        table = update.table
        assert isinstance(table, Table)
        shadowed = params & set(table.c.keys())
        assert not shadowed, f"{name}: parameters {shadowed} are also columns of {table.name}"


def _sql(statement: Any) -> str:
    return str(compile_(statement))


def test_claims_skip_locked_rows_and_start_a_new_attempt() -> None:
    for spec, lanes in [
        (s, lanes) for s in (queue.EFFECT_QUEUE, queue.RUN_QUEUE) for lanes in (0, 1)
    ]:
        sql = _sql(queue.claim(spec, lanes=bool(lanes)))
        assert "FOR UPDATE SKIP LOCKED" in sql
        assert f"attempt=({spec.table.name}.attempt + %(attempt_1)s::INTEGER)" in sql


def test_every_write_about_an_attempt_is_a_compare_and_set() -> None:
    extend = _sql(leases.extend_leases(queue.EFFECT_QUEUE))
    assert "outbox_effects.attempt = h.attempt" in extend
    assert "outbox_effects.lease_owner = %(owner)s" in extend
    complete = _sql(effects.complete_effects())
    assert "outbox_effects.attempt = d.attempt" in complete
    expire = _sql(effects.expire_effect())
    assert "outbox_effects.attempt = %(expected_attempt)s" in expire
    assert "outbox_effects.lease_expires_at < now()" in expire


def test_every_exported_builder_is_exercised() -> None:
    covered = {name.split(".", 1)[1] for name, _, _ in CASES}
    for module in MODULES:
        for name in module.__all__:
            fn = getattr(module, name)
            if callable(fn) and not name.isupper() and name not in NOT_BUILDERS:
                assert name in covered, f"{module.__name__}.{name}"
            if inspect.isfunction(fn):
                assert fn.__doc__, f"{module.__name__}.{name} has no docstring"


def test_stream_mode_locks_effects_in_id_order() -> None:
    # A relay's mark and stream deliverers' claims of the same effects took row
    # locks in different orders and deadlocked (found by `python -m bench --only
    # stream`); the relay no longer marks, and claims lock in id order first.
    sql = _sql(dispatch.claim_dispatched())
    assert "ORDER BY outbox_effects.id" in sql and "FOR UPDATE" in sql, sql
