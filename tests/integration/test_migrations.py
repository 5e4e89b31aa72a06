"""Migrations: migrated equals fresh; idempotent; safe concurrently; newer refused."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url

from outbox import Outbox, SchemaOutdated, SchemaTooNew, Settings
from outbox.errors import ConfigurationError, MigrationError
from outbox.keys import derive_key
from outbox.shards import key_shard
from outbox.storage.dsn import libpq_dsn
from outbox.storage.engine import make_engine
from outbox.storage.migrate import applied_versions, check_schema, migrate, one_by_one, shipped
from outbox.storage.schema import metadata
from tests.support import wait_for

CATALOG = {
    "columns": """
        SELECT table_name, column_name, data_type, is_nullable, column_default, is_identity
        FROM information_schema.columns WHERE table_schema = 'public'
          AND table_name <> 'outbox_migrations' ORDER BY 1, 2""",
    "indexes": """
        SELECT tablename, indexname, indexdef FROM pg_indexes
        WHERE schemaname = 'public' AND tablename <> 'outbox_migrations' ORDER BY 1, 2""",
    "constraints": """
        SELECT conrelid::regclass::text, contype, pg_get_constraintdef(oid)
        FROM pg_constraint WHERE connamespace = 'public'::regnamespace
          AND conrelid::regclass::text <> 'outbox_migrations' ORDER BY 1, 2, 3""",
    "triggers": """
        SELECT tgrelid::regclass::text, tgname, pg_get_triggerdef(oid)
        FROM pg_trigger WHERE NOT tgisinternal ORDER BY 1, 2""",
    "storage": """
        SELECT relname, reloptions FROM pg_class
        WHERE relnamespace = 'public'::regnamespace AND relkind = 'r'
          AND relname <> 'outbox_migrations' ORDER BY 1""",
    "functions": """
        SELECT proname, pg_get_functiondef(oid) FROM pg_proc
        WHERE pronamespace = 'public'::regnamespace ORDER BY 1""",
    "types": """
        SELECT t.typname, a.attnum, a.attname, format_type(a.atttypid, a.atttypmod)
        FROM pg_type t JOIN pg_class c ON c.oid = t.typrelid AND c.relkind = 'c'
        JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0
        WHERE t.typnamespace = 'public'::regnamespace ORDER BY 1, 2""",
    "sequences": """
        SELECT sequencename, data_type::text, start_value, min_value, max_value, increment_by,
               cycle, cache_size
        FROM pg_sequences WHERE schemaname = 'public' ORDER BY 1""",
}


def _catalog(engine: Engine) -> dict[str, list[Any]]:
    with engine.connect() as conn:
        return {name: [tuple(r) for r in conn.execute(text(q))] for name, q in CATALOG.items()}


def _assert_same_catalog(one: Engine, other: Engine) -> None:
    """Every part of the two databases' catalogs is equal (both engines disposed)."""
    try:
        a, b = _catalog(one), _catalog(other)
        for part in CATALOG:
            assert a[part] == b[part], part
    finally:
        one.dispose()
        other.dispose()


def test_migrated_database_equals_one_created_from_the_models(empty_dsn: str, dsn: str) -> None:
    fresh = make_engine(empty_dsn)
    metadata.create_all(
        fresh, tables=[t for t in metadata.sorted_tables if t.name != "outbox_migrations"]
    )
    _assert_same_catalog(fresh, make_engine(dsn))


def test_every_migration_sent_a_statement_at_a_time_builds_the_same_database(
    empty_dsn: str, dsn: str
) -> None:
    # as on a distributed database (Citus): one_by_one must split every file right
    with psycopg.connect(libpq_dsn(empty_dsn), autocommit=True) as conn:
        for migration in shipped():
            if migration.transactional:
                with conn.transaction():
                    for statement in one_by_one(migration.sql):
                        conn.execute(statement.encode())
            else:
                for statement in migration.statements():
                    conn.execute(statement.encode())
    _assert_same_catalog(make_engine(empty_dsn), make_engine(dsn))


def test_migrate_is_idempotent(empty_dsn: str) -> None:
    engine = make_engine(empty_dsn)
    try:
        assert [m.version for m in migrate(engine)] == [m.version for m in shipped()]
        assert migrate(engine) == []
        with engine.connect() as conn:
            assert applied_versions(conn) == [m.version for m in shipped()]
    finally:
        engine.dispose()


def test_two_processes_migrating_at_once_apply_each_migration_once(empty_dsn: str) -> None:
    results: list[list[int]] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def worker() -> None:
        engine = make_engine(empty_dsn)
        try:
            barrier.wait()
            results.append([m.version for m in migrate(engine)])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            engine.dispose()

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    applied = sorted(v for r in results for v in r)
    assert applied == [m.version for m in shipped()]


def test_a_database_newer_than_the_code_is_refused(dsn: str) -> None:
    engine = make_engine(dsn)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO outbox_migrations (version, name, checksum) "
                    "VALUES (9999, 'from_the_future', 'x')"
                )
            )
        with pytest.raises(SchemaTooNew, match="9999"):
            migrate(engine)
        with pytest.raises(SchemaTooNew):
            Outbox.connect(dsn)
    finally:
        engine.dispose()


def test_an_unmigrated_external_database_is_refused_until_migrated(empty_dsn: str) -> None:
    with pytest.raises(SchemaOutdated, match="outbox migrate"):
        Outbox.connect(empty_dsn)
    Outbox.connect(settings=Settings(dsn=empty_dsn, auto_migrate=True)).close()
    Outbox.connect(empty_dsn).close()


# -- checksums, failures, non-transactional migrations (L7) --------------------------------


def _outbox(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OUTBOX_DSN": dsn}
    return subprocess.run(
        [sys.executable, "-m", "outbox", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _set_checksum(engine: Engine, version: int, checksum: str) -> None:
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE outbox_migrations SET checksum = :c WHERE version = :v"),
            {"c": checksum, "v": version},
        )


def _checksum(engine: Engine, version: int) -> str:
    with engine.connect() as conn:
        return str(
            conn.execute(
                text("SELECT checksum FROM outbox_migrations WHERE version = :v"), {"v": version}
            ).scalar_one()
        )


def test_an_applied_migration_that_changed_is_refused_by_name(dsn: str) -> None:
    engine = make_engine(dsn)
    try:
        _set_checksum(engine, 2, "0" * 64)
        with pytest.raises(MigrationError, match=r"0002_durable_runs.*--accept-changed 2"):
            migrate(engine)
        refused = _outbox(dsn, "migrate")
        assert refused.returncode == 1
        assert refused.stderr.count("\n") == 1 and "Traceback" not in refused.stderr
        assert "MigrationError" in refused.stderr and "0002_durable_runs" in refused.stderr

        # The documented escape hatch: accept it, and the shipped checksum is recorded.
        accepted = _outbox(dsn, "migrate", "--accept-changed", "2", "--json")
        assert accepted.returncode == 0, accepted.stderr
        assert _checksum(engine, 2) == shipped()[1].checksum
        assert migrate(engine) == []
    finally:
        engine.dispose()


def test_a_database_migrated_with_the_old_text_of_0004_is_not_refused(dsn: str) -> None:
    engine = make_engine(dsn)
    try:
        old = "22946482ba44acb4f8cbfa0e2b578caab1322a8f3add37bc2a29a0e6f067eff0"
        _set_checksum(engine, 4, old)
        assert migrate(engine) == []
        assert _checksum(engine, 4) == next(m for m in shipped() if m.version == 4).checksum
    finally:
        engine.dispose()


def test_a_failing_migration_is_one_line_naming_it(empty_dsn: str) -> None:
    engine = make_engine(empty_dsn)
    try:
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE outbox_runs (id integer)"))
    finally:
        engine.dispose()
    done = _outbox(empty_dsn, "migrate")
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert "migration 0001_initial failed" in done.stderr
    assert 'relation "outbox_runs" already exists' in done.stderr
    assert "nothing of it was applied" in done.stderr


@pytest.fixture
def encoded(admin_dsn: str) -> Iterator[Callable[[str], str]]:
    """Databases created in a given encoding (C locale); dropped after the test."""
    names: list[str] = []

    def make(encoding: str) -> str:
        names.append(f"enc_{encoding.lower()}_{os.getpid()}")
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(
                f"CREATE DATABASE {names[-1]} ENCODING '{encoding}' LC_COLLATE 'C'"
                " LC_CTYPE 'C' TEMPLATE template0"
            )
        return str(make_url(admin_dsn).set(database=names[-1]).render_as_string(False))

    yield make
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        for name in names:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def test_a_database_not_in_utf8_is_refused_before_anything_is_written(
    encoded: Callable[[str], str],
) -> None:
    # The hash chains and keys hash the database's own bytes of a text as its UTF-8
    # (outbox_utf8): in another encoding they would not match Python's.
    latin = encoded("LATIN1")
    done = _outbox(latin, "migrate")
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert "the database's encoding is LATIN1: agent-outbox needs a UTF8 database" in done.stderr
    with psycopg.connect(latin) as conn:
        assert conn.execute("SELECT to_regclass('outbox_migrations')").fetchone() == (None,)
    # nor does a migrated database restored into one start (here: its schema is there)
    engine = make_engine(latin)
    try:
        with engine.connect() as conn, pytest.raises(ConfigurationError, match="LATIN1"):
            check_schema(conn)
    finally:
        engine.dispose()


def test_a_sql_ascii_database_holds_the_bytes_its_clients_hash(
    encoded: Callable[[str], str],
) -> None:
    # SQL_ASCII keeps the UTF-8 bytes a client sends: keys and shards match Python's.
    # Its DSN needs no client_encoding: psycopg read its text as bytes, and migrate
    # ended in a TypeError, until the engine asked for UTF8 itself.
    engine = make_engine(encoded("SQL_ASCII"))
    try:
        migrate(engine)
        run = uuid.uuid4()
        with engine.connect() as conn:
            got = conn.execute(
                text("SELECT outbox_key_shard('ns', :k), outbox_derive_key(:r, :k, 1)"),
                {"k": "café-漢字-🙂", "r": run},
            ).one()
        assert tuple(got) == (key_shard("ns", "café-漢字-🙂"), derive_key(run, "café-漢字-🙂", 1))
    finally:
        engine.dispose()


def test_migrate_on_an_unreachable_server_is_one_line() -> None:
    done = _outbox("postgresql://outbox@127.0.0.1:1/outbox?connect_timeout=2", "migrate")
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert "DatabaseError" in done.stderr


def test_0004_builds_its_indexes_without_blocking_intent_writes(empty_dsn: str) -> None:
    """An upgrade over a table with a long writer in flight lets other writers through.

    A plain CREATE INDEX queues for a SHARE lock behind the open writer, and every
    later insert queues behind it: intents stop until the writer ends and the
    index is built. CREATE INDEX CONCURRENTLY waits for the writer too, but
    takes no lock that inserts queue behind.
    """
    engine = make_engine(empty_dsn)
    insert = text(
        "INSERT INTO outbox_effects (id, kind, payload, payload_hash, idempotency_key, status)"
        " VALUES (gen_random_uuid(), 'k', '{}', 'h', :key, 'pending')"
    )
    try:
        migrate(engine, target=3)
        writer = engine.connect()
        writer.execute(insert, {"key": "in-flight"})  # its transaction stays open
        errors: list[BaseException] = []

        def upgrade() -> None:
            try:
                migrate(engine)
            except BaseException as exc:  # reported below
                errors.append(exc)

        thread = threading.Thread(target=upgrade)
        thread.start()
        try:
            wait_for(
                lambda: _waiting_index_build(engine),
                timeout=30,
                message="the index build to wait for the open writer",
            )
            with engine.begin() as conn:
                conn.execute(text("SET LOCAL lock_timeout = '3s'"))
                conn.execute(insert, {"key": "during-upgrade"})
        finally:
            writer.commit()
            writer.close()
            thread.join(60)
        assert not errors, errors
        with engine.connect() as conn:
            assert applied_versions(conn) == [m.version for m in shipped()]
            valid = conn.execute(
                text(
                    "SELECT bool_and(indisvalid) FROM pg_index JOIN pg_class c"
                    " ON c.oid = indexrelid WHERE c.relname LIKE 'outbox_%_finished'"
                )
            ).scalar_one()
        assert valid is True
    finally:
        engine.dispose()


def _waiting_index_build(engine: Engine) -> bool:
    with engine.connect() as conn:
        return bool(
            conn.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND query LIKE '%CREATE INDEX%' AND wait_event_type = 'Lock'"
                )
            ).scalar_one()
        )
