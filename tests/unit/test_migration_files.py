"""Rules for the shipped migration files, checked without a database."""

from __future__ import annotations

import re

import pytest

from outbox.storage.functions import definitions
from outbox.storage.migrate import NO_TRANSACTION, Migration, one_by_one, shipped

# Migrations from this one on run against tables that may be big in production.
FIRST_ON_LIVE_TABLES = 4
_INDEX = re.compile(
    r"CREATE\s+(?:UNIQUE\s+)?INDEX\s+(CONCURRENTLY\s+)?(?:IF\s+NOT\s+EXISTS\s+)?\w+\s+ON\s+(\w+)",
    re.IGNORECASE,
)


def _tables_created_before(version: int) -> set[str]:
    tables: set[str] = set()
    for migration in shipped():
        if migration.version < version:
            tables |= set(re.findall(r"CREATE TABLE (\w+)", migration.sql, re.IGNORECASE))
    return tables


def test_index_builds_on_existing_tables_are_concurrent_and_outside_a_transaction() -> None:
    for migration in shipped():
        if migration.version < FIRST_ON_LIVE_TABLES:
            continue
        existing = _tables_created_before(migration.version)
        for concurrently, table in _INDEX.findall(migration.sql):
            if table not in existing:
                continue  # a table this very migration creates is empty
            assert concurrently, f"{migration.label}: index on {table} must be CONCURRENTLY"
            assert not migration.transactional, f"{migration.label}: needs {NO_TRANSACTION}"


def test_no_transaction_files_split_into_their_statements() -> None:
    for migration in shipped():
        if migration.transactional:
            continue
        assert "$$" not in migration.sql, f"{migration.label}: no dollar quotes here"
        statements = migration.statements()
        assert statements and all(s.rstrip().endswith(";") for s in statements)
        assert all(";" not in s.rstrip()[:-1] for s in statements), migration.label


def test_the_marker_and_the_splitting() -> None:
    sql = (
        f"{NO_TRANSACTION}\n-- why\nCREATE INDEX CONCURRENTLY a ON t (x)\n"
        "    WHERE x > 1;\n\nDROP INDEX b;\n"
    )
    migration = Migration(9, "x", sql)
    assert not migration.transactional
    assert migration.statements() == [
        "CREATE INDEX CONCURRENTLY a ON t (x)\n    WHERE x > 1;",
        "DROP INDEX b;",
    ]
    assert Migration(9, "x", "CREATE INDEX a ON t (x);").transactional
    assert shipped()[3].label == "0004_retention" and not shipped()[3].transactional


def test_each_function_and_trigger_has_one_current_truth_file() -> None:
    """A function body exists once outside the frozen migrations (outbox/storage/functions)."""
    seen: dict[tuple[str, str], str] = {}
    for definition in definitions():
        key = (definition.kind, definition.name)
        assert key not in seen, f"{key} is defined in {seen[key]} and in {definition.file}"
        seen[key] = definition.file
    assert ("function", "outbox_commit_step") in seen
    assert ("trigger", "outbox_attempts_chain") in seen


@pytest.mark.parametrize(
    ("script", "statements"),
    [
        ("SELECT E'a\\';b'; SELECT 2;", ["SELECT E'a\\';b';", " SELECT 2;"]),
        ("SELECT 'it''s;'; SELECT 2", ["SELECT 'it''s;';", " SELECT 2"]),
        ('SELECT "we;ird" FROM t;', ['SELECT "we;ird" FROM t;']),
        ("SELECT a$b$c FROM t; SELECT 2;", ["SELECT a$b$c FROM t;", " SELECT 2;"]),
        (
            "CREATE FUNCTION f() RETURNS int AS $x$ SELECT 1; $y$; $x$ LANGUAGE sql;\n-- c;\n",
            ["CREATE FUNCTION f() RETURNS int AS $x$ SELECT 1; $y$; $x$ LANGUAGE sql;"],
        ),
        ("SELECT 1; /* ; */ SELECT 2;", ["SELECT 1;", " /* ; */ SELECT 2;"]),
    ],
)
def test_a_script_splits_at_the_semicolons_outside_quotes_and_comments(
    script: str, statements: list[str]
) -> None:
    assert one_by_one(script) == statements
