"""Versioned migrations: numbered ``.sql`` files shipped in the package, applied under a lock.

Each file runs in its own transaction together with its row in
``outbox_migrations``; a transaction-scoped advisory lock makes two processes
migrating at once take turns, and the second finds nothing left to do.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from importlib import resources

from sqlalchemy import Connection, Engine, text

from outbox.errors import SchemaOutdated, SchemaTooNew

__all__ = ["Migration", "applied_versions", "check_schema", "migrate", "pending", "shipped"]

log = logging.getLogger(__name__)

# Any constant works; it only has to be the same in every process.
_LOCK_ID = 0x0B0C5EED
_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True)
class Migration:
    """One numbered SQL file."""

    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        """sha256 of the file, recorded so an edited, already-applied file is noticed."""
        return hashlib.sha256(self.sql.encode()).hexdigest()


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


def check_schema(conn: Connection) -> None:
    """Raise unless the database schema is exactly what this code expects."""
    done = applied_versions(conn)
    known = [m.version for m in shipped()]
    newer = [v for v in done if v > known[-1]]
    if newer:
        raise SchemaTooNew(
            f"database schema version {max(newer)} is newer than this agent-outbox "
            f"(knows up to {known[-1]}); upgrade agent-outbox instead of running old code on it"
        )
    missing = [v for v in known if v not in done]
    if missing:
        raise SchemaOutdated(f"database is missing migrations {missing}; run `outbox migrate`")


def migrate(engine: Engine) -> list[Migration]:
    """Apply every pending migration; return those applied by this call.

    Refuses (``SchemaTooNew``) when the database was migrated by newer code.
    """
    applied: list[Migration] = []
    for migration in shipped():
        with engine.begin() as conn:
            conn.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": _LOCK_ID})
            done = applied_versions(conn)
            if done and max(done) > shipped()[-1].version:
                check_schema(conn)
            if migration.version in done:
                continue
            log.info("applying migration %04d_%s", migration.version, migration.name)
            # psycopg runs a parameterless multi-statement script in one go.
            driver = conn.connection.driver_connection
            assert driver is not None
            driver.execute(migration.sql)
            conn.execute(
                text(
                    "INSERT INTO outbox_migrations (version, name, checksum) "
                    "VALUES (:version, :name, :checksum)"
                ),
                {
                    "version": migration.version,
                    "name": migration.name,
                    "checksum": migration.checksum,
                },
            )
            applied.append(migration)
    return applied
