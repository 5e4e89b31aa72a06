"""A deliverer's view of the shards on Citus: whose turn it is, which node is down.

On one server none of this is used: every statement reads the whole table. On a
Citus cluster each statement names one shard (``outbox.shards``), so a claim asks
the shards in turn and a shard whose node does not answer rests a while (a batch
of outcomes is written a statement per shard: ``outbox.storage.outcome_writes``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Generator, Iterator, Mapping, Sequence
from math import inf
from typing import Any, TypeVar
from uuid import UUID

import psycopg
import sqlalchemy.exc
from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox.shards import SHARDS, shard_of
from outbox.storage.attempts import ClaimCutShort, Completion
from outbox.storage.direct import prepared
from outbox.storage.engine import distributed, node_unreachable
from outbox.storage.sql import governance as gov_sql

__all__ = [
    "SHARD_REST_SECONDS",
    "SWEEP_SECONDS",
    "ShardTurns",
    "each_shard",
    "effect_shard",
    "next_turn",
    "shard_groups",
    "stored_shard",
]

log = logging.getLogger(__name__)

Row = TypeVar("Row")
Item = TypeVar("Item")

#: How long a shard whose node did not answer is left alone before it is asked again.
SHARD_REST_SECONDS = 5.0
#: Claims woken for named shards may end with them for this long; then one asks
#: every shard (the shards no wake-up named wait at most this much longer).
SWEEP_SECONDS = 1.0


class ShardTurns:
    """Where each partition's next claim starts, which shards rest, the shard of held rows."""

    def __init__(self) -> None:
        #: The shard of each effect claimed and not completed yet.
        self.of: dict[UUID, int] = {}
        #: Of those, the ones with an ordering key (their outcome may free the next).
        self.ordered: set[UUID] = set()
        #: And the run of each (None: of no run), so that no run's outcomes are
        #: written by two statements at once (``outcome_writes.shard_parts``).
        self.runs: dict[UUID, UUID | None] = {}
        self._turn: dict[str, int] = {}
        self._resting: dict[int, float] = {}
        self._hinted: set[int] = set()
        #: When the first claim that ended with the named shards since a full round did.
        self._skipping: dict[str, float] = {}
        #: Partitions whose last claim met its quota: a backlog, no shard asked in vain.
        self._full: set[str] = set()
        #: Per partition, the shards that had no row for it when last asked, and when.
        self._empty: dict[str, dict[int, float]] = {}

    def turn(self, partition: str) -> int:
        """The shard ``partition``'s next claim starts at."""
        return self._turn.get(partition, 0)

    def took(self, partition: str, shard: int) -> None:
        """``partition`` asked ``shard``: the next claim starts after it."""
        self._turn[partition] = (shard + 1) % SHARDS

    def hint(self, payload: str) -> None:
        """A wake-up's payload: a step on Citus names its run's shard (others name none)."""
        if payload.isdigit() and int(payload) < SHARDS:
            self._hinted.add(int(payload))

    def take_hints(self) -> frozenset[int]:
        """The shards named since the last claim (the next claims start afresh)."""
        hints, self._hinted = frozenset(self._hinted), set()
        return hints

    def plan(self, partition: str, hints: frozenset[int]) -> tuple[list[int], int]:
        """The live shards a claim of ``partition`` asks, in order, and after how many it may end.

        Shards a wake-up named come first, and a claim that took rows from them
        ends there: an idle deliverer answers a step with one statement, not one
        per shard. Claims may end so only for ``SWEEP_SECONDS`` after the first
        of them (:meth:`ends_here`); then one asks every shard again
        (:meth:`swept`), so a steady stream of wake-ups never starves the others.
        """
        live = self.live(self.turn(partition))
        first = [s for s in live if s in hints]
        since = self._skipping.get(partition)
        may_end = first and (since is None or time.monotonic() - since < SWEEP_SECONDS)
        return first + [s for s in live if s not in hints], len(first) if may_end else len(live)

    def ends_here(self, partition: str, asked: int, taken: int, may_end: int) -> bool:
        """Whether ``partition``'s claim, with ``asked`` shards asked, ends with the named ones.

        Only right after them: past them, a claim fills its quota as any other.
        """
        if taken and asked == may_end:
            self._skipping.setdefault(partition, time.monotonic())
            return True
        return False

    def walk(self, partition: str, limit: int, hints: frozenset[int]) -> Generator[int, int, None]:
        """The shards a claim of up to ``limit`` rows of ``partition`` asks: send each one's count.

        In the order of :meth:`plan`, until the quota is met, the claim may end
        with the named ones, or each was asked. Sync and async claims both walk it.
        In a backlog (the last claim met its quota) a shard that had no row when
        asked less than ``SWEEP_SECONDS`` ago is passed over unless a wake-up named
        it: a backlog on one shard is not read of the 31 others before every claim,
        and a shard that gets rows unnamed (a retry's delay ends) waits at most that long.
        """
        order, may_end = self.plan(partition, hints)
        empty = self._empty.setdefault(partition, {})
        backlog = partition in self._full
        now = time.monotonic()
        taken = 0
        try:
            for n, shard in enumerate(order):
                if taken >= limit or self.ends_here(partition, n, taken, may_end):
                    return
                if backlog and shard not in hints and now - empty.get(shard, -inf) < SWEEP_SECONDS:
                    continue
                self.took(partition, shard)
                got = yield shard
                if got:
                    empty.pop(shard, None)
                else:
                    empty[shard] = now
                taken += got
            self.swept(partition)
        finally:
            if taken >= limit:
                self._full.add(partition)
            else:
                self._full.discard(partition)

    def asks_first(self, partition: str, shard: int, hints: frozenset[int]) -> bool:
        """Whether a claim asks ``shard`` if it has a ready row before claiming from it.

        The read is far cheaper than a claim (``queue.ready_on_shard``). Not when a
        wake-up named the shard, nor when ``partition``'s last claim met its quota
        (a backlog, where the read would only add to the claim) unless the shard had
        no row when last asked: a backlog on a few shards is not asked of the rest
        with a claim each.
        """
        if shard in hints:
            return False
        return partition not in self._full or shard in self._empty.get(partition, ())

    async def claim(
        self,
        conn: psycopg.AsyncConnection[dict[str, Any]],
        partition: dict[str, Any],
        limit: int,
        hints: frozenset[int],
        claim_on: Callable[[dict[str, Any], int], Awaitable[list[Row]]],
        ready_on: Callable[[dict[str, Any]], Awaitable[bool]] | None = None,
    ) -> list[Row]:
        """One partition's claim of up to ``limit`` rows, a statement per shard (:meth:`walk`).

        ``claim_on(partition with its shard, room)`` claims on one shard. A shard
        whose node does not answer rests, and the claim goes on with the others.
        ``ready_on(partition with its shard)``: whether the shard has a ready row,
        asked first where :meth:`asks_first` says so, and claimed from only if so.
        """
        name, rows = str(partition), list[Row]()
        walk = self.walk(name, limit, hints)
        shard = next(walk, None)
        while shard is not None:
            found = list[Row]()
            on_shard = {**partition, "shard": shard}
            # alone in autocommit, else a savepoint: one shard's failure is its own
            idle = conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            try:
                with self.answering(shard, conn):
                    async with contextlib.nullcontext() if idle else conn.transaction():
                        if (
                            ready_on is None
                            or not self.asks_first(name, shard, hints)
                            or await ready_on(on_shard)
                        ):
                            found = await claim_on(on_shard, limit - len(rows))
            except (psycopg.Error, sqlalchemy.exc.DBAPIError) as exc:
                if idle:  # what the statements before it committed is the caller's
                    raise ClaimCutShort(rows, exc, shard, lost=session_lost(conn)) from exc
                raise
            rows += found
            shard = next_turn(walk, len(found))
        return rows

    def swept(self, partition: str) -> None:
        """``partition``'s claim asked every live shard."""
        self._skipping.pop(partition, None)

    def live(self, start: int = 0) -> list[int]:
        """The shards to ask, from ``start`` on, less those whose node just failed."""
        now = time.monotonic()
        order = [(start + n) % SHARDS for n in range(SHARDS)]
        return [s for s in order if self._resting.get(s, 0.0) <= now]

    def rest(self, shard: int, exc: BaseException | None) -> None:
        """A node did not answer for ``shard``: leave it alone a while, go on with the others.

        A Citus worker that is down stops only its own shards; one failing statement
        must not hold up the claims, outcomes and duties of the shards that answer.
        """
        if self._resting.get(shard, 0.0) <= time.monotonic():
            log.warning(
                "shard %d: its node did not answer (%s); resting it %.0fs",
                shard,
                exc,
                SHARD_REST_SECONDS,
            )
        self._resting[shard] = time.monotonic() + SHARD_REST_SECONDS

    def forget(self, done: Sequence[Completion]) -> None:
        """Outcomes committed: their effects hold no lease of ours any more.

        Only after the commit: until then a heartbeat still extends their leases
        (on their own shard), and a failed commit is retried with them.
        """
        for c in done:
            self.of.pop(c.effect_id, None)
            self.ordered.discard(c.effect_id)
            self.runs.pop(c.effect_id, None)

    @staticmethod
    def kept(cut: ClaimCutShort) -> bool:
        """Whether a claim cut short returns the rows it committed rather than raise.

        It does when there are any: raised, they would be nobody's, their leases
        running out on effects (or runs) that nobody started. Logged as an error
        unless the session was lost (a failure of the shard's own recurs, and the
        claims that find rows elsewhere would otherwise hide it).
        """
        if not cut.rows:
            return False
        log.log(
            logging.WARNING if cut.lost else logging.ERROR,
            "claiming on shard %d failed (%s); the %d rows claimed before it are kept",
            cut.shard,
            cut.error,
            len(cut.rows),
        )
        return True

    @contextlib.contextmanager
    def answering(self, shard: int | None, conn: object) -> Iterator[None]:
        """Around a statement on ``shard`` sent on ``conn``: if its node does not answer, rest it.

        The claim, sweep or heartbeat goes on with the other shards. Put it
        outside the statement's savepoint, so the savepoint is rolled back first.
        ``None`` or a negative shard (one server's rows) lets every error through,
        and so does a ``conn`` that lost its own session: each shard after it
        would fail too, and rested, every node that answers would be left alone
        for ``SHARD_REST_SECONDS`` (and a heartbeat would call every lease lost).
        """
        try:
            yield
        except (psycopg.Error, sqlalchemy.exc.DBAPIError) as exc:
            cause = exc.orig if isinstance(exc, sqlalchemy.exc.DBAPIError) else exc
            if shard is None or shard < 0 or not node_unreachable(cause) or session_lost(conn):
                raise
            self.rest(shard, cause)


def session_lost(conn: object) -> bool:
    """Whether ``conn`` (psycopg's or SQLAlchemy's, sync or async) has lost its own session.

    On Citus a worker that does not answer fails one statement while the
    coordinator's session lives on; a session that ended (terminated, its
    server restarted, the network cut) fails every statement after it, so it
    says nothing of the nodes behind it.
    """
    if isinstance(conn, AsyncConnection):
        conn = conn.sync_connection
    if isinstance(conn, Connection):
        if conn.invalidated or conn.closed:
            return True
        conn = conn.connection.driver_connection
    return conn is None or bool(getattr(conn, "broken", False) or getattr(conn, "closed", False))


def next_turn(walk: Generator[int, int, None], taken: int) -> int | None:
    """The shard :meth:`ShardTurns.walk` asks next, told ``taken`` rows came from the last."""
    try:
        return walk.send(taken)
    except StopIteration:
        return None


async def shard_groups(
    conn: psycopg.AsyncConnection[dict[str, Any]],
    items: Sequence[Item],
    id_of: Callable[[Item], UUID],
    held: Mapping[UUID, int] | None,
    named: Callable[[Item], int | None] = lambda item: None,
) -> dict[int | None, list[Item]]:
    """``items`` by the shard of their effect; ``held`` None (one server): ``{None: items}``.

    An item's shard is the one it names (``named``), else the one of a row this
    deliverer holds (``held``), else read from the database.
    """
    if held is None:
        return {None: list(items)}
    groups: dict[int | None, list[Item]] = {}
    for item in items:
        shard = named(item)
        if shard is None:
            shard = held.get(id_of(item))
        if shard is None:
            shard = await effect_shard(conn, id_of(item))
        groups.setdefault(shard, []).append(item)
    return groups


def each_shard(
    conn: Connection, statement: Callable[..., Any], max_rows: int, after: Any = None
) -> list[Any]:
    """Up to ``max_rows`` rows of a sweep's ``statement(sharded=...)``, on ``conn``.

    On Citus a shard at a time: it locks rows only in a statement on one shard,
    and a sweep must not send every shard a statement each round. Each in a
    savepoint (two more round trips a shard, on Citus only), so a node that is
    down leaves the other shards swept. ``after`` (a row with ``shard``,
    ``updated_at`` and ``id``, for a statement that takes ``after_at`` and
    ``after_id``): go on from it, in that order.
    """
    mark = {} if after is None else {"after_at": after.updated_at, "after_id": after.id}
    if not distributed(conn):
        return list(conn.execute(statement(), {"max_rows": max_rows, **mark}).all())
    rows: list[Any] = []
    for shard in range(0 if after is None else after.shard, SHARDS):
        bound = {"max_rows": max_rows - len(rows), "on_shard": shard}
        if after is not None and shard == after.shard:
            bound.update(mark)
        try:  # in a savepoint: a node that does not answer stops only its own shards
            with conn.begin_nested():
                rows += conn.execute(statement(sharded=True), bound).all()
        except sqlalchemy.exc.DBAPIError as exc:
            if not node_unreachable(exc.orig) or session_lost(conn):
                raise
            log.warning("shard %d: its node did not answer (%s); swept without it", shard, exc)
        if len(rows) >= max_rows:
            break
    return rows


def stored_shard(conn: Connection, id: UUID) -> int | None:
    """The shard effect ``id`` is stored on; None when there is no such effect.

    Asked first of the shard its id names (on Citus a read of that shard alone):
    every effect written since ids name their shard lives there. An older one
    (or one whose id a caller chose) is then looked for on every shard.
    """
    params = {"effect_id": id, "effect_shard": shard_of(id)}
    for named in (True, False):
        found = conn.execute(gov_sql.effect_shard(named=named), params).scalar()
        if found is not None:
            return int(found)
    return None


async def effect_shard(conn: psycopg.AsyncConnection[dict[str, Any]], id: UUID) -> int:
    """The shard of effect ``id`` as stored, as :func:`stored_shard` finds it (none: its id's)."""
    params = {"effect_id": id, "effect_shard": shard_of(id)}
    for named in (True, False):
        statement = prepared(gov_sql.effect_shard(named=named))
        cur = await statement.execute(conn, params, prepare=False)
        if (row := await cur.fetchone()) is not None:
            return int(row["shard"])
    return shard_of(id)
