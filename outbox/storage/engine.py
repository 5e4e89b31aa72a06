"""Engines, DSNs and the one place where driver errors become :class:`~outbox.errors.DatabaseError`.

``OUTBOX_DSN`` names a server, or the embedded one is started (and migrated,
since it is ours). Every session we open sets
``idle_in_transaction_session_timeout``: a transaction left open stops vacuum
and slows every claim (DESIGN.md, lessons).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy.exc
from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from outbox.errors import DatabaseError, IdempotencyConflict
from outbox.settings import Settings
from outbox.storage.embedded import EmbeddedServer
from outbox.storage.migrate import check_schema, migrate

__all__ = [
    "libpq_dsn",
    "make_async_engine",
    "make_engine",
    "open_async_engine",
    "open_engine",
    "psycopg_url",
    "resolve_dsn",
    "translate_errors",
]


def psycopg_url(dsn: str | URL) -> URL:
    """A SQLAlchemy URL on psycopg 3 for any ``postgresql://`` DSN."""
    url = make_url(dsn) if isinstance(dsn, str) else dsn
    if url.drivername in ("postgresql", "postgres", "postgresql+psycopg2"):
        url = url.set(drivername="postgresql+psycopg")
    return url


def libpq_dsn(dsn: str | URL) -> str:
    """A plain libpq DSN (what psycopg.connect takes) for a SQLAlchemy URL or DSN."""
    url = make_url(dsn) if isinstance(dsn, str) else dsn
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


def _connect_args(idle_in_transaction_ms: int, application_name: str) -> dict[str, str]:
    return {
        "options": f"-c idle_in_transaction_session_timeout={idle_in_transaction_ms}",
        "application_name": application_name,
    }


def make_engine(
    dsn: str | URL,
    *,
    pool_size: int = 5,
    idle_in_transaction_ms: int = 60_000,
    application_name: str = "outbox",
) -> Engine:
    """A sync engine on psycopg 3 for any ``postgresql://`` DSN."""
    return create_engine(
        psycopg_url(dsn),
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_pre_ping=False,
        connect_args=_connect_args(idle_in_transaction_ms, application_name),
    )


def make_async_engine(
    dsn: str | URL,
    *,
    pool_size: int = 4,
    application_name: str = "outbox-deliver",
    idle_in_transaction_ms: int = 60_000,
) -> AsyncEngine:
    """An async engine on psycopg 3, with the connection count bounded."""
    return create_async_engine(
        psycopg_url(dsn),
        pool_size=pool_size,
        max_overflow=0,
        # No ping per checkout (a round trip per transaction): a dropped
        # connection fails its statement, is discarded, and the loop retries.
        pool_pre_ping=False,
        connect_args=_connect_args(idle_in_transaction_ms, application_name),
    )


@contextmanager
def translate_errors(action: str) -> Iterator[None]:
    """Re-raise driver errors as :class:`DatabaseError`, keeping the original as the cause.

    A unique violation on the idempotency key becomes :class:`IdempotencyConflict`
    naming the key. Usable around ``await`` too: it only looks at what is raised.
    """
    try:
        yield
    except sqlalchemy.exc.IntegrityError as exc:
        constraint = getattr(getattr(exc.orig, "diag", None), "constraint_name", None)
        if constraint == "outbox_effects_idempotency_key":
            detail = getattr(getattr(exc.orig, "diag", None), "message_detail", None) or ""
            match = re.search(r"\(idempotency_key\)=\((.*)\) already exists", detail)
            key = match[1] if match else "<unknown>"
            raise IdempotencyConflict(key, f"while {action}: already intended") from exc
        raise DatabaseError(f"{action} failed: {exc.orig}") from exc
    except sqlalchemy.exc.DBAPIError as exc:
        raise DatabaseError(f"{action} failed: {exc.orig}") from exc
    except sqlalchemy.exc.SQLAlchemyError as exc:
        raise DatabaseError(f"{action} failed: {exc}") from exc


def resolve_dsn(settings: Settings) -> tuple[str, bool]:
    """The DSN to use and whether it points at the embedded server (started if needed)."""
    if settings.dsn:
        return settings.dsn, False
    return EmbeddedServer(settings.home).ensure_running(), True


def open_engine(settings: Settings, *, application_name: str = "outbox") -> Engine:
    """An engine on a database whose schema matches this code.

    The embedded server is migrated automatically (it is ours); a database named
    by ``OUTBOX_DSN`` is migrated only when ``auto_migrate`` is set, and is
    otherwise checked, so an operator decides when its schema changes.
    """
    dsn, embedded = resolve_dsn(settings)
    engine = make_engine(
        dsn,
        pool_size=settings.pool_size,
        idle_in_transaction_ms=settings.idle_in_transaction_timeout_ms,
        application_name=application_name,
    )
    auto = embedded if settings.auto_migrate is None else settings.auto_migrate
    try:
        if auto:
            migrate(engine)
        with translate_errors("checking the schema"), engine.connect() as conn:
            check_schema(conn)
    except BaseException:
        engine.dispose()
        raise
    return engine


def open_async_engine(settings: Settings, *, application_name: str = "outbox") -> AsyncEngine:
    """The async twin of :func:`open_engine` (call it in a thread: it may start a server).

    The schema is migrated or checked through a short-lived sync engine, by the
    same code; the async engine then gets the same pool size and session settings.
    """
    check = open_engine(settings, application_name=application_name)
    try:
        url = check.url
    finally:
        check.dispose()
    return create_async_engine(
        psycopg_url(url),
        pool_size=settings.pool_size,
        max_overflow=settings.pool_size,
        pool_pre_ping=False,
        connect_args=_connect_args(settings.idle_in_transaction_timeout_ms, application_name),
    )
