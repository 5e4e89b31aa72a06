"""Where the database is: ``OUTBOX_DSN``, or the embedded server, migrated when it is ours."""

from __future__ import annotations

import logging

from sqlalchemy import Engine

from outbox.settings import Settings
from outbox.storage.embedded import EmbeddedServer
from outbox.storage.migrate import check_schema, migrate
from outbox.storage.store import make_engine, translate_errors

__all__ = ["open_engine", "resolve_dsn"]

log = logging.getLogger(__name__)


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
