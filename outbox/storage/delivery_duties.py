"""The delivery store's connections and its background duties' statements.

:class:`DeliveryConnections` holds what every delivery statement runs on: the
engine, the claim/complete connections of its own (:mod:`outbox.storage.direct`)
and, on Citus, the shard turns. :class:`DutyStatements` adds the statements of
the daemon's background rounds (reconciling expired leases, notes, deliverers
that are gone); :class:`~outbox.storage.async_store.AsyncStore` adds the hot
path (claim, heartbeat, complete) on top.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from uuid import UUID

import psycopg
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.ids import RELAY_OWNER_PREFIX
from outbox.shards import sweep_shards
from outbox.storage.attempts import ClaimedEffect, DutyAsk, DutyFindings
from outbox.storage.claims import ClaimMode
from outbox.storage.direct import GENERIC_PLANS_OFF_CITUS, DirectConnections
from outbox.storage.dsn import libpq_dsn, session_args
from outbox.storage.engine import translate_errors
from outbox.storage.outcome_writes import logged_rows
from outbox.storage.shard_turns import ShardTurns, effect_shard
from outbox.storage.sql import dispatch as dispatch_sql
from outbox.storage.sql import duties, notes, owners
from outbox.storage.sql import effects as effect_sql
from outbox.storage.sql import governance as gov_sql

__all__ = ["DeliveryConnections", "DutyStatements", "Observer"]

#: Told of each transaction on the delivery path: what it did (``"claim"``,
#: ``"complete"``, ``"complete+claim"``), how long it took (s), rows per part.
Observer = Callable[[str, float, Mapping[str, int]], None]


def claimed_rows(rows: Any) -> list[ClaimedEffect]:
    """Claimed effects from a SQLAlchemy result."""
    return [ClaimedEffect.from_row(row) for row in rows.mappings()]


class DeliveryConnections:
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
        self._direct = DirectConnections(
            libpq_dsn(engine.url),
            setup=GENERIC_PLANS_OFF_CITUS,
            params=session_args(
                engine.url, idle_in_transaction_ms, application_name, read_committed=True
            ),
        )
        #: Told of every claim/complete transaction (a benchmark's probe); None: nobody.
        self.observer: Observer | None = None
        #: On Citus (``outbox.storage.citus``): statements name one shard each.
        self._sharded: bool | None = None
        #: On Citus: which shard to ask next, which to leave alone, whose rows we hold.
        self._shards = ShardTurns()

    @property
    def dsn(self) -> str:
        """The database, for connections of its own (LISTEN)."""
        return self.engine.url.render_as_string(hide_password=False)

    async def sharded(self, conn: psycopg.AsyncConnection[dict[str, Any]]) -> bool:
        """Whether the database is distributed (Citus): asked once."""
        if self._sharded is None:
            cur = await conn.execute("SELECT current_setting('outbox.distributed', true) AS d")
            row = await cur.fetchone()
            self._sharded = row is not None and row["d"] == "on"
        return self._sharded

    @property
    def distributed(self) -> bool:
        """Whether the database is distributed (Citus); False until a statement has asked."""
        return bool(self._sharded)

    async def _is_sharded(self) -> bool:
        if self._sharded is None:
            async with self._direct.connection() as conn:
                await self.sharded(conn)
        return bool(self._sharded)

    async def _one_commit(
        self, conn: psycopg.AsyncConnection[Any]
    ) -> contextlib.AbstractAsyncContextManager[Any]:
        """One transaction for a batch's statements on one server; none on Citus.

        On Citus a transaction whose writes reach two workers commits in two
        phases (PREPARE and COMMIT PREPARED on each, a record on the coordinator),
        and a batch's shards lie on several. There each statement names one shard
        and holds on its own (an outcome with its attempt row, a claim with its
        attempt, a heartbeat), so alone in autocommit each commits in one phase.
        """
        return contextlib.nullcontext() if await self.sharded(conn) else conn.transaction()

    async def _held_shards(self, conn: psycopg.AsyncConnection[Any]) -> dict[UUID, int] | None:
        return self._shards.of if await self.sharded(conn) else None  # None: one server

    async def _shard_params(self, effect_id: UUID, shard: int | None) -> dict[str, Any]:
        """On Citus: the shard and the database's time a sharded statement names."""
        if not await self._is_sharded():
            return {}
        async with self._direct.connection() as conn:
            if shard is None:
                shard = await effect_shard(conn, effect_id)
            cur = await conn.execute("SELECT now() AS now")
            return {"on_shard": shard, "now": (await cur.fetchone() or {})["now"]}

    def _observe(self, what: str, began: float, **rows: int) -> None:
        if self.observer is not None:
            self.observer(what, time.perf_counter() - began, rows)


class DutyStatements(DeliveryConnections):
    """The statements of a daemon's background rounds: reconcile, notes, owners that are gone."""

    async def probe_duties(self, ask: DutyAsk) -> DutyFindings:
        """Which background duties have work (one read-only statement, autocommit).

        On Citus the gone owners are asked apart (:meth:`gone_owners`).
        """
        sharded = await self._is_sharded()
        with translate_errors("probing for background duties"):
            async with self.engine.connect() as conn:
                conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
                probe = duties.duty_probe(sharded)
                findings = DutyFindings.from_row((await conn.execute(probe, ask.params())).one())
        if not sharded or not ask.gone_kinds:
            return findings
        gone = await self.gone_owners(ask.gone_kinds, restart_grace=ask.restart_grace)
        return dataclasses.replace(findings, gone=tuple(gone))

    async def expired(
        self, max_rows: int, *, redispatch_as: str | None = None
    ) -> tuple[int, list[ClaimedEffect]]:
        """In-flight effects whose lease ran out; returns (re-dispatched, expired).

        With ``redispatch_as`` (a worker name), dispatched effects not delivered
        within their TTL go back to ``pending`` first, in the same transaction
        (one commit per reconcile round, not two). On Citus a transaction a
        shard, routed to the node holding it: one over every shard would write
        to both workers and commit in two phases, every round.
        """
        sharded = await self._is_sharded()
        redispatched, found = 0, list[ClaimedEffect]()
        with translate_errors("finding expired attempts"):
            async with self.engine.connect() as conn:
                for shard in self._shards.live() if sharded else [None]:
                    on = {} if shard is None else {"on_shard": shard}
                    with self._shards.answering(shard, conn):
                        async with conn.begin():
                            if redispatch_as is not None:
                                params = {"worker": redispatch_as, "max_rows": max_rows, **on}
                                redispatched += len(
                                    await conn.run_sync(
                                        logged_rows,
                                        dispatch_sql.redispatch_expired,
                                        params,
                                        sharded=sharded,
                                    )
                                )
                            want = {"max_rows": max_rows - len(found), **on}
                            if want["max_rows"] > 0:
                                rows = await conn.execute(effect_sql.expired_effects(sharded), want)
                                found += claimed_rows(rows)
        return redispatched, found

    async def unknown_of(self, kinds: Sequence[str], max_rows: int) -> list[ClaimedEffect]:
        """``unknown`` effects of these kinds (their deliverer can ask the sink), oldest first."""
        if not kinds:
            return []
        params = {"kinds": list(kinds), "max_rows": max_rows}
        with translate_errors("finding unknown effects"):
            async with self.engine.begin() as conn:
                return claimed_rows(await conn.execute(effect_sql.unknown_of_kinds(), params))

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
                logged = await conn.run_sync(
                    logged_rows, effect_sql.expire_effect, params, sharded=bool(on)
                )
                return bool(logged)

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
            async with self.engine.begin() as conn:
                row = (
                    await conn.execute(gov_sql.recorded_result(), {"effect_id": effect_id})
                ).first()
        return (False, None) if row is None else (True, row[0])

    async def note_attempt(
        self,
        effect_id: UUID,
        attempt: int,
        *,
        owner: str,
        note: Mapping[str, Any],
        shard: int | None = None,
    ) -> bool:
        """Store a deliverer's note about the current attempt (fenced); False if no longer ours.

        ``shard``: where the claim found the effect (on Citus the change goes there alone).
        """
        params = {
            "effect_id": effect_id,
            "expected_attempt": attempt,
            "owner": owner,
            "note": json.dumps({**note, "attempt": attempt}),
            "effect_shard": shard,
        }
        with translate_errors("noting an attempt"):
            async with self.engine.begin() as conn:
                statement = gov_sql.note_attempt(named=shard is not None)
                result = await conn.execute(statement, params)
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
        shards = sweep_shards(await self._is_sharded())
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

    async def gone_owners(
        self, kinds: Sequence[str], *, restart_grace: float
    ) -> list[tuple[str, bool]]:
        """Registered owners whose lock is free: (owner, holds an attempt of ``kinds``).

        On Citus in two reads: the owners and their locks live on the
        coordinator, and a statement may not join them with the distributed
        effects (which are read only when some owner is gone).
        """
        params = {"kinds": list(kinds), "restart_grace": restart_grace}
        with translate_errors("looking for deliverers that are gone"):
            async with self.engine.connect() as conn:
                conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
                if not await self._is_sharded():
                    result = await conn.execute(owners.gone_owners(), params)
                    return [(row[0], bool(row[1])) for row in result]
                names = list((await conn.execute(owners.gone_owner_names(), params)).scalars())
                if not names:
                    return []
                held = await conn.execute(owners.holding_kinds(), {**params, "owners": names})
                holders = set(held.scalars())
                return [(name, name in holders) for name in names]

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
            if not await self._is_sharded():
                async with self.engine.begin() as conn:
                    result = await conn.execute(owners.expire_gone_owner(), params)
                    return [row[0] for row in result]
            # On Citus a transaction a shard (one over two workers would commit in two
            # phases), the lock checked again in each: an owner whose lock session came
            # back meanwhile keeps what is left
            ids: list[UUID] = []
            async with self.engine.connect() as conn:
                async with conn.begin():
                    held = set((await conn.execute(owners.owner_shards(), params)).scalars())
                for shard in [s for s in self._shards.live() if s in held]:
                    with self._shards.answering(shard, conn):
                        async with conn.begin():
                            gone = await conn.execute(owners.gone_owner_names(), params)
                            if owner not in set(gone.scalars()):
                                break
                            result = await conn.execute(
                                owners.expire_gone_owner(sharded=True),
                                {**params, "on_shard": shard},
                            )
                            ids += [row[0] for row in result]
            return ids

    async def gone_relays(self, *, restart_grace: float) -> list[str]:
        """Registered Kafka relays whose session lock is free.

        On Citus too: the owners and their locks live on the coordinator.
        """
        with translate_errors("looking for relays that are gone"):
            async with self.engine.connect() as conn:
                conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
                names = await conn.execute(
                    owners.gone_owner_names(), {"restart_grace": restart_grace}
                )
                return [name for name in names.scalars() if name.startswith(RELAY_OWNER_PREFIX)]

    async def end_relay_dispatches(
        self, owner: str, *, ttl: float, gone_only: bool, restart_grace: float
    ) -> int:
        """Cut relay ``owner``'s dispatch leases to ``ttl`` s (:func:`owners.end_relay_dispatches`).

        Returns how many. On Citus a transaction a shard, the lock checked just
        before the sweep rather than in each statement.
        """
        params = {
            "owner": owner,
            "ttl": ttl,
            "gone_only": gone_only,
            "restart_grace": restart_grace,
        }
        sharded = await self._is_sharded()
        with translate_errors("ending the dispatches of a relay that is gone"):
            if not sharded:
                async with self.engine.begin() as conn:
                    return len((await conn.execute(owners.end_relay_dispatches(), params)).all())
            if gone_only and owner not in await self.gone_relays(restart_grace=restart_grace):
                return 0
            ended = 0
            async with self.engine.connect() as conn:
                for shard in self._shards.live():
                    with self._shards.answering(shard, conn):
                        async with conn.begin():
                            result = await conn.execute(
                                owners.end_relay_dispatches(sharded=True),
                                {**params, "on_shard": shard},
                            )
                            ended += len(result.all())
            return ended

    async def forget_gone_owners(self, candidates: Sequence[str], *, restart_grace: float) -> int:
        """Unregister gone owners that hold nothing (checked again); returns how many."""
        with translate_errors("forgetting deliverers that are gone"):
            async with self.engine.begin() as conn:
                holding = await conn.scalar(owners.owners_holding(), {"owners": list(candidates)})
                held = set(holding or ())
                idle = [owner for owner in candidates if owner not in held]
                params = {"owners": idle, "restart_grace": restart_grace}
                return len((await conn.execute(owners.forget_gone_owners(), params)).all())
