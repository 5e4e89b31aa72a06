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
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar
from uuid import UUID

import psycopg
from sqlalchemy import Connection
from sqlalchemy.exc import SQLAlchemyError

from outbox.blobs import reference_hash
from outbox.storage import blob_store
from outbox.storage.attempts import (
    Batched,
    ClaimCutShort,
    ClaimedEffect,
    Completion,
    DutyAsk,
    DutyFindings,
    OutcomesLeft,
)
from outbox.storage.delivery_duties import Observer
from outbox.storage.direct import prepared
from outbox.storage.effect_claims import EffectClaims
from outbox.storage.engine import translate_errors
from outbox.storage.notify import listen
from outbox.storage.outcome_writes import complete_on, wake_parked
from outbox.storage.owner_lock import OwnerLock
from outbox.storage.run_tx import RunTx
from outbox.storage.shard_turns import session_lost, shard_groups
from outbox.storage.sql import dispatch as dispatch_sql
from outbox.storage.sql import duties, leases, maintenance, queue, stopping
from outbox.storage.sql.common import EFFECTS_CHANNEL
from outbox.storage.store import read_state_counts

__all__ = [
    "AsyncStore",
    "Batched",
    "ClaimedEffect",
    "Completion",
    "DutyAsk",
    "DutyFindings",
    "Observer",
]

T = TypeVar("T")
log = logging.getLogger(__name__)


class AsyncStore(EffectClaims):
    """The delivery store: the daemons and the reconciler call it, and never see SQL.

    The hot path (claim, heartbeat, complete) and stream mode are here; the
    connections and the background duties' statements in
    :mod:`outbox.storage.delivery_duties`.
    """

    def listen_for_effects(self, wake: asyncio.Event) -> Coroutine[Any, Any, None]:
        """LISTEN for committed intents on a connection of its own (run it as a task)."""
        return listen(self.dsn, EFFECTS_CHANNEL, wake, on_payload=self._shards.hint)

    def owner_lock(self, owner: str) -> OwnerLock:
        """The session lock of ``owner``, on a connection of its own."""
        return OwnerLock(self.dsn, owner)

    async def with_payload(self, effect: ClaimedEffect) -> ClaimedEffect:
        """The attempt with its payload read back if it was stored by reference.

        Claims never read blobs; a deliverer reads one just before calling its
        sink, so it holds one large payload per call in flight, not per claim.
        """
        sha = reference_hash(effect.payload)
        if sha is None:
            return effect
        with translate_errors("reading a payload"):
            async with self.engine.begin() as conn:
                values = await conn.run_sync(blob_store.fetch, [sha])
        return dataclasses.replace(effect, payload=values[sha])

    async def run_holds(self, run_id: UUID, effect_id: UUID) -> bool:
        """Whether the run holds this effect back now (paused; stopping, unless a compensation)."""
        with translate_errors("reading whether a run holds its effects"):
            async with self.engine.connect() as conn:
                held = await conn.scalar(
                    stopping.run_holds(), {"held_run": run_id, "held_effect": effect_id}
                )
        return bool(held)

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
            async with self.engine.connect() as conn:
                by_shard: dict[int, list[tuple[UUID, int]]] = {}
                for id, attempt in held:
                    # a shard is forgotten once the effect's outcome committed: no lease left
                    if (shard := self._shards.of.get(id)) is not None:
                        by_shard.setdefault(shard, []).append((id, attempt))
                for shard, part in by_shard.items():
                    params = leases.extend_params(part, owner=owner, lease_seconds=lease_seconds)
                    statement = leases.extend_leases(sharded)
                    with self._shards.answering(shard, conn):
                        # a transaction per shard: across two workers it would take two phases
                        async with conn.begin():
                            result = await conn.execute(statement, {**params, "part_shard": shard})
                            kept |= {row[0] for row in result}
        return kept

    async def complete(self, owner: str, done: Sequence[Completion]) -> list[tuple[UUID, str]]:
        """Record a batch of attempt outcomes (fenced); returns (effect id, logged outcome)."""
        began = time.perf_counter()
        with translate_errors("recording outcomes"):
            async with self._direct.connection() as conn, await self._one_commit(conn):
                logged = await self._write_outcomes(conn, owner, done)
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
        freed (the next effect of an ordering key, say). On one server either
        both commit or neither does; on Citus each shard's statement commits on
        its own (``_one_commit``), and unless an outcome is of an effect with an
        ordering key the claim runs beside the outcomes, on a second connection
        (:meth:`_complete_beside_claim`). The background duties of a busy daemon ride
        along, so they cost no transaction of their own: ``extend`` pushes out those held
        leases (a heartbeat, fenced like :meth:`extend`), ``probe`` asks which
        duties have work (:func:`~outbox.storage.sql.duties.duty_probe`).
        """
        kept: set[UUID] = set()
        findings = None
        rode = True
        began = time.perf_counter()
        with translate_errors("recording outcomes and claiming effects"):
            async with self._direct.connection() as conn, await self._one_commit(conn):
                sharded = await self.sharded(conn)
                if sharded and not self._shards.ordered.intersection(c.effect_id for c in done):
                    claim = functools.partial(
                        self._claim_on,
                        spec=spec,
                        quotas=quotas,
                        owner=owner,
                        lease_seconds=lease_seconds,
                        rates=rates,
                        keep=True,
                    )
                    logged, rows, unwritten = await self._complete_beside_claim(
                        conn, owner, done, claim
                    )
                    if unwritten is not None:
                        self._observe("complete+claim", began, complete=0, claim=len(rows))
                        return Batched([], rows, unwritten=unwritten)
                else:
                    logged = await self._write_outcomes(conn, owner, done)
                    try:
                        rows = await self._claim_on(conn, spec, quotas, owner, lease_seconds, rates)
                    except ClaimCutShort as cut:  # (Citus) the outcomes are committed
                        rows = cut.rows if self._shards.kept(cut) else []
                        if not rows:
                            level = logging.WARNING if cut.lost else logging.ERROR
                            log.log(level, "a claim after outcomes failed (%s)", cut.error)
                        rode = False
                try:
                    if rode:
                        kept, findings = await self._ride(
                            conn, spec, sharded, owner, lease_seconds, extend, probe
                        )
                except psycopg.Error as exc:
                    if not sharded:
                        raise  # one transaction: the outcomes and the claim roll back with it
                    # (Citus) the outcomes and the claim are committed, and must be returned
                    log.warning("the heartbeat riding a batch failed (%s)", exc)
                    rode = False
        self._shards.forget(done)
        self._observe("complete+claim", began, complete=len(logged), claim=len(rows))
        return Batched(logged, rows, kept, findings, rode=rode)

    async def _ride(
        self,
        conn: psycopg.AsyncConnection[dict[str, Any]],
        spec: queue.QueueSpec,
        sharded: bool,
        owner: str,
        lease_seconds: float,
        extend: Sequence[tuple[UUID, int]],
        probe: DutyAsk | None,
    ) -> tuple[set[UUID], DutyFindings | None]:
        """The heartbeat and the duty probe riding a batch: the leases kept, what was found."""
        kept: set[UUID] = set()
        # on Citus a heartbeat statement per shard held, as :meth:`extend`
        groups = await shard_groups(conn, extend, lambda h: h[0], await self._held_shards(conn))
        for shard, part in groups.items() if extend else ():
            params = leases.extend_params(part, owner=owner, lease_seconds=lease_seconds)
            params["part_shard"] = shard
            renew = prepared(leases.extend_leases(dataclasses.replace(spec, sharded=sharded)))
            cur = await renew.execute(conn, params, prepare=not sharded)
            kept |= {row["id"] for row in await cur.fetchall()}
        # On Citus the probe reads every shard (about 50 ms): the duties round
        # sends it on a connection of its own rather than hold up the batch.
        if probe is None or sharded:
            return kept, None
        ask = prepared(duties.duty_probe(sharded))
        cur = await ask.execute(conn, probe.params(), prepare=not sharded)
        return kept, DutyFindings.from_row(list((await cur.fetchone() or {}).values()))

    async def _write_outcomes(
        self, conn: psycopg.AsyncConnection[dict[str, Any]], owner: str, done: Sequence[Completion]
    ) -> list[tuple[UUID, str]]:
        """:func:`complete_on` with what this store holds (on Citus, spare connections too).

        Outcomes written part-way (:class:`OutcomesLeft`): the written ones hold no
        lease of ours any more, the ones left still do.
        """
        held = await self._held_shards(conn)
        spare = self._direct.spare if held is not None else None
        try:
            return await complete_on(conn, owner, done, held, spare, self._shards.runs)
        except OutcomesLeft as partly:
            left = {c.effect_id for c in partly.left}
            self._shards.forget([c for c in done if c.effect_id not in left])
            raise

    async def _complete_beside_claim(
        self,
        conn: psycopg.AsyncConnection[dict[str, Any]],
        owner: str,
        done: Sequence[Completion],
        claim: Callable[[psycopg.AsyncConnection[dict[str, Any]]], Awaitable[list[ClaimedEffect]]],
    ) -> tuple[list[tuple[UUID, str]], list[ClaimedEffect], BaseException | None]:
        """On Citus: write ``done`` on ``conn`` while ``claim`` runs on a spare connection.

        A deliverer's round is otherwise a chain of waits, each on one process
        (this one, the coordinator, a worker) while the others idle; side by side
        the claim costs the round nothing but its CPU. It cannot see what the
        outcomes free, which is why a batch with an ordered effect does not come
        here; with no connection free it runs after them on ``conn``. Returns
        what was logged, what was claimed, and why the outcomes were not written
        (None: they were): rows a claim committed are returned whatever became
        of the outcomes, or their leases would run out uncalled (a cancelled
        round gives them back: :meth:`_give_back`), and so are the rows of a
        claim cut short part-way (:class:`ClaimCutShort`). A claim that failed
        with nothing committed is left to the take loop, which claims again and
        says why it cannot.
        """

        async def apart() -> list[ClaimedEffect] | None:
            async with self._direct.spare() as other:
                return None if other is None else await claim(other)

        claiming = asyncio.ensure_future(apart())
        logged: list[tuple[UUID, str]] = []
        unwritten: Exception | None = None
        try:
            with translate_errors("recording outcomes"):
                logged = await self._write_outcomes(conn, owner, done)
        except asyncio.CancelledError:
            await self._give_back(owner, claiming)
            raise
        except Exception as exc:
            unwritten = exc
        try:
            # shielded: a round cancelled while the claim ends still gives back its rows
            rows = await asyncio.shield(claiming)
            if rows is None and unwritten is None:
                rows = await claim(conn)
        except asyncio.CancelledError:
            await self._give_back(owner, claiming)
            raise
        except Exception as exc:
            log.debug("a claim beside outcomes failed (%s)", exc)
            rows = None
        return logged, rows or [], unwritten

    async def _give_back(
        self, owner: str, claiming: asyncio.Future[list[ClaimedEffect] | None]
    ) -> None:
        """The round was cancelled: give back what its claim beside the outcomes took.

        The claim has most likely committed by then; unreturned, its rows would
        wait for their leases to run out, uncalled, and the reconciler could not
        tell them from calls that may have happened.
        """
        try:
            rows = await claiming or []
            if rows:
                reason = "released unstarted: the round that claimed it was cancelled"
                await self.complete(owner, [Completion.released(r, reason) for r in rows])
        except Exception as exc:
            log.warning("effects claimed by a cancelled round were not given back (%s)", exc)

    # -- stream mode -----------------------------------------------------------------

    async def claim_dispatched(
        self,
        ids: Sequence[UUID],
        *,
        owner: str,
        lease_seconds: float,
        shards: Mapping[UUID, int] | None = None,
    ) -> list[ClaimedEffect]:
        """Claim the effects named by Kafka records that are still ``dispatched``.

        ``shards``: on Citus, each id's shard as its record names it (a statement
        per shard, each committed on its own); an id without one is looked up.
        A shard's statement failing after others claimed rows raises
        :class:`ClaimCutShort` with those rows (they are the caller's: raised
        away, they would wait for their leases to run out, never called) and
        ``left``, the ids no statement settled, to be claimed again.
        """
        if not ids:
            return []
        began = time.perf_counter()
        rows: list[ClaimedEffect] = []
        with translate_errors("claiming dispatched effects"):
            async with self._direct.connection() as conn:
                held_shards = await self._held_shards(conn)
                named = (shards or {}).get
                groups = await shard_groups(conn, ids, lambda i: i, held_shards, named)
                settled: set[UUID] = set()
                try:
                    for shard, part in groups.items():
                        rows += await self._claim_dispatched_on(
                            conn, shard, part, owner, lease_seconds
                        )
                        settled.update(part)
                except (psycopg.Error, SQLAlchemyError) as exc:
                    if not rows or shard is None:  # nothing committed is lost
                        raise
                    left = [i for i in ids if i not in settled]
                    cut = ClaimCutShort(rows, exc, shard, lost=session_lost(conn), left=left)
                    self._observe("claim", began, claim=len(rows))  # its rows are delivered
                    raise cut from exc
                finally:
                    self._shards.of.update((r.id, r.shard) for r in rows if r.shard is not None)
        self._observe("claim", began, claim=len(rows))
        return rows

    async def _claim_dispatched_on(
        self,
        conn: psycopg.AsyncConnection[dict[str, Any]],
        shard: int | None,
        ids: list[UUID],
        owner: str,
        lease_seconds: float,
    ) -> list[ClaimedEffect]:
        """:meth:`claim_dispatched`'s statement for the ``ids`` of one shard (None: one server)."""
        params: dict[str, Any] = {"ids": ids, "owner": owner, "lease_seconds": lease_seconds}
        if shard is not None:
            params["on_shard"] = shard
        claim = prepared(dispatch_sql.claim_dispatched(shard is not None))
        cur = await claim.execute(conn, params, prepare=shard is None)
        return [ClaimedEffect.from_row(row) for row in await cur.fetchall()]

    # -- the rest ----------------------------------------------------------------------

    async def run_sync(self, fn: Callable[[RunTx], T], what: str = "a run transaction") -> T:
        """Run sync domain logic (``runs.stopping``, say) on a :class:`RunTx` in one transaction."""
        tx: RunTx | None = None

        def call(conn: Connection) -> T:
            nonlocal tx
            tx = RunTx(conn)
            return fn(tx)

        with translate_errors(what):
            async with self.engine.begin() as conn:
                result = await conn.run_sync(call)
        for run_id, effect_id in tx.wake_after_commit if tx is not None else ():
            await self._wake_apart(run_id, effect_id)
        return result

    async def _wake_apart(self, run_id: UUID, effect_id: UUID) -> None:
        """On Citus: wake a run of another shard parked on an effect that ended.

        In a transaction of its own: a node that does not answer leaves the run to
        its recheck timer (as :meth:`Store._wake_apart <outbox.storage.store.Store._wake_apart>`).
        """
        try:
            async with self.engine.begin() as conn:
                await conn.run_sync(wake_parked, run_id, effect_id)
        except SQLAlchemyError as exc:
            log.warning("run %s parked on effect %s not woken (%s)", run_id, effect_id, exc)

    async def state_counts(self) -> maintenance.StateCounts:
        """Runs by status, open effects by (status, kind), oldest pending age."""
        with translate_errors("counting states"):
            async with self.engine.begin() as conn:
                return await conn.run_sync(read_state_counts)

    async def dispose(self) -> None:
        """Close every connection."""
        await self._direct.close()
        await self.engine.dispose()
