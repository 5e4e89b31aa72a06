"""The delivery path's statements on psycopg connections of their own: prepared, generic plans.

Claims and outcome writes are the statements every effect goes through, and the
claim is on the commit → handler start path. Measured on the embedded server
(docs/discussions/performance.md, "Where the milliseconds go"):

- SQLAlchemy's async layer costs about 0.3 ms of client time per statement (a
  greenlet hop, its cursor adapter, result set-up) against 0.09 ms for the same
  ``SELECT 1`` on a psycopg connection;
- PostgreSQL planned the prepared claim afresh on every execution (its custom
  plans looked cheaper than the generic one), 0.5 ms of a 1.2 ms claim; with
  ``plan_cache_mode = force_generic_plan`` it is planned once per connection.

So the store runs these statements here, compiled once from the same Core
builders (:class:`Prepared`), on connections given that setting (not on Citus,
see :data:`GENERIC_PLANS_OFF_CITUS`) and kept for the store's life
(:class:`DirectConnections`). Every other statement stays
on the engine, where PostgreSQL picks plans per execution as before. The claim
statements are written for generic plans: statuses and limits that decide an
index are literals, the batch is claimed by one array of ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from functools import cache
from typing import Any

import psycopg
from psycopg.rows import dict_row
from sqlalchemy.dialects.postgresql.psycopg import PGDialectAsync_psycopg
from sqlalchemy.engine.interfaces import Dialect

from outbox.storage.dsn import ISO_DATES, iso_dates_needed

__all__ = ["GENERIC_PLANS_OFF_CITUS", "DirectConnections", "Prepared", "prepared"]

#: Each delivery connection's setup: generic plans, unless the database is
#: distributed. Citus routes a statement by the shard value it names, which a
#: generic plan lacks ("could not create distributed plan"); ``outbox migrate
#: --distribute`` sets custom plans for such a database. Decided on the
#: connection itself, so none opened while the store was still asking can keep
#: generic plans on a cluster.
GENERIC_PLANS_OFF_CITUS = (
    "SELECT set_config('plan_cache_mode', 'force_generic_plan', false)"
    " WHERE current_setting('outbox.distributed', true) IS DISTINCT FROM 'on'"
)

_DIALECT: Dialect = PGDialectAsync_psycopg()


#: psycopg's named placeholders and its escaped percent sign, as SQLAlchemy renders them.
_PLACEHOLDER = re.compile(r"%(?:%|\((\w+)\)s)")


class Prepared:
    """A Core statement compiled once for psycopg: its SQL and how to fill its parameters.

    :meth:`execute` sends it in PostgreSQL's own ``$n`` form, converted here once.
    psycopg converts ``%(name)s`` placeholders on every execution and caches the
    result only for a statement under 4 kB with at most 50 parameters; the sharded
    completion (4.1 kB) and the attempt-log insert of a batch (1,100 parameters)
    are neither, and converting them was a fifth of a Citus deliverer's CPU.
    """

    def __init__(self, statement: Any) -> None:
        compiled = statement.compile(dialect=_DIALECT)
        self._compiled = compiled
        # What SQLAlchemy would do to a value before sending it (an ARRAY's items, say).
        self._processors = {
            name: fn for name, fn in compiled._bind_processors.items() if fn is not None
        }
        self.sql: str = str(compiled)
        self._numbers: dict[str, int] = {}  # a name used twice is one $n
        self._native = _PLACEHOLDER.sub(self._number, self.sql)
        self._order = list(self._numbers)

    def _number(self, match: re.Match[str]) -> str:
        name = match.group(1)
        if name is None:
            return "%"
        return f"${self._numbers.setdefault(name, len(self._numbers) + 1)}"

    def params(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """Every parameter of the statement: ``values`` and the literals it binds itself."""
        params: dict[str, Any] = self._compiled.construct_params(dict(values))
        for name, process in self._processors.items():
            if name in params:
                params[name] = process(params[name])
        return params

    async def execute(
        self,
        conn: psycopg.AsyncConnection[dict[str, Any]],
        values: Mapping[str, Any],
        *,
        prepare: bool | None = None,
    ) -> psycopg.AsyncRawCursor[dict[str, Any]]:
        """Run the statement on ``conn`` with ``values``; its rows as dicts on the cursor.

        ``prepare``: as psycopg's (True: a server-side prepared statement at once).
        """
        params = self.params(values)
        cursor = psycopg.AsyncRawCursor(conn, row_factory=dict_row)
        return await cursor.execute(self._native, [params[n] for n in self._order], prepare=prepare)


@cache
def prepared(statement: Any) -> Prepared:
    """:class:`Prepared` for a statement (builders are cached, so this is once per statement)."""
    return Prepared(statement)


class DirectConnections:
    """Up to ``size`` psycopg connections (autocommit), each opened with ``params``.

    ``setup``, if given, is run on each new connection before it is first used.

    A connection is taken by :meth:`connection` and given back after; one that
    failed at the connection level, or whose statement was cancelled half-way
    (its state is then unknown), is closed instead, and a new one opened when
    needed. Nothing is opened before the first use. :meth:`close` closes them
    all, as an engine's ``dispose`` does: the set may be used again after.
    """

    def __init__(
        self,
        conninfo: str,
        *,
        size: int = 4,
        setup: str | None = None,
        params: Mapping[str, Any] | None = None,
    ) -> None:
        self._conninfo = conninfo
        self._params = dict(params or {})
        #: Run once on each new connection, before its first use.
        self._setup = setup
        self._idle: list[psycopg.AsyncConnection[dict[str, Any]]] = []
        self._slots = asyncio.Semaphore(size)
        #: Connections opened before the last close are not given back.
        self._generation = 0
        self._born: dict[int, int] = {}

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[psycopg.AsyncConnection[dict[str, Any]]]:
        """A connection of the set for one transaction (or one autocommit statement)."""
        async with self._slots:
            conn = self._idle.pop() if self._idle else None
            if conn is None or conn.closed:
                born = self._generation  # a close() while connecting makes this one stale
                conn = await psycopg.AsyncConnection.connect(
                    self._conninfo, autocommit=True, row_factory=dict_row, **self._params
                )
                self._born[id(conn)] = born
                setup = [*([ISO_DATES] if iso_dates_needed(conn.info) else []), self._setup]
                for statement in filter(None, setup):
                    try:
                        await conn.execute(statement)
                    except BaseException:
                        await self._discard(conn)
                        raise
            try:
                yield conn
            except BaseException as exc:
                if isinstance(exc, Exception) and not conn.broken:
                    await self._give_back(conn)  # a statement's error: the connection is fine
                else:  # cancelled (or worse) mid-statement: its state is unknown
                    await self._discard(conn)
                raise
            await self._give_back(conn)

    @asynccontextmanager
    async def spare(self) -> AsyncIterator[psycopg.AsyncConnection[dict[str, Any]] | None]:
        """A connection of the set if one is free now, else None: never waits for one.

        For work its caller can also do in turn on the connection it holds: a
        second connection taken while holding a first must not wait for one,
        or two such callers could each hold what the other waits for.
        """
        if self._slots.locked():
            yield None
            return
        async with self.connection() as conn:
            yield conn

    async def _give_back(self, conn: psycopg.AsyncConnection[dict[str, Any]]) -> None:
        idle = conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        if conn.closed or not idle or self._born.get(id(conn)) != self._generation:
            await self._discard(conn)  # left in a transaction, or opened before a close
            return
        self._idle.append(conn)

    async def _discard(self, conn: psycopg.AsyncConnection[dict[str, Any]]) -> None:
        self._born.pop(id(conn), None)
        with contextlib.suppress(Exception):  # a broken connection: nothing more to do
            await conn.close()

    async def close(self) -> None:
        """Close every connection (those in use when they are given back)."""
        self._generation += 1
        idle, self._idle = self._idle, []
        for conn in idle:
            await self._discard(conn)
