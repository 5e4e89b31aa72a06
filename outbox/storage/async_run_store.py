"""The async twin of :class:`~outbox.storage.store.Store`: the same methods, awaited.

psycopg keeps its sync and async classes in step by sharing everything but
the waiting. Here SQLAlchemy's asyncio extension does the same job: an
``AsyncEngine`` drives a sync ``Engine`` (``sync_engine``) inside a greenlet,
so every :class:`Store` method, with its statements, row mapping and error
translation, runs unchanged on the async driver through :meth:`call`. Nothing
in this module builds a statement. Only the transaction that hands the
caller an ``AsyncConnection`` (:meth:`begin`) is written twice.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import ParamSpec, TypeVar

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.util import greenlet_spawn

from outbox.storage.engine import translate_errors
from outbox.storage.run_tx import RunTx
from outbox.storage.store import Store

__all__ = ["AsyncRunStore"]

P = ParamSpec("P")
T = TypeVar("T")


class AsyncRunStore:
    """Awaits :class:`Store`'s methods on an async engine (one implementation of the SQL)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        #: The sync store over ``engine.sync_engine``: only usable inside :meth:`call`
        #: or ``AsyncConnection.run_sync`` (a greenlet that awaits the driver).
        self.sync = Store(engine.sync_engine)

    @property
    def dsn(self) -> str:
        """The database, for connections of its own (LISTEN)."""
        return self.engine.url.render_as_string(hide_password=False)

    async def call(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run a sync :class:`Store` method (or logic over one) on the async driver."""
        return await greenlet_spawn(functools.partial(fn, *args, **kwargs))

    async def run_tx(self, fn: Callable[[RunTx], T]) -> T:
        """Run sync domain logic (waits, signals, stopping) on a ``RunTx``, in one transaction."""

        def body() -> T:
            with self.sync.run_tx() as tx:
                return fn(tx)

        return await greenlet_spawn(body)

    @asynccontextmanager
    async def begin(
        self, connection: AsyncConnection | None = None
    ) -> AsyncIterator[AsyncConnection]:
        """A transaction: ours, or a savepoint in the caller's open one (twin of Store.begin)."""
        with translate_errors("transaction"):
            if connection is None:
                async with self.engine.begin() as conn:
                    yield conn
            else:
                async with connection.begin_nested():
                    yield connection

    async def dispose(self) -> None:
        """Close every connection."""
        await self.engine.dispose()
