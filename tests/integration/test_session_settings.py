"""Every session of ours, the deliverer's own psycopg connections included, keeps
what the DSN asks and sets what the outbox's SQL needs.

Three databases a user may bring, each migrated, written through a run and
drained by a real delivery daemon: the outbox in a schema of its own (the DSN's
``options=-c search_path=...``), a database set to the pre-9.1 string escapes
(``standard_conforming_strings = off``), and a SQL_ASCII one. The deliverer's
claims run on psycopg connections of their own: they dropped the DSN's
``options`` (the claim found no ``outbox_effects``) and asked no client
encoding; ``outbox migrate`` failed at 0007 on the escapes.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterator
from datetime import date
from typing import Any

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from deliverers.testing import RecordingDeliverer
from outbox import Outbox
from outbox.delivery.daemon import DeliveryDaemon
from outbox.delivery.settings import DeliverySettings
from outbox.storage.async_store import AsyncStore
from outbox.storage.engine import make_async_engine, make_engine
from outbox.storage.migrate import migrate

KIND = "k.session"
#: A backslash, a quote and text beyond ASCII: what escapes and encodings would change.
PAYLOAD = {"path": "C:\\temp\\new", "quote": "it's", "text": "café-漢字-🙂"}


@pytest.fixture
def database(admin_dsn: str) -> Iterator[Callable[..., str]]:
    """Databases made by ``make(*setup, encoding=..., query=...)``; dropped after the test."""
    names: list[str] = []

    def make(*setup: str, encoding: str = "UTF8", query: str = "") -> str:
        name = f"sessions_{len(names)}_{os.getpid()}"
        names.append(name)
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(
                f"CREATE DATABASE {name} ENCODING '{encoding}' LC_COLLATE 'C' LC_CTYPE 'C'"
                " TEMPLATE template0"
            )
        dsn = make_url(admin_dsn).set(database=name).render_as_string(False)
        with psycopg.connect(dsn, autocommit=True) as conn:
            for statement in setup:
                conn.execute(statement.replace("{db}", name))
        return f"{dsn}&{query}" if query else dsn

    yield make
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        for name in names:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def _write_then_deliver(dsn: str) -> tuple[list[Any], list[str]]:
    """Migrate, intend one effect through a run, drain it; (payloads delivered, statuses)."""
    engine = make_engine(dsn)
    try:
        migrate(engine)
    finally:
        engine.dispose()
    with Outbox.connect(dsn) as ob:
        run = ob.start_run("sessions", "1")
        run.transaction("s", lambda tx: tx.intend(KIND, PAYLOAD) and None)
    sink = RecordingDeliverer(KIND)

    async def main() -> list[str]:
        store = AsyncStore(make_async_engine(dsn))
        daemon = DeliveryDaemon(store, {KIND: sink}, DeliverySettings(poll_seconds=0.1))
        task = asyncio.create_task(daemon.run())
        try:
            for _ in range(200):
                still_open = {status for status, _ in (await store.state_counts()).effects}
                if sink.deliveries and not still_open:
                    break
                await asyncio.sleep(0.05)
            return sorted(still_open) or ["none open"]
        finally:
            daemon.stop()
            await task
            await store.dispose()

    open_statuses = asyncio.run(main())
    return [d.payload for d in sink.deliveries], open_statuses


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_the_outbox_in_a_schema_the_dsn_names(
    database: Callable[..., str], caplog: pytest.LogCaptureFixture
) -> None:
    dsn = database("CREATE SCHEMA agents", query="options=-c%20search_path%3Dagents")
    with caplog.at_level(logging.WARNING):
        delivered, open_statuses = _write_then_deliver(dsn)
    assert delivered == [PAYLOAD], "the deliverer's claims read the DSN's schema"
    assert open_statuses == ["none open"]
    # its LISTEN and owner-lock sessions were refused ("+search_path"): no wake-ups,
    # no early recovery, a warning a second
    assert _warnings(caplog) == []
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT to_regclass('public.outbox_effects')").fetchone() == (None,)


def test_a_database_with_the_old_string_escapes(
    database: Callable[..., str], caplog: pytest.LogCaptureFixture
) -> None:
    dsn = database("ALTER DATABASE {db} SET standard_conforming_strings = off")
    with caplog.at_level(logging.WARNING):
        delivered, open_statuses = _write_then_deliver(dsn)
    assert delivered == [PAYLOAD]
    assert open_statuses == ["none open"]
    assert _warnings(caplog) == []


def test_a_sql_ascii_database_hands_the_deliverer_text(
    database: Callable[..., str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        delivered, open_statuses = _write_then_deliver(database(encoding="SQL_ASCII"))
    assert delivered == [PAYLOAD]
    assert open_statuses == ["none open"]
    assert _warnings(caplog) == []


#: SQL API calls whose bodies hold backslashes or patterns, with their arguments.
CALLS: list[tuple[str, tuple[Any, ...]]] = [
    ("outbox_printable(%s)", ("a\\b\t\n\x01é\u2028🙂",)),
    ("outbox_intent_rules()", ()),
    (
        "outbox_gate_verdict(%s::jsonb, %s::jsonb)",
        ('{"path": ["a"], "op": "gt", "value": 100}', '{"a": "1x5"}'),
    ),
    (
        "outbox_gate_verdict(%s::jsonb, %s::jsonb)",
        ('{"path": ["a"], "op": "gt", "value": 100}', '{"a": "150.5"}'),
    ),
    (
        "outbox_payload_violation(%s::jsonb, 'payload')",
        ('{"headers": {"x-a": "Bearer abcdefghijklmnopqrstu"}}',),
    ),
    ("outbox_payload_violation(%s::jsonb, 'payload')", ('{"headers": {"x-a": "a\\u0007b"}}',)),
]


def test_the_sql_api_reads_alike_in_a_session_with_the_old_escapes(
    database: Callable[..., str],
) -> None:
    """A function's body is read in its caller's session: psql, or the TypeScript
    client, on a database set to the old escapes reads a '\\' literal as an open
    string (a syntax error), '\\.' in a pattern as any character (a quoted "1x5"
    judged a number), and the rules' JSON as invalid."""
    dsn = database("ALTER DATABASE {db} SET standard_conforming_strings = off")
    engine = make_engine(dsn)
    try:
        migrate(engine)
    finally:
        engine.dispose()
    answers: dict[str, list[Any]] = {}
    for setting in ("on", "off"):
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"SET standard_conforming_strings = {setting}")
            conn.execute("SET escape_string_warning = off")
            answers[setting] = [
                conn.execute(f"SELECT {call}", args).fetchone() for call, args in CALLS
            ]
    assert answers["off"] == answers["on"]
    printable, _, quoted, number, credential, bell = answers["on"]
    assert printable == ("a\\\\b\\t\\n\\x01\\xe9\\u2028\\U0001f642",)
    assert quoted == ("the payload is a string, not a number (gt 100)",)
    assert number == ("",)
    assert credential[0]["shown"] == "Bearer <hidden>"
    assert bell[0]["rule"] == "header-value-control"


def test_a_deliverers_sessions_read_committed_whatever_the_database_defaults_to(
    database: Callable[..., str], caplog: pytest.LogCaptureFixture
) -> None:
    """Claims are written for READ COMMITTED; under a SERIALIZABLE default each
    could fail as a serialization conflict with a step or another claim."""
    dsn = database("ALTER DATABASE {db} SET default_transaction_isolation = serializable")
    with caplog.at_level(logging.WARNING):
        delivered, open_statuses = _write_then_deliver(dsn)
    assert delivered == [PAYLOAD] and open_statuses == ["none open"]
    assert _warnings(caplog) == []

    async def isolations() -> list[str]:
        store = AsyncStore(make_async_engine(dsn))
        try:
            async with store._direct.connection() as direct:  # the claims' own sessions
                claims = await (await direct.execute("SHOW transaction_isolation")).fetchone()
            async with store.engine.connect() as pooled:
                duties = await pooled.scalar(text("SHOW transaction_isolation"))
            assert claims is not None
            return [claims["transaction_isolation"], str(duties)]
        finally:
            await store.dispose()

    with psycopg.connect(dsn) as conn:
        assert conn.execute("SHOW transaction_isolation").fetchone() == ("serializable",)
    assert asyncio.run(isolations()) == ["read committed", "read committed"]


def test_a_database_in_another_date_and_interval_style(
    database: Callable[..., str], caplog: pytest.LogCaptureFixture
) -> None:
    """psycopg reads a timestamp sent as text only in the ISO date style; our
    sessions switch to it and keep the database's day/month order, which a
    caller's own SQL in a step may rely on."""
    dsn = database(
        "ALTER DATABASE {db} SET DateStyle = 'SQL, DMY'",
        "ALTER DATABASE {db} SET IntervalStyle = 'iso_8601'",
    )
    with caplog.at_level(logging.WARNING):
        delivered, open_statuses = _write_then_deliver(dsn)
    assert delivered == [PAYLOAD] and open_statuses == ["none open"]
    assert _warnings(caplog) == []
    read = "SELECT current_setting('DateStyle'), CAST('01/02/2024' AS date)"
    with Outbox.connect(dsn) as ob:
        (record,) = ob.runs(agent="sessions")
        assert record.created_at.tzinfo is not None
        with ob.engine.connect() as conn:
            assert tuple(conn.execute(text(read)).one()) == ("ISO, DMY", date(2024, 2, 1))

    async def direct() -> Any:
        store = AsyncStore(make_async_engine(dsn))
        try:
            async with store._direct.connection() as conn:
                return await (await conn.execute(read)).fetchone()
        finally:
            await store.dispose()

    assert list(asyncio.run(direct()).values()) == ["ISO, DMY", date(2024, 2, 1)]
