"""Engines and the one place where driver errors become :class:`~outbox.errors.DatabaseError`.

``OUTBOX_DSN`` names a server, or the embedded one is started (and migrated,
since it is ours). Every session we open sets
``idle_in_transaction_session_timeout``: a transaction left open stops vacuum
and slows every claim (DESIGN.md, lessons).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from decimal import Decimal
from typing import Any

import psycopg
import sqlalchemy.exc
from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from outbox.errors import (
    BudgetExceeded,
    DatabaseError,
    EmbeddedServerError,
    IdempotencyConflict,
    LeaseLost,
    OutboxError,
    PayloadError,
    RunExists,
    RunNotFound,
    RunPaused,
    RunStateError,
    RunTerminal,
    StepAlreadyRecorded,
    StoredValueAltered,
    ValidationError,
)
from outbox.settings import Settings
from outbox.storage.admin.embedded import EmbeddedServer
from outbox.storage.dsn import ISO_DATES, iso_dates_needed, psycopg_url, session_args
from outbox.storage.migrate import check_schema, migrate

__all__ = [
    "distributed",
    "make_async_engine",
    "make_engine",
    "node_unreachable",
    "open_async_engine",
    "open_engine",
    "resolve_dsn",
    "sql_api_error",
    "translate_errors",
    "write_settings",
]


def write_settings(settings: Settings) -> dict[str, Any]:
    """The client's limits as the write functions read them (``outbox.<name>`` settings).

    The database enforces the limits of the session that writes; a client's
    stricter ones refuse earlier, at ``tx.intend``.
    """
    return {
        "max_payload_bytes": settings.max_payload_bytes,
        "blob_threshold_bytes": settings.blob_threshold_bytes,
        "max_step_intents": settings.max_step_intents,
        "max_step_bytes": settings.max_step_bytes,
        "max_step_id_length": settings.max_step_id_length,
        "notify_window_ms": settings.notify_window_ms,
    }


#: The pool every engine of ours gets. No ping on every checkout (a round trip
#: per transaction): only a connection idle for ``IDLE_PING_S`` is pinged
#: (:func:`_ping_after_idle`); one dropped while in use fails its statement, is
#: discarded, and the caller's retry takes another. Last in, first out: a FIFO
#: pool hands a lone writer its connections in turn as soon as a second one
#: exists (the wake-up thread's trailing NOTIFY, a read beside a step), and each
#: backend then serves every other step with its caches cold: 892 against 976
#: steps/s, one writer, ten interleaved rounds on the embedded server (2026-12-06).
POOL_OPTIONS: Mapping[str, Any] = {"pool_pre_ping": False, "pool_use_lifo": True}
#: Seconds a pooled connection may sit idle before it is pinged on checkout (see
#: :func:`_ping_after_idle`); read at each checkout.
IDLE_PING_S = 10.0
_IDLE_SINCE = "outbox.idle_since"

# Reads use ``engine.begin()`` (a COMMIT at the end), not ``engine.connect()`` (a
# ROLLBACK): psycopg forgets every statement it prepared on a connection at a
# ROLLBACK, so one read made every statement of that connection be planned afresh
# (tests/integration/test_client_plans.py).


def make_engine(
    dsn: str | URL,
    *,
    pool_size: int = 5,
    idle_in_transaction_ms: int = 60_000,
    application_name: str = "outbox",
    session_settings: Mapping[str, Any] | None = None,
) -> Engine:
    """A sync engine on psycopg 3 for any ``postgresql://`` DSN."""
    url = psycopg_url(dsn)
    engine = create_engine(
        url,
        pool_size=pool_size,
        max_overflow=pool_size,
        connect_args=session_args(url, idle_in_transaction_ms, application_name, session_settings),
        **POOL_OPTIONS,
    )
    _watch_pool(engine)
    return engine


def make_async_engine(
    dsn: str | URL,
    *,
    pool_size: int = 4,
    application_name: str = "outbox-deliver",
    idle_in_transaction_ms: int = 60_000,
) -> AsyncEngine:
    """The delivery store's engine: psycopg 3, the connection count bounded, READ COMMITTED."""
    url = psycopg_url(dsn)
    engine = create_async_engine(
        url,
        pool_size=pool_size,
        max_overflow=0,
        connect_args=session_args(
            url, idle_in_transaction_ms, application_name, read_committed=True
        ),
        **POOL_OPTIONS,
    )
    _watch_pool(engine.sync_engine)
    return engine


def sql_api_error(sqlstate: str | None, message: str, detail: str | None) -> OutboxError | None:
    """The typed error for a SQL API refusal (SQLSTATE class ``OB``), else None.

    ``detail`` is the JSON object the SQL functions put in the error's DETAIL
    (docs/sql-api.md, "Errors"): the fields each exception is built from.
    """
    if sqlstate is None or not sqlstate.startswith("OB"):
        return None
    try:
        fields: dict[str, Any] = json.loads(detail or "{}")
    except ValueError:
        fields = {}
    match sqlstate:
        case "OB001":
            field, value, rule = fields.get("field", "?"), fields.get("value"), fields.get("rule")
            return ValidationError(field, value, fields["reason"], rule=rule)
        case "OB002":
            return PayloadError(fields.get("field", "?"), fields.get("value"), fields["reason"])
        case "OB003":
            return IdempotencyConflict(fields["key"], fields["reason"])
        case "OB004":
            return RunNotFound(_uuid(fields["run_id"]))
        case "OB005":
            return RunTerminal(_uuid(fields["run_id"]), fields["status"])
        case "OB006":
            return StepAlreadyRecorded(_uuid(fields["run_id"]), fields["step_id"])
        case "OB007":
            return BudgetExceeded(
                _uuid(fields["run_id"]),
                float(Decimal(str(fields["requested"]))),
                float(Decimal(str(fields["remaining"]))),
            )
        case "OB008":
            return RunStateError(message)
        case "OB009":
            return RunPaused(_uuid(fields["run_id"]), fields.get("reason"))
        case "OB010":
            return RunExists(fields["key"], _uuid(fields["run_id"]))
        case "OB011":
            return LeaseLost(message)
        case "OB012":
            return StoredValueAltered(fields["sha256"])
    return DatabaseError(message, sqlstate=sqlstate)


def _uuid(value: Any) -> Any:
    """A run id from a refusal's DETAIL, as the Python client names runs (a UUID)."""
    try:
        return uuid.UUID(str(value))
    except ValueError:
        return value


@contextmanager
def translate_errors(action: str) -> Iterator[None]:
    """Re-raise driver errors as :class:`DatabaseError`, keeping the original as the cause.

    A unique violation on the idempotency key becomes :class:`IdempotencyConflict`
    naming the key; a SQL API refusal (SQLSTATE ``OB...``) becomes its typed error
    (:func:`sql_api_error`). Usable around ``await`` too: it only looks at what is raised.
    """
    try:
        yield
    except psycopg.Error as exc:
        # The write functions are called on the driver's connection itself.
        typed = sql_api_error(
            exc.sqlstate, exc.diag.message_primary or str(exc), exc.diag.message_detail
        )
        if typed is not None:
            raise typed from exc
        wrapped = sqlalchemy.exc.DBAPIError.instance(None, None, exc, psycopg.Error)
        with translate_errors(action):
            raise wrapped from exc
    except sqlalchemy.exc.DBAPIError as exc:
        diag = getattr(exc.orig, "diag", None)
        typed = sql_api_error(
            getattr(exc.orig, "sqlstate", None),
            getattr(diag, "message_primary", None) or str(exc.orig),
            getattr(diag, "message_detail", None),
        )
        if typed is not None:
            raise typed from exc
        constraint = getattr(diag, "constraint_name", None)
        if (
            isinstance(exc, sqlalchemy.exc.IntegrityError)
            and constraint == "outbox_effects_idempotency_key"
        ):
            detail = getattr(diag, "message_detail", None) or ""
            match = re.search(
                r"\(namespace, idempotency_key, shard\)=\([^,]*, (.*), \d+\) already exists", detail
            )
            key = match[1] if match else "<unknown>"
            raise IdempotencyConflict(
                key, f"intended concurrently by another transaction (while {action})"
            ) from exc
        if isinstance(exc, sqlalchemy.exc.IntegrityError) and constraint == "outbox_runs_pkey":
            detail = getattr(diag, "message_detail", None) or ""
            match = re.search(r"\(id, shard\)=\((.*), \d+\) already exists", detail)
            raise ValidationError(
                "run_id", match[1] if match else "<unknown>", "a run with this id exists already"
            ) from exc
        raise DatabaseError(f"{action} failed: {exc.orig}", **_nature(exc)) from exc
    except sqlalchemy.exc.SQLAlchemyError as exc:
        raise DatabaseError(f"{action} failed: {exc}", **_nature(exc)) from exc


#: SQLSTATE classes of errors that say nothing about the statement itself:
#: connection (08), transaction rollback: serialization, deadlock (40), resources
#: (53), operator intervention: shutdown, cancel (57), system (58).
TRANSIENT_SQLSTATE_CLASSES = frozenset({"08", "40", "53", "57", "58"})


def node_unreachable(exc: BaseException | None) -> bool:
    """A driver error saying a server (on Citus: the node holding a shard) did not answer.

    Citus reports a worker it cannot reach as SQLSTATE 08006 from the coordinator,
    whose own session lives on: the statement failed, not the connection.
    """
    if isinstance(exc, psycopg.OperationalError):
        return True
    return str(getattr(exc, "sqlstate", None) or "").startswith("08")


def _nature(exc: sqlalchemy.exc.SQLAlchemyError) -> dict[str, Any]:
    """What :class:`DatabaseError` says of a driver error (sqlstate, transient, connection_lost)."""
    if isinstance(exc, sqlalchemy.exc.TimeoutError | sqlalchemy.exc.DisconnectionError):
        return {"sqlstate": None, "transient": True}  # the pool: no statement ran
    orig = getattr(exc, "orig", None)
    sqlstate = getattr(orig, "sqlstate", None)
    # SQLAlchemy invalidates a connection it had when the driver says it is gone; a
    # connection that could not be made at all is not invalidated. Nor is one cut
    # while SQLAlchemy's first queries ran on it, or one of our own psycopg
    # connections: psycopg names the session only of a connection attempt that failed.
    lost = bool(getattr(exc, "connection_invalidated", False)) or (
        isinstance(orig, psycopg.OperationalError)
        and not isinstance(orig, psycopg.errors.ConnectionTimeout)
        and orig.sqlstate is None
        and orig.pgconn is None
    )
    if sqlstate:
        transient = sqlstate[:2] in TRANSIENT_SQLSTATE_CLASSES
        return {"sqlstate": sqlstate, "transient": transient, "connection_lost": lost}
    # No code from the server: the connection failed, or the driver refused the
    # parameters before sending them (an encoding error), which would recur.
    failed = lost or isinstance(orig, psycopg.OperationalError | psycopg.InterfaceError)
    return {"sqlstate": None, "transient": failed, "connection_lost": lost}


def resolve_dsn(settings: Settings) -> tuple[str, bool]:
    """The DSN to use and whether it points at the embedded server (started if needed)."""
    if settings.dsn:
        psycopg_url(settings.dsn)  # refuse a DSN that is not PostgreSQL's before connecting
        return settings.dsn, False
    try:
        return EmbeddedServer(settings.home).ensure_running(), True
    except OSError as exc:
        raise EmbeddedServerError(
            f"home={str(settings.home)!r} (OUTBOX_HOME or --home) cannot hold the embedded "
            f"server: {exc.strerror or exc}"
        ) from exc


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
        session_settings=write_settings(settings),
    )
    auto = embedded if settings.auto_migrate is None else settings.auto_migrate
    try:
        if auto:
            with translate_errors("migrating"):
                migrate(engine)
        with translate_errors("checking the schema"), engine.begin() as conn:
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
    url = psycopg_url(url)
    engine = create_async_engine(
        url,
        pool_size=settings.pool_size,
        max_overflow=settings.pool_size,
        connect_args=session_args(
            url, settings.idle_in_transaction_timeout_ms, application_name, write_settings(settings)
        ),
        **POOL_OPTIONS,
    )
    _watch_pool(engine.sync_engine)
    return engine


_DISTRIBUTED = "SELECT current_setting('outbox.distributed', true)"


def distributed(conn: Connection) -> bool:
    """Whether the tables are distributed (Citus: ``outbox migrate --distribute``).

    Asked once per database session: the setting is the database's, read by a
    session when it starts, so a session's answer never changes. Our engines ask
    as they connect (:func:`_learn_layout`, once an engine); a caller's, on first use.
    """
    known = conn.info.get("outbox.distributed")
    if known is None:
        setting = conn.execute(text(_DISTRIBUTED)).scalar()
        known = conn.info["outbox.distributed"] = setting == "on"
    return bool(known)


def _watch_pool(engine: Engine) -> None:
    """The pool events every engine of ours gets."""
    _learn_layout(engine)
    _ping_after_idle(engine)
    event.listen(engine, "connect", _iso_dates)


def _iso_dates(dbapi_connection: Any, _record: Any) -> None:
    """A new session in another date style is switched to ISO (:data:`ISO_DATES`)."""
    if not iso_dates_needed(dbapi_connection.info):
        return
    autocommit = dbapi_connection.autocommit
    dbapi_connection.autocommit = True  # in a transaction, the pool's rollback would undo it
    try:
        cursor = dbapi_connection.cursor()
        cursor.execute(ISO_DATES)
        cursor.close()
    finally:
        dbapi_connection.autocommit = autocommit


def _ping_after_idle(engine: Engine) -> None:
    """A connection idle in the pool for :data:`IDLE_PING_S` is pinged before it is handed out.

    Last in, first out leaves the spare connections idle for as long as the load
    stays low (FIFO left them all idle after a quiet night), and a proxy or the
    server's ``idle_session_timeout`` may close them meanwhile: a dead one is now
    replaced on checkout instead of failing its caller's first statement. One in
    steady use is never pinged; ``pool_pre_ping`` would cost every transaction a
    round trip. The ping commits (a ROLLBACK would make psycopg forget the
    statements it prepared on the connection).
    """
    dialect = engine.dialect

    def idle_from(dbapi_connection: Any, record: Any) -> None:
        record.info[_IDLE_SINCE] = time.monotonic()

    def ping_if_idle(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        since = record.info.pop(_IDLE_SINCE, None)
        if since is None or time.monotonic() - since < IDLE_PING_S:
            return
        try:
            dialect.do_ping(dbapi_connection)
            dbapi_connection.commit()
        except Exception as exc:  # the pool replaces the connection and tries again
            raise sqlalchemy.exc.DisconnectionError(f"idle connection is gone: {exc}") from exc

    event.listen(engine, "checkin", idle_from)
    event.listen(engine, "checkout", ping_if_idle)


def _learn_layout(engine: Engine) -> None:
    """Each new connection of ``engine`` knows :func:`distributed`'s answer from the start.

    Not on first use: a step's call commits by itself only while its transaction
    has sent nothing (``writes.untouched``), and the question would be something
    sent; asked later, the first step of every connection took three round trips.
    The first connection asks and the rest are told: the layout is the database's
    (``outbox migrate --distribute`` changes it, and processes restart after, as a
    delivery store's answer is kept for its life too), and asking on each one cost
    a query and a commit per connection, which a pool opens per checkout past its size.
    On a distributed database each connection also prepares nothing of its own
    accord (the statements that name their shard by its id must be planned with it).
    """
    known: list[bool] = []

    def learn(dbapi_connection: Any, record: Any) -> None:
        if not known:
            cursor = dbapi_connection.cursor()
            try:
                cursor.execute(_DISTRIBUTED)
                row = cursor.fetchone()
            finally:
                cursor.close()
            dbapi_connection.commit()
            known.append(row is not None and row[0] == "on")
        record.info["outbox.distributed"] = known[0]
        if known[0]:
            # Statements find their shard by ``shard = outbox_shard_of(:id)``: once a
            # session prepared one, PostgreSQL may take a generic plan, which Citus
            # cannot route without the value (it ran on every shard, and one that
            # locks was refused). Unprepared, each is planned with its values.
            driver = getattr(dbapi_connection, "driver_connection", dbapi_connection)
            driver.prepare_threshold = None

    event.listen(engine, "connect", learn)
