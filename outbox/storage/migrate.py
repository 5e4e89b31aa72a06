"""Versioned migrations: numbered ``.sql`` files shipped in the package, applied under a lock.

Each file runs in its own transaction together with its row in
``outbox_migrations`` (version, name, sha256 of the file). A file whose first
lines include ``-- outbox:no-transaction`` runs outside a transaction instead,
one statement at a time (for ``CREATE INDEX CONCURRENTLY`` and ``VALIDATE
CONSTRAINT``, which keep writes going while they read a big table); its row is
written after its last statement, and it must be safe to run again after a
failure part-way (``DROP INDEX CONCURRENTLY IF EXISTS`` first). Its statements
end with ``;`` at the end of a line, and it holds no dollar-quoted bodies.

Processes migrating at once take turns on a session advisory lock, taken by
polling (a session blocked on the lock inside a statement would hold a
snapshot that ``CREATE INDEX CONCURRENTLY`` waits for); the second finds
nothing left to do.

Before anything is applied, the checksum recorded for every applied migration
is compared with the shipped file: a difference means this code does not know
what the database ran, and ``migrate`` refuses, naming the migration, unless
the operator accepts it (``outbox migrate --accept-changed VERSION``).
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Collection
from dataclasses import dataclass
from importlib import resources
from typing import Any

import psycopg
import sqlalchemy.exc
from sqlalchemy import Connection, Engine, text

from outbox.errors import (
    ConfigurationError,
    DatabaseError,
    MigrationError,
    SchemaOutdated,
    SchemaTooNew,
)
from outbox.storage import citus
from outbox.storage.encoding import refuse_server_encoding

__all__ = [
    "MIN_SERVER_VERSION",
    "NO_TRANSACTION",
    "Migration",
    "applied_versions",
    "check_schema",
    "migrate",
    "pending",
    "refuse_old_server",
    "refuse_server_encoding",
    "shipped",
]

log = logging.getLogger(__name__)

# Any constant works; it only has to be the same in every process.
_LOCK_ID = 0x0B0C5EED

#: The oldest PostgreSQL the schema runs on (``server_version_num``): 13 brought
#: ``pg_current_xact_id()`` and a built-in ``gen_random_uuid()``. The suite runs on
#: the embedded server's version (18). Stated in docs/reference/settings.md.
MIN_SERVER_VERSION = 130000


def refuse_old_server(server_version: int) -> None:
    """Refuse a server older than :data:`MIN_SERVER_VERSION` before a migration fails on it."""
    if server_version >= MIN_SERVER_VERSION:
        return
    major = server_version // 10000
    shown = (
        f"{major}.{server_version % 10000}"
        if major >= 10
        else f"{major}.{server_version // 100 % 100}"
    )
    raise ConfigurationError(
        f"PostgreSQL {shown} is too old: agent-outbox needs {MIN_SERVER_VERSION // 10000} or newer"
    )


_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
#: The marker line that makes a migration run outside a transaction.
NO_TRANSACTION = "-- outbox:no-transaction"
# Shipped files rewritten after release whose old text did the same thing; a
# database that recorded an old checksum is equivalent (the migrated-equals-fresh
# test holds for both) and its record is brought up to date silently.
_SUPERSEDED = {
    # 0004 builds its indexes CONCURRENTLY now; the indexes are the same.
    4: frozenset({"22946482ba44acb4f8cbfa0e2b578caab1322a8f3add37bc2a29a0e6f067eff0"}),
}
_LOCK_POLL_SECONDS = 0.05


@dataclass(frozen=True)
class Migration:
    """One numbered SQL file."""

    version: int
    name: str
    sql: str

    @property
    def label(self) -> str:
        """``0004_retention``: how messages name it."""
        return f"{self.version:04d}_{self.name}"

    @property
    def checksum(self) -> str:
        """sha256 of the file, recorded so an edited, already-applied file is noticed."""
        return hashlib.sha256(self.sql.encode()).hexdigest()

    @property
    def transactional(self) -> bool:
        """False when the file carries the ``-- outbox:no-transaction`` marker."""
        return not any(line.strip() == NO_TRANSACTION for line in self.sql.splitlines())

    def statements(self) -> list[str]:
        """The statements of a no-transaction file, one by one (comment lines dropped)."""
        return [
            "\n".join(
                line
                for line in statement.splitlines()
                if line.strip() and not line.strip().startswith("--")
            )
            for statement in one_by_one(self.sql)
        ]


def shipped() -> list[Migration]:
    """The migrations this code knows, in order."""
    found = []
    for entry in resources.files("outbox.storage.migrations").iterdir():
        match = _NAME.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text()))
    return sorted(found, key=lambda m: m.version)


def applied_versions(conn: Connection) -> list[int]:
    """Versions recorded in the database (empty for a fresh one)."""
    exists = conn.execute(text("SELECT to_regclass('outbox_migrations') IS NOT NULL")).scalar()
    if not exists:
        return []
    rows = conn.execute(text("SELECT version FROM outbox_migrations ORDER BY version"))
    return [row[0] for row in rows]


def pending(conn: Connection) -> list[Migration]:
    """Shipped migrations the database does not have yet."""
    done = set(applied_versions(conn))
    return [m for m in shipped() if m.version not in done]


def _refuse_newer(done: Collection[int]) -> None:
    known = shipped()[-1].version
    newer = [v for v in done if v > known]
    if newer:
        raise SchemaTooNew(
            f"database schema version {max(newer)} is newer than this agent-outbox "
            f"(knows up to {known}); upgrade agent-outbox instead of running old code on it"
        )


def check_schema(conn: Connection) -> None:
    """Raise unless the database schema is exactly what this code expects."""
    # (a migrated database restored into another encoding would start, and hash
    # keys and chain links unlike its clients from then on)
    refuse_server_encoding(str(conn.exec_driver_sql("SHOW server_encoding").scalar_one()))
    done = applied_versions(conn)
    _refuse_newer(done)
    missing = [m.version for m in shipped() if m.version not in done]
    if missing:
        raise SchemaOutdated(f"database is missing migrations {missing}; run `outbox migrate`")


# -- applying -----------------------------------------------------------------------------


def _recorded(pg: psycopg.Connection[Any]) -> dict[int, str]:
    row = pg.execute("SELECT to_regclass('outbox_migrations') IS NOT NULL").fetchone()
    if row is None or not row[0]:
        return {}
    return dict(pg.execute("SELECT version, checksum FROM outbox_migrations").fetchall())


def _verify_checksums(
    pg: psycopg.Connection[Any], recorded: dict[int, str], accept_changed: Collection[int]
) -> None:
    changed = []
    for migration in shipped():
        found = recorded.get(migration.version)
        if found is None or found == migration.checksum:
            continue
        if found in _SUPERSEDED.get(migration.version, ()):
            log.info("migration %s: recording the checksum of its current text", migration.label)
        elif migration.version in accept_changed:
            log.warning(
                "migration %s differs from what this database applied (recorded %s, "
                "shipped %s): accepted by the operator",
                migration.label,
                found[:12],
                migration.checksum[:12],
            )
        else:
            changed.append(migration)
            continue
        pg.execute(
            "UPDATE outbox_migrations SET checksum = %s WHERE version = %s",
            [migration.checksum, migration.version],
        )
    if changed:
        names = ", ".join(m.label for m in changed)
        versions = " ".join(f"--accept-changed {m.version}" for m in changed)
        raise MigrationError(
            f"shipped migration {names} differs from the one this database applied "
            f"(checksum mismatch): refusing to migrate. Never edit an applied migration; "
            f"if the database is known to match, run `outbox migrate {versions}`"
        )


def _first_line(exc: BaseException | None) -> str:
    diag = getattr(exc, "diag", None)
    message = getattr(diag, "message_primary", None) or str(exc)
    return message.strip().splitlines()[0] if message.strip() else type(exc).__name__


# What a script's semicolons hide in: comments, quoted text (E'' with backslash
# escapes too) and names, dollar quotes (a tag is not the middle of a name: a$b$c).
_SKIPPED = re.compile(
    r"--[^\n]*|/\*.*?\*/|(?<![A-Za-z0-9_])[Ee]'(?:[^'\\]|\\.|'')*'|'(?:[^']|'')*'"
    r"|\"(?:[^\"]|\"\")*\"|(?<![A-Za-z0-9_$])(\$(?:[A-Za-z_][A-Za-z_0-9]*)?\$).*?\1|;",
    re.S,
)


def one_by_one(script: str) -> list[str]:
    """The statements of ``script``, split at the semicolons outside quotes and comments.

    Citus propagates some DDL (a trigger's) to the shards with the text it was
    given: a script sent whole reaches them as several commands in one prepared
    statement, which they refuse. On a distributed database each goes alone.
    Not understood (no migration may use them): nested block comments and
    ``BEGIN ATOMIC`` function bodies.
    """
    found, start = [], 0
    for match in _SKIPPED.finditer(script):
        if match.group() == ";":
            found.append(script[start : match.end()])
            start = match.end()
    found.append(script[start:])
    return [s for s in found if _SKIPPED.sub("", s).strip(" \t\n;")]


def _apply(pg: psycopg.Connection[Any], migration: Migration, *, distributed: bool) -> None:
    record = (
        "INSERT INTO outbox_migrations (version, name, checksum) VALUES (%s, %s, %s)",
        [migration.version, migration.name, migration.checksum],
    )
    log.info("applying migration %s", migration.label)
    try:
        if migration.transactional:
            with pg.transaction():
                if distributed:
                    # DDL on a distributed table runs over a connection per shard by
                    # default, and Citus then refuses a function's DDL in the same
                    # transaction: one connection per node instead
                    pg.execute("SET LOCAL citus.multi_shard_modify_mode TO 'sequential'")
                # psycopg runs a parameterless multi-statement script in one go.
                for script in one_by_one(migration.sql) if distributed else [migration.sql]:
                    pg.execute(script.encode())
                pg.execute(*record)
        else:
            for statement in migration.statements():
                pg.execute(statement.encode())
            pg.execute(*record)
    except psycopg.Error as exc:
        then = (
            "nothing of it was applied"
            if migration.transactional
            else "it runs outside a transaction: fix the cause and run `outbox migrate` again"
        )
        raise MigrationError(
            f"migration {migration.label} failed: {_first_line(exc)} ({then})"
        ) from exc


def _lock(pg: psycopg.Connection[Any]) -> None:
    waited = False
    while True:
        row = pg.execute("SELECT pg_try_advisory_lock(%s)", [_LOCK_ID]).fetchone()
        if row is not None and row[0]:
            return
        if not waited:
            log.info("another process is migrating this database; waiting for it")
            waited = True
        time.sleep(_LOCK_POLL_SECONDS)


def migrate(
    engine: Engine, *, accept_changed: Collection[int] = (), target: int | None = None
) -> list[Migration]:
    """Apply every pending migration (up to ``target``); return those applied by this call.

    Refuses (``SchemaTooNew``) when the database was migrated by newer code, and
    (``MigrationError``) when an applied migration's recorded checksum differs
    from the shipped file, unless its version is in ``accept_changed``.
    """
    try:
        raw = engine.raw_connection()
    except sqlalchemy.exc.DBAPIError as exc:
        raise DatabaseError(f"connecting to migrate failed: {_first_line(exc.orig)}") from exc
    except psycopg.Error as exc:  # the pool hands out the driver's own error here
        raise DatabaseError(f"connecting to migrate failed: {_first_line(exc)}") from exc
    pg: psycopg.Connection[Any] = raw.driver_connection  # type: ignore[assignment]
    applied: list[Migration] = []
    try:
        pg.autocommit = True
        refuse_old_server(pg.info.server_version)
        # (asked: a pooler need not pass the server's parameter status on)
        encoding = pg.execute("SHOW server_encoding").fetchone()
        refuse_server_encoding(str(encoding[0] if encoding else None))
        _lock(pg)
        try:
            recorded = _recorded(pg)
            _refuse_newer(recorded)
            _verify_checksums(pg, recorded, accept_changed)
            pending = [
                m
                for m in shipped()
                if m.version not in recorded and (target is None or m.version <= target)
            ]
            # (placed again even with nothing pending: a worker added since gets one;
            # the database's settings, an upgrade's new ones included, likewise)
            distributed = citus.is_distributed(pg)
            if distributed and pending:
                citus.drop_gates_views(pg)
            for migration in pending:
                _apply(pg, migration, distributed=distributed)
                applied.append(migration)
            if distributed:
                if pending:
                    citus.propagate_functions(pg)
                citus.place_gates_views(pg)
                citus.apply_database_settings(pg)
        finally:
            if not pg.closed:
                pg.execute("SELECT pg_advisory_unlock(%s)", [_LOCK_ID])
    except psycopg.Error as exc:
        raise DatabaseError(f"migrating failed: {_first_line(exc)}") from exc
    finally:
        if not pg.closed:
            pg.autocommit = False
        raw.close()
    return applied
