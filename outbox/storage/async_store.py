"""The database side of delivery (async): claim, heartbeat, complete, reconcile, report.

The daemons and the reconciler call these methods; they never see SQL. Each
method is one short transaction, so no transaction is ever held across a
call to the outside world. Claimed rows come back as :class:`ClaimedEffect`
values, and every driver error as :class:`~outbox.errors.DatabaseError`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar
from uuid import UUID

import psycopg
from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.blobs import reference_hash
from outbox.errors import ConfigurationError
from outbox.shards import SHARDS
from outbox.storage import blob_store
from outbox.storage.attempts import Batched, ClaimedEffect, Completion, DutyAsk, DutyFindings
from outbox.storage.claims import ClaimMode
from outbox.storage.direct import DirectConnections, prepared
from outbox.storage.engine import libpq_dsn, translate_errors
from outbox.storage.notify import listen
from outbox.storage.owner_lock import OwnerLock
from outbox.storage.run_tx import RunTx
from outbox.storage.shard_turns import ShardTurns, complete_on, effect_shard
from outbox.storage.sql import dispatch as dispatch_sql
from outbox.storage.sql import duties, leases, maintenance, notes, owners, queue
from outbox.storage.sql import effects as effect_sql
from outbox.storage.sql import governance as gov_sql
from outbox.storage.sql.common import EFFECTS_CHANNEL
from outbox.storage.store import read_state_counts

__all__ = ["AsyncStore", "Batched", "ClaimedEffect", "Completion", "DutyAsk", "DutyFindings"]

T = TypeVar("T")
log = logging.getLogger(__name__)
#: Told of each transaction on the delivery path: what it did (``"claim"``,
#: ``"complete"``, ``"complete+claim"``), how long it took (s), rows per part.
Observer = Callable[[str, float, Mapping[str, int]], None]


def _claimed(rows: Any) -> list[ClaimedEffect]:
    return [ClaimedEffect.from_row(row) for row in rows.mappings()]


class AsyncStore:
    """Delivery statements: claims and outcomes on connections of their own, the rest on ``engine``.

    ``idle_in_transaction_ms`` and ``application_name`` are the session settings
    of the claim/complete connections (:mod:`outbox.storage.direct`); the
    engine's own come from whoever made it.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        application_name: str = "outbox-deliver",
        idle_in_transaction_ms: int = 60_000,
    ) -> None:
        self.engine = engine
        self._claims = ClaimMode()
        self._idle_ms = idle_in_transaction_ms
        self._direct = DirectConnections(
            libpq_dsn(engine.url),
            options=self._options(generic=True),
            application_name=application_name,
        )
        #: Told of every claim/complete transaction (a benchmark's probe); None: nobody.
        self.observer: Observer | None = None
        #: On Citus (``outbox.storage.citus``): statements name one shard each.
        self._sharded: bool | None = None
        #: On Citus: which shard to ask next, which to leave alone, whose rows we hold.
        self._shards = ShardTurns()

    def _options(self, *, generic: bool) -> str:
        plans = "-c plan_cache_mode=force_generic_plan " if generic else ""
        return f"{plans}-c idle_in_transaction_session_timeout={self._idle_ms}"

    @property
    def dsn(self) -> str:
        """The database, for connections of its own (LISTEN)."""
        return self.engine.url.render_as_string(hide_password=False)

    def listen_for_effects(self, wake: asyncio.Event) -> Coroutine[Any, Any, None]:
        """LISTEN for committed intents on a connection of its own (run it as a task)."""
        return listen(self.dsn, EFFECTS_CHANNEL, wake, on_payload=self._shards.hint)

    def owner_lock(self, owner: str) -> OwnerLock:
        """The session lock of ``owner``, on a connection of its own."""
        return OwnerLock(self.dsn, owner)

    async def sharded(self, conn: psycopg.AsyncConnection[dict[str, Any]]) -> bool:
        """Whether the database is distributed (Citus): asked once."""
        if self._sharded is None:
            cur = await conn.execute("SELECT current_setting('outbox.distributed', true) AS d")
            row = await cur.fetchone()
            self._sharded = row is not None and row["d"] == "on"
            if self._sharded:
                # Citus routes a statement by the shard it names: a generic plan,
                # planned once for any value, cannot be routed
                await conn.execute("SET plan_cache_mode = auto")
                self._direct.configure(options=self._options(generic=False))
        return self._sharded

    async def _claim_on(
        self,
        conn: psycopg.AsyncConnection[dict[str, Any]],
        spec: queue.QueueSpec,
        quotas: Sequence[tuple[dict[str, str], int]],
        owner: str,
        lease_seconds: float,
        rates: Mapping[str, queue.Rate] | None,
    ) -> list[ClaimedEffect]:
        """The claim of each partition's quota on ``conn`` (the caller owns the transaction).

        On Citus a claim reads one shard: a partition's claim asks them in the order
        of ``ShardTurns.plan`` (named by a wake-up first, then taking turns) until
        its quota is met, it may end with the named ones, or each was asked.
        """
        rows: list[ClaimedEffect] = []
        sharded = await self.sharded(conn)
        if sharded:
            spec = dataclasses.replace(spec, sharded=True)
        hints = self._shards.take_hints() if sharded else frozenset()
        for partition, limit in quotas:
            rate = None if rates is None else rates.get(partition.get("kind", ""))
            if rate is not None and sharded:
                raise ConfigurationError(
                    f"kind {partition.get('kind')!r} declares a rate: a distributed database "
                    "does not enforce declared rates yet (docs/howto/citus.md)"
                )
            claim_on = functools.partial(
                self._claim_partition,
                conn,
                spec,
                owner=owner,
                lease_seconds=lease_seconds,
                rate=rate,
            )
            if sharded:
                rows += await self._shards.claim(conn, partition, limit, hints, claim_on)
            else:
                rows += await claim_on(partition, limit)
        self._shards.of.update((r.id, r.shard) for r in rows if r.shard is not None)
        return rows

    async def _claim_partition(
        self,
        conn: psycopg.AsyncConnection[dict[str, Any]],
        spec: queue.QueueSpec,
        partition: dict[str, Any],
        limit: int,
        *,
        owner: str,
        lease_seconds: float,
        rate: queue.Rate | None,
    ) -> list[ClaimedEffect]:
        params = queue.claim_params(
            partition, limit=limit, owner=owner, lease_seconds=lease_seconds, rate=rate
        )
        rows: list[ClaimedEffect] = []
        again = True
        while again:  # at most twice: plain, then lanes (see ClaimMode)
            statement, lanes = self._claims.statement(spec, partition, rated=rate is not None)
            claim = prepared(statement)
            cur = await conn.execute(claim.sql, claim.params(params), prepare=True)
            found, again = self._claims.claimed(spec, partition, lanes, await cur.fetchall())
            rows += [ClaimedEffect.from_row(row) for row in found]
        return rows

    def _observe(self, what: str, began: float, **rows: int) -> None:
        if self.observer is not None:
            self.observer(what, time.perf_counter() - began, rows)

    async def claim_many(
        self,
        spec: queue.QueueSpec,
        quotas: Sequence[tuple[dict[str, str], int]],
        *,
        owner: str,
        lease_seconds: float,
        rates: Mapping[str, queue.Rate] | None = None,
    ) -> list[ClaimedEffect]:
        """Claim from each partition, all in one transaction (claimed rows are all returned).

        ``rates`` maps a kind to its declared rate: that kind's claims take no
        more than the rate allows, shared with every process through PostgreSQL.
        """
        began = time.perf_counter()
        with translate_errors("claiming effects"):
            async with self._direct.connection() as conn:
                if len(quotas) == 1:
                    # One statement claims and records the attempt's start, so alone it
                    # needs no explicit transaction: autocommit saves the BEGIN and COMMIT
                    # round trips on the commit -> handler start path. With several, a
                    # failure part-way must not leave claims that were never returned.
                    rows = await self._claim_on(conn, spec, quotas, owner, lease_seconds, rates)
                else:
                    async with conn.transaction():
                        rows = await self._claim_on(conn, spec, quotas, owner, lease_seconds, rates)
        self._observe("claim", began, claim=len(rows))
        return rows

    async def with_payload(self, effect: ClaimedEffect) -> ClaimedEffect:
        """The attempt with its payload read back if it was stored by reference.

        Claims never read blobs; a deliverer reads one just before calling its
        sink, so it holds one large payload per call in flight, not per claim.
        """
        sha = reference_hash(effect.payload)
        if sha is None:
            return effect
        with translate_errors("reading a payload"):
            async with self.engine.connect() as conn:
                values = await conn.run_sync(blob_store.fetch, [sha])
        return dataclasses.replace(effect, payload=values[sha])

    async def extend(
        self,
        spec: queue.QueueSpec,
        held: Sequence[tuple[UUID, int]],
        *,
        owner: str,
        lease_seconds: float,
    ) -> set[UUID]:
        """Heartbeat; returns the ids whose lease is still ours."""
        if not held:
            return set()
        if not await self._is_sharded():
            params = leases.extend_params(held, owner=owner, lease_seconds=lease_seconds)
            with translate_errors("extending leases"):
                async with self.engine.begin() as conn:
                    result = await conn.execute(leases.extend_leases(spec), params)
                    return {row[0] for row in result}
        # on Citus a statement per shard: a node that is down loses only its own leases
        kept: set[UUID] = set()
        sharded = dataclasses.replace(spec, sharded=True)
        with translate_errors("extending leases"):
            async with self.engine.begin() as conn:
                by_shard: dict[int, list[tuple[UUID, int]]] = {}
                for id, attempt in held:
                    # a shard is forgotten once the effect's outcome committed: no lease left
                    if (shard := self._shards.of.get(id)) is not None:
                        by_shard.setdefault(shard, []).append((id, attempt))
                for shard, part in by_shard.items():
                    params = leases.extend_params(part, owner=owner, lease_seconds=lease_seconds)
                    statement = leases.extend_leases(sharded)
                    with self._shards.answering(shard):
                        async with conn.begin_nested():
                            result = await conn.execute(statement, {**params, "part_shard": shard})
                            kept |= {row[0] for row in result}
        return kept

    async def complete(self, owner: str, done: Sequence[Completion]) -> list[tuple[UUID, str]]:
        """Record a batch of attempt outcomes (fenced); returns (effect id, logged outcome)."""
        began = time.perf_counter()
        with translate_errors("recording outcomes"):
            async with self._direct.connection() as conn, conn.transaction():
                logged = await complete_on(conn, owner, done, await self._held_shards(conn))
        self._shards.forget(done)
        self._observe("complete", began, complete=len(logged))
        return logged

    async def complete_and_claim(
        self,
        owner: str,
        done: Sequence[Completion],
        spec: queue.QueueSpec,
        quotas: Sequence[tuple[dict[str, str], int]],
        *,
        lease_seconds: float,
        rates: Mapping[str, queue.Rate] | None = None,
        extend: Sequence[tuple[UUID, int]] = (),
        probe: DutyAsk | None = None,
    ) -> Batched:
        """:meth:`complete` and :meth:`claim_many` in one transaction: one commit per batch.

        The claim runs after the completion, so it sees what the completion
        freed (the next effect of an ordering key, say). Either both commit or
        neither does. The background duties of a busy daemon ride along, so they
        cost no transaction of their own: ``extend`` pushes out those held
        leases (a heartbeat, fenced like :meth:`extend`), ``probe`` asks which
        duties have work (:func:`~outbox.storage.sql.duties.duty_probe`).
        """
        kept: set[UUID] = set()
        findings = None
        began = time.perf_counter()
        with translate_errors("recording outcomes and claiming effects"):
            async with self._direct.connection() as conn, conn.transaction():
                logged = await complete_on(conn, owner, done, await self._held_shards(conn))
                rows = await self._claim_on(conn, spec, quotas, owner, lease_seconds, rates)
                if extend:
                    params = leases.extend_params(extend, owner=owner, lease_seconds=lease_seconds)
                    renew = prepared(leases.extend_leases(spec))
                    cur = await conn.execute(renew.sql, renew.params(params), prepare=True)
                    kept = {row["id"] for row in await cur.fetchall()}
                if probe is not None:
                    ask = prepared(duties.duty_probe())
                    cur = await conn.execute(ask.sql, ask.params(probe.params()), prepare=True)
                    findings = DutyFindings.from_row(list((await cur.fetchone() or {}).values()))
        self._shards.forget(done)
        self._observe("complete+claim", began, complete=len(logged), claim=len(rows))
        return Batched(logged, rows, kept, findings)

    async def probe_duties(self, ask: DutyAsk) -> DutyFindings:
        """Which background duties have work (one read-only statement, autocommit)."""
        with translate_errors("probing for background duties"):
            async with self.engine.connect() as conn:
                conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
                found = await conn.execute(duties.duty_probe(), ask.params())
                return DutyFindings.from_row(found.one())

    async def expired(
        self, max_rows: int, *, redispatch_as: str | None = None
    ) -> tuple[int, list[ClaimedEffect]]:
        """In-flight effects whose lease ran out; returns (re-dispatched, expired).

        With ``redispatch_as`` (a worker name), dispatched effects not delivered
        within their TTL go back to ``pending`` first, in the same transaction
        (one commit per reconcile round, not two).
        """
        sharded = await self._is_sharded()
        redispatched, found = 0, list[ClaimedEffect]()
        with translate_errors("finding expired attempts"):
            async with self.engine.begin() as conn:
                # on Citus a statement per shard, each routed to the node holding it
                for shard in self._shards.live() if sharded else [None]:
                    on = {} if shard is None else {"on_shard": shard}
                    with self._shards.answering(shard):
                        async with conn.begin_nested():  # a savepoint per shard
                            if redispatch_as is not None:
                                params = {"worker": redispatch_as, "max_rows": max_rows, **on}
                                result = await conn.execute(
                                    dispatch_sql.redispatch_expired(sharded), params
                                )
                                redispatched += len(result.all())
                            want = {"max_rows": max_rows - len(found), **on}
                            if want["max_rows"] > 0:
                                rows = await conn.execute(effect_sql.expired_effects(sharded), want)
                                found += _claimed(rows)
        return redispatched, found

    async def _held_shards(self, conn: psycopg.AsyncConnection[Any]) -> dict[UUID, int] | None:
        return self._shards.of if await self.sharded(conn) else None  # None: one server

    async def _is_sharded(self) -> bool:
        if self._sharded is None:
            async with self._direct.connection() as conn:
                await self.sharded(conn)
        return bool(self._sharded)

    async def _shard_params(self, effect_id: UUID, shard: int | None) -> dict[str, Any]:
        """On Citus: the shard and the database's time a sharded statement names."""
        if not await self._is_sharded():
            return {}
        async with self._direct.connection() as conn:
            if shard is None:
                shard = await effect_shard(conn, effect_id)
            cur = await conn.execute("SELECT now() AS now")
            return {"on_shard": shard, "now": (await cur.fetchone() or {})["now"]}

    async def unknown_of(self, kinds: Sequence[str], max_rows: int) -> list[ClaimedEffect]:
        """``unknown`` effects of these kinds (their deliverer can ask the sink), oldest first."""
        if not kinds:
            return []
        params = {"kinds": list(kinds), "max_rows": max_rows}
        with translate_errors("finding unknown effects"):
            async with self.engine.connect() as conn:
                return _claimed(await conn.execute(effect_sql.unknown_of_kinds(), params))

    async def expire(
        self,
        effect_id: UUID,
        attempt: int,
        *,
        new_status: str,
        note: str,
        resolution: str,
        worker: str,
        shard: int | None = None,
    ) -> bool:
        """Resolve one expired attempt (compare-and-set); False when someone else did."""
        on = await self._shard_params(effect_id, shard)
        params = {
            **on,
            "effect_id": effect_id,
            "expected_attempt": attempt,
            "new_status": new_status,
            "note": note,
            "resolution": resolution,
            "worker": worker,
        }
        with translate_errors("expiring an attempt"):
            async with self.engine.begin() as conn:
                result = await conn.execute(effect_sql.expire_effect(bool(on)), params)
                return result.first() is not None

    async def take_over(
        self,
        effect_id: UUID,
        attempt: int,
        *,
        owner: str,
        lease_seconds: float,
        shard: int | None = None,
    ) -> bool:
        """Lease an expired attempt to ``owner`` (compare-and-set)."""
        on = await self._shard_params(effect_id, shard)
        on.pop("now", None)
        params = {
            **on,
            "effect_id": effect_id,
            "expected_attempt": attempt,
            "owner": owner,
            "lease_seconds": lease_seconds,
        }
        with translate_errors("taking over an attempt"):
            async with self.engine.begin() as conn:
                result = await conn.execute(effect_sql.take_over_effect(bool(on)), params)
                return result.first() is not None

    async def mark_unknown_kinds(
        self, known: Sequence[str], *, grace_seconds: float, note_prefix: str, max_rows: int = 1000
    ) -> int:
        """Note on pending effects of kinds no deliverer here knows; returns how many."""
        params = {"known": list(known), "grace_seconds": grace_seconds, "note_prefix": note_prefix}
        with translate_errors("noting unknown kinds"):
            return await self._note_each_shard(notes.mark_unknown_kinds, params, max_rows)

    async def recorded_result(self, effect_id: UUID) -> tuple[bool, Any]:
        """The result a real run recorded for the intent a dry-run effect stands for."""
        with translate_errors("looking up a recorded result"):
            async with self.engine.connect() as conn:
                row = (
                    await conn.execute(gov_sql.recorded_result(), {"effect_id": effect_id})
                ).first()
        return (False, None) if row is None else (True, row[0])

    async def note_attempt(
        self, effect_id: UUID, attempt: int, *, owner: str, note: Mapping[str, Any]
    ) -> bool:
        """Store a deliverer's note about the current attempt (fenced); False if no longer ours."""
        params = {
            "effect_id": effect_id,
            "expected_attempt": attempt,
            "owner": owner,
            "note": json.dumps({**note, "attempt": attempt}),
        }
        with translate_errors("noting an attempt"):
            async with self.engine.begin() as conn:
                result = await conn.execute(gov_sql.note_attempt(), params)
                return result.first() is not None

    async def note_blocked_by_order(self, *, grace_seconds: float, max_rows: int = 1000) -> int:
        """Note on effects held back by their ordering key what holds them; returns how many.

        Also clears such notes whose block is gone. Not for the claim path: a
        maintenance round calls it.
        """
        params = {"grace_seconds": grace_seconds}
        with translate_errors("noting effects held back by their ordering key"):
            return await self._note_each_shard(notes.note_blocked_by_order, params, max_rows)

    async def _note_each_shard(
        self, statement: Callable[..., Any], params: dict[str, Any], max_rows: int
    ) -> int:
        """Effects a notes ``statement`` noted, up to ``max_rows``: on Citus a shard at a time."""
        noted = 0
        shards: Sequence[int | None] = range(SHARDS) if await self._is_sharded() else [None]
        async with self.engine.connect() as conn:
            for shard in shards:
                on = {} if shard is None else {"on_shard": shard}
                bound = {**params, "max_rows": max_rows - noted, **on}
                async with conn.begin():
                    result = await conn.execute(statement(sharded=shard is not None), bound)
                    noted += len(result.all())
                if noted >= max_rows:
                    break
        return noted

    # -- owners that are gone (outbox.storage.sql.owners) ---------------------------

    async def gone_owners(
        self, kinds: Sequence[str], *, restart_grace: float
    ) -> list[tuple[str, bool]]:
        """Registered owners whose lock is free: (owner, holds an attempt of ``kinds``)."""
        params = {"kinds": list(kinds), "restart_grace": restart_grace}
        with translate_errors("looking for deliverers that are gone"):
            async with self.engine.connect() as conn:
                conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
                result = await conn.execute(owners.gone_owners(), params)
                return [(row[0], bool(row[1])) for row in result]

    async def expire_gone_owner(
        self,
        owner: str,
        limits: Mapping[str, int],
        *,
        note: str,
        worker: str,
        restart_grace: float,
    ) -> list[UUID]:
        """Put a gone owner's attempts of the kinds in ``limits`` back to pending (logged)."""
        params = {
            "owner": owner,
            "limits": json.dumps([{"kind": k, "max_attempts": n} for k, n in limits.items()]),
            "note": note,
            "worker": worker,
            "restart_grace": restart_grace,
        }
        with translate_errors("putting back the attempts of a deliverer that is gone"):
            async with self.engine.begin() as conn:
                result = await conn.execute(owners.expire_gone_owner(), params)
                return [row[0] for row in result]

    async def forget_gone_owners(self, candidates: Sequence[str], *, restart_grace: float) -> int:
        """Unregister gone owners that hold nothing (checked again); returns how many."""
        params = {"owners": list(candidates), "restart_grace": restart_grace}
        with translate_errors("forgetting deliverers that are gone"):
            async with self.engine.begin() as conn:
                return len((await conn.execute(owners.forget_gone_owners(), params)).all())

    # -- stream mode -----------------------------------------------------------------

    async def mark_dispatched(
        self, owner: str, held: Sequence[tuple[UUID, int]], *, dispatch_ttl: float
    ) -> set[UUID]:
        """The relay published these attempts; returns the ids it still held (fenced)."""
        if not held:
            return set()
        params = leases.extend_params(held, owner=owner, lease_seconds=0)
        params["dispatch_ttl"] = dispatch_ttl
        mark = prepared(dispatch_sql.mark_dispatched())
        with translate_errors("marking effects dispatched"):
            async with self._direct.connection() as conn, conn.transaction():
                cur = await conn.execute(mark.sql, mark.params(params), prepare=True)
                return {row["effect_id"] for row in await cur.fetchall()}

    async def claim_dispatched(
        self, ids: Sequence[UUID], *, owner: str, lease_seconds: float
    ) -> list[ClaimedEffect]:
        """Claim the effects named by Kafka records that are still ``dispatched``."""
        if not ids:
            return []
        params = {"ids": list(ids), "owner": owner, "lease_seconds": lease_seconds}
        began = time.perf_counter()
        claim = prepared(dispatch_sql.claim_dispatched())
        with translate_errors("claiming dispatched effects"):
            async with self._direct.connection() as conn:
                cur = await conn.execute(claim.sql, claim.params(params), prepare=True)
                rows = [ClaimedEffect.from_row(row) for row in await cur.fetchall()]
        self._observe("claim", began, claim=len(rows))
        return rows

    # -- the rest ----------------------------------------------------------------------

    async def run_sync(self, fn: Callable[[RunTx], T], what: str = "a run transaction") -> T:
        """Run sync domain logic (``runs.stopping``, say) on a :class:`RunTx` in one transaction."""

        def call(conn: Connection) -> T:
            return fn(RunTx(conn))

        with translate_errors(what):
            async with self.engine.begin() as conn:
                return await conn.run_sync(call)

    async def state_counts(self) -> maintenance.StateCounts:
        """Runs by status, open effects by (status, kind), oldest pending age."""
        with translate_errors("counting states"):
            async with self.engine.connect() as conn:
                return await conn.run_sync(read_state_counts)

    async def dispose(self) -> None:
        """Close every connection."""
        await self._direct.close()
        await self.engine.dispose()
