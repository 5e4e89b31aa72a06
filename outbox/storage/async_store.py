"""The database side of delivery (async): claim, heartbeat, complete, reconcile, report.

The daemon and the reconciler call these methods; they never see SQL. Each
method is one short transaction, so no transaction is ever held across a
call to the outside world.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from outbox.faults import crash_point
from outbox.models import OPEN_EFFECT_STATUSES
from outbox.runs.stopping import advance_stopping_runs
from outbox.storage.schema import effects
from outbox.storage.sql import queue
from outbox.storage.sql.steps import const
from outbox.storage.store import psycopg_url

__all__ = ["AsyncDeliveryStore", "Completion", "make_async_engine"]


def make_async_engine(
    dsn: str,
    *,
    pool_size: int = 4,
    application_name: str = "outbox-deliver",
    idle_in_transaction_ms: int = 60_000,
) -> AsyncEngine:
    """An async engine on psycopg 3, with the connection count bounded."""
    return create_async_engine(
        psycopg_url(dsn),
        pool_size=pool_size,
        max_overflow=0,
        # No ping per checkout (a round trip per transaction): a dropped
        # connection fails its statement, is discarded, and the loop retries.
        pool_pre_ping=False,
        connect_args={
            "options": f"-c idle_in_transaction_session_timeout={idle_in_transaction_ms}",
            "application_name": application_name,
        },
    )


@dataclass(frozen=True, slots=True)
class Completion:
    """The recorded end of one attempt (a row of ``complete_effects``'s ``done``)."""

    effect_id: UUID
    attempt: int
    status: str
    outcome: str
    result_json: str | None = None
    error: str | None = None
    delay: float = 0.0
    detail_json: str | None = None
    started_at: str | None = None

    def as_json(self) -> str:
        """One element of the ``done`` parameter; result and detail spliced in as JSON text."""
        head = json.dumps(
            {
                "id": str(self.effect_id),
                "attempt": self.attempt,
                "status": self.status,
                "outcome": self.outcome,
                "error": self.error,
                "delay": self.delay,
                "started_at": self.started_at,
            },
            separators=(",", ":"),
        )
        return (
            f'{head[:-1]},"result":{self.result_json or "null"},'
            f'"detail":{self.detail_json or "null"}}}'
        )


class AsyncDeliveryStore:
    """Delivery statements on one async engine."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def claim_many(
        self,
        spec: queue.QueueSpec,
        quotas: Sequence[tuple[dict[str, str], int]],
        *,
        owner: str,
        lease_seconds: float,
    ) -> list[Any]:
        """Claim from each partition, all in one transaction (claimed rows are all returned)."""
        rows: list[Any] = []
        async with self.engine.connect() as conn:
            if len(quotas) == 1:
                # One statement claims and records the attempt's start, so alone it
                # needs no explicit transaction: autocommit saves the BEGIN and COMMIT
                # round trips on the commit -> handler start path. With several, a
                # failure part-way must not leave claims that were never returned.
                conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
            for partition, limit in quotas:
                params = queue.claim_params(
                    partition, limit=limit, owner=owner, lease_seconds=lease_seconds
                )
                result = await conn.execute(queue.claim(spec), params)
                rows.extend(result.mappings())
            await conn.commit()
        return rows

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
        params = queue.extend_params(held, owner=owner, lease_seconds=lease_seconds)
        async with self.engine.begin() as conn:
            result = await conn.execute(queue.extend_leases(spec), params)
            return {row[0] for row in result}

    async def complete(self, owner: str, done: Sequence[Completion]) -> list[tuple[UUID, str]]:
        """Record a batch of attempt outcomes (fenced); returns (effect id, logged outcome)."""
        payload = "[" + ",".join(c.as_json() for c in done) + "]"
        async with self.engine.begin() as conn:
            result = await conn.execute(
                queue.complete_effects(),
                {"owner": owner, "done": payload, "ids": [c.effect_id for c in done]},
            )
            logged = [(row[0], row[1]) for row in result]
            crash_point("during_completion")
        return logged

    async def expired(self, max_rows: int) -> list[Any]:
        """In-flight effects whose lease ran out."""
        async with self.engine.connect() as conn:
            result = await conn.execute(queue.expired_effects(), {"max_rows": max_rows})
            return list(result.mappings())

    async def expire(
        self,
        effect_id: UUID,
        attempt: int,
        *,
        new_status: str,
        note: str,
        resolution: str,
        worker: str,
    ) -> bool:
        """Resolve one expired attempt (compare-and-set); False when someone else did."""
        async with self.engine.begin() as conn:
            result = await conn.execute(
                queue.expire_effect(),
                {
                    "effect_id": effect_id,
                    "expected_attempt": attempt,
                    "new_status": new_status,
                    "note": note,
                    "resolution": resolution,
                    "worker": worker,
                },
            )
            return result.first() is not None

    async def take_over(
        self, effect_id: UUID, attempt: int, *, owner: str, lease_seconds: float
    ) -> bool:
        """Lease an expired attempt to ``owner`` (compare-and-set)."""
        async with self.engine.begin() as conn:
            result = await conn.execute(
                queue.take_over_effect(),
                {
                    "effect_id": effect_id,
                    "expected_attempt": attempt,
                    "owner": owner,
                    "lease_seconds": lease_seconds,
                },
            )
            return result.first() is not None

    async def mark_unknown_kinds(
        self, known: Sequence[str], *, grace_seconds: float, note_prefix: str, max_rows: int = 1000
    ) -> int:
        """Note on pending effects of kinds no deliverer here knows; returns how many."""
        async with self.engine.begin() as conn:
            result = await conn.execute(
                queue.mark_unknown_kinds(),
                {
                    "known": list(known),
                    "grace_seconds": grace_seconds,
                    "note_prefix": note_prefix,
                    "max_rows": max_rows,
                },
            )
            return len(result.all())

    # -- stream mode -----------------------------------------------------------------

    async def mark_dispatched(
        self, owner: str, held: Sequence[tuple[UUID, int]], *, dispatch_ttl: float
    ) -> set[UUID]:
        """The relay published these attempts; returns the ids it still held (fenced)."""
        if not held:
            return set()
        params = queue.extend_params(held, owner=owner, lease_seconds=0)
        params["dispatch_ttl"] = dispatch_ttl
        async with self.engine.begin() as conn:
            result = await conn.execute(queue.mark_dispatched(), params)
            return {row[0] for row in result}

    async def claim_dispatched(
        self, ids: Sequence[UUID], *, owner: str, lease_seconds: float
    ) -> list[Any]:
        """Claim the effects named by Kafka records that are still ``dispatched``."""
        if not ids:
            return []
        async with self.engine.begin() as conn:
            result = await conn.execute(
                queue.claim_dispatched(),
                {"ids": list(ids), "owner": owner, "lease_seconds": lease_seconds},
            )
            return list(result.mappings())

    async def redispatch_expired(self, *, worker: str, max_rows: int = 1000) -> int:
        """Dispatched effects not delivered within their TTL go back to ``pending``."""
        async with self.engine.begin() as conn:
            result = await conn.execute(
                queue.redispatch_expired(), {"worker": worker, "max_rows": max_rows}
            )
            return len(result.all())

    async def advance_stopping_runs(self) -> dict[str, int]:
        """One sweep over cancelling and compensating runs (see :mod:`outbox.runs.stopping`)."""
        async with self.engine.begin() as conn:
            return await conn.run_sync(advance_stopping_runs)

    async def open_counts(self) -> tuple[dict[tuple[str, str], int], float]:
        """Unfinished effects per (status, kind), and the age in seconds of the oldest pending."""
        open_statuses = [const(s) for s in OPEN_EFFECT_STATUSES]
        counts_q = (
            select(effects.c.status, effects.c.kind, func.count())
            .where(effects.c.status.in_(open_statuses))
            .group_by(effects.c.status, effects.c.kind)
        )
        oldest_q = text(
            "SELECT coalesce(extract(epoch FROM now() - min(created_at)), 0) "
            "FROM outbox_effects WHERE status = 'pending'"
        )
        async with self.engine.connect() as conn:
            counts = {(s, k): n for s, k, n in (await conn.execute(counts_q)).all()}
            oldest = float((await conn.execute(oldest_q)).scalar_one())
        return counts, oldest

    async def dispose(self) -> None:
        """Close every connection."""
        await self.engine.dispose()
