"""A DSN's own ``options`` reach every session, beside the ones the engines add."""

from __future__ import annotations

import asyncio

from sqlalchemy import text
from sqlalchemy.engine import make_url

from outbox.storage.engine import make_async_engine, make_engine


def with_options(dsn: str) -> str:
    url = make_url(dsn).update_query_dict({"options": "-c lock_timeout=1234"})
    return url.render_as_string(hide_password=False)


def test_the_sync_engine_keeps_the_dsns_options(dsn: str) -> None:
    engine = make_engine(with_options(dsn), idle_in_transaction_ms=4321)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SHOW lock_timeout")).scalar() == "1234ms"
            timeout = conn.execute(text("SHOW idle_in_transaction_session_timeout")).scalar()
            assert timeout == "4321ms"
    finally:
        engine.dispose()


def test_the_async_engine_keeps_the_dsns_options(dsn: str) -> None:
    async def settings() -> tuple[str, str]:
        engine = make_async_engine(with_options(dsn), idle_in_transaction_ms=4321)
        try:
            async with engine.connect() as conn:
                lock = await conn.execute(text("SHOW lock_timeout"))
                idle = await conn.execute(text("SHOW idle_in_transaction_session_timeout"))
                return str(lock.scalar()), str(idle.scalar())
        finally:
            await engine.dispose()

    assert asyncio.run(settings()) == ("1234ms", "4321ms")
