"""The claims of the delivery store: a batch of effects per partition (kind), leased to an owner.

On one server a claim is one statement per partition. On Citus a statement
reads one shard, so a partition's claim asks the shards in turns
(:class:`~outbox.storage.shard_turns.ShardTurns`), each statement committing on
its own; one that fails part-way returns what the others committed.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg

from outbox.errors import ConfigurationError
from outbox.models import EffectStatus
from outbox.storage.attempts import ClaimCutShort, ClaimedEffect
from outbox.storage.delivery_duties import DutyStatements
from outbox.storage.direct import prepared
from outbox.storage.engine import translate_errors
from outbox.storage.sql import queue

__all__ = ["EffectClaims"]


class EffectClaims(DutyStatements):
    """Claims of pending effects (and a relay's of effects to dispatch), for :class:`AsyncStore`."""

    async def _claim_on(
        self,
        conn: psycopg.AsyncConnection[dict[str, Any]],
        spec: queue.QueueSpec,
        quotas: Sequence[tuple[dict[str, str], int]],
        owner: str,
        lease_seconds: float,
        rates: Mapping[str, queue.Rate] | None,
        *,
        keep: bool = False,
    ) -> list[ClaimedEffect]:
        """The claim of each partition's quota on ``conn`` (the caller owns the transaction).

        On Citus a claim reads one shard: a partition's claim asks them in the order
        of ``ShardTurns.plan`` (named by a wake-up first, then taking turns) until
        its quota is met, it may end with the named ones, or each was asked. A claim
        whose statements commit one by one (Citus, autocommit) and fails part-way
        raises :class:`ClaimCutShort` with every partition's rows committed so far;
        with ``keep`` it returns them instead (and raises the failure if there are none).
        """
        rows: list[ClaimedEffect] = []
        sharded = await self.sharded(conn)
        if sharded:
            spec = dataclasses.replace(spec, sharded=True)
        hints = self._shards.take_hints() if sharded else frozenset()
        kinds = [partition.get("kind", "") for partition, _ in quotas]
        rated = [kind for kind in kinds if rates is not None and kind in rates]
        if rated and sharded:  # before any statement: on Citus each commits on its own
            raise ConfigurationError(
                f"kind {rated[0]!r} declares a rate: a distributed database "
                "does not enforce declared rates yet (docs/howto/citus.md)"
            )
        try:
            for partition, limit in quotas:
                rate = None if rates is None else rates.get(partition.get("kind", ""))
                claim_on = functools.partial(
                    self._claim_partition,
                    conn,
                    spec,
                    owner=owner,
                    lease_seconds=lease_seconds,
                    rate=rate,
                )
                if sharded:
                    ready = functools.partial(self._ready_on, conn, spec)
                    rows += await self._shards.claim(conn, partition, limit, hints, claim_on, ready)
                else:
                    rows += await claim_on(partition, limit)
        except ClaimCutShort as cut:  # what earlier partitions claimed is committed too
            cut.rows = rows + cut.rows
            self._remember(spec, cut.rows)
            if not keep:
                raise
            if self._shards.kept(cut):
                return cut.rows
            raise cut.error from None  # (it is the cut's cause: chained, a cycle)
        self._remember(spec, rows)
        return rows

    def _remember(self, spec: queue.QueueSpec, rows: list[ClaimedEffect]) -> None:
        """Note each claimed row's shard, ordering key and run (where its lease goes on)."""
        if spec.claimed != EffectStatus.DISPATCHED:
            # A relay's claim hands its rows on to whichever deliverer reads their
            # records: it holds no lease to extend, and its give-back names each
            # row's shard. Remembered, they would pile up for the relay's life.
            self._shards.of.update((r.id, r.shard) for r in rows if r.shard is not None)
            self._shards.ordered.update(r.id for r in rows if r.ordering_key is not None)
            self._shards.runs.update((r.id, r.run_id) for r in rows)

    async def _ready_on(
        self,
        conn: psycopg.AsyncConnection[dict[str, Any]],
        spec: queue.QueueSpec,
        partition: dict[str, Any],
    ) -> bool:
        """On Citus: whether ``partition`` (its shard named) has a ready row."""
        ask = prepared(queue.ready_on_shard(spec))
        params = queue.partition_params(partition)
        cur = await ask.execute(conn, params, prepare=True)
        return await cur.fetchone() is not None

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
            cur = await claim.execute(conn, params, prepare=True)
            found, again = self._claims.claimed(spec, partition, lanes, await cur.fetchall())
            rows += [ClaimedEffect.from_row(row) for row in found]
        return rows

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
                    rows = await self._claim_on(
                        conn, spec, quotas, owner, lease_seconds, rates, keep=True
                    )
                else:
                    async with conn.transaction():
                        rows = await self._claim_on(conn, spec, quotas, owner, lease_seconds, rates)
        self._observe("claim", began, claim=len(rows))
        return rows
