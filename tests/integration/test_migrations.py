"""Migrations: migrated equals fresh; idempotent; safe concurrently; newer refused."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from sqlalchemy import Engine, text

from outbox import Outbox, SchemaOutdated, SchemaTooNew, Settings
from outbox.storage.engine import make_engine
from outbox.storage.migrate import applied_versions, migrate, shipped
from outbox.storage.schema import metadata

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
    "sequences": """
        SELECT sequencename, data_type::text, start_value, min_value, max_value, increment_by,
               cycle, cache_size
        FROM pg_sequences WHERE schemaname = 'public' ORDER BY 1""",
}


def _catalog(engine: Engine) -> dict[str, list[Any]]:
    with engine.connect() as conn:
        return {name: [tuple(r) for r in conn.execute(text(q))] for name, q in CATALOG.items()}


def test_migrated_database_equals_one_created_from_the_models(empty_dsn: str, dsn: str) -> None:
    fresh = make_engine(empty_dsn)
    migrated = make_engine(dsn)
    try:
        metadata.create_all(
            fresh, tables=[t for t in metadata.sorted_tables if t.name != "outbox_migrations"]
        )
        a, b = _catalog(fresh), _catalog(migrated)
        for part in CATALOG:
            assert a[part] == b[part], part
    finally:
        fresh.dispose()
        migrated.dispose()


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
