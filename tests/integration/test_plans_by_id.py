"""Statements that find their rows by id stay on the primary key, whatever the statistics say.

A backlog is analyzed while it is pending; then it is claimed, in flight or
dispatched, and the statistics still say almost nothing is. A statement that
names its rows by id and checks their status too was then planned as a read
of the status's partial index, every in-flight or dispatched effect for a
batch of ten (``outbox.storage.sql.common.not_by_index``). Expected: the
plan reads the batch's rows by id and throws none away.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import psycopg
import pytest
from sqlalchemy.dialects import postgresql

from outbox.ids import RELAY_OWNER_PREFIX
from outbox.storage.async_store import AsyncStore, ClaimedEffect
from outbox.storage.dsn import libpq_dsn
from outbox.storage.engine import make_async_engine
from outbox.storage.sql.dispatch import DISPATCH_QUEUE, claim_dispatched
from outbox.storage.sql.leases import extend_leases, extend_params
from outbox.storage.sql.queue import EFFECT_QUEUE, QueueSpec

BACKLOG = 20_000
OWNER = "deliverer-1"
RELAY = RELAY_OWNER_PREFIX + "host:1:abc"


def analyzed_backlog(dsn: str) -> None:
    with psycopg.connect(libpq_dsn(dsn), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox_effects (id, shard, kind, payload, payload_hash,"
            " idempotency_key, status, available_at) SELECT i, outbox_shard_of(i), 'k', '{}',"
            " md5('{}'), md5(i::text), 'pending', now()"
            " FROM (SELECT gen_random_uuid() AS i FROM generate_series(1, %s)) AS s",
            [BACKLOG],
        )
        conn.execute("ANALYZE outbox_effects")


def claimed(dsn: str, spec: QueueSpec, owner: str) -> list[ClaimedEffect]:
    async def claim() -> list[ClaimedEffect]:
        store = AsyncStore(make_async_engine(dsn))
        try:
            return await store.claim_many(
                spec, [({"kind": "k"}, BACKLOG)], owner=owner, lease_seconds=300
            )
        finally:
            await store.dispose()

    return asyncio.run(claim())


def plan_of(dsn: str, statement: Any, params: dict[str, Any]) -> str:
    compiled = statement.compile(dialect=postgresql.dialect())
    with psycopg.connect(libpq_dsn(dsn)) as conn:
        rows = conn.execute("EXPLAIN ANALYZE " + str(compiled), {**compiled.params, **params})
        plan = "\n".join(row[0] for row in rows)
        conn.rollback()  # EXPLAIN ANALYZE ran the update
    return plan


def read_by_id(plan: str, status_index: str) -> None:
    assert status_index not in plan, plan
    removed = sum(int(n) for n in re.findall(r"Rows Removed by Filter: (\d+)", plan))
    assert removed == 0, plan


@pytest.mark.slow
def test_a_stream_claim_reads_its_records_effects_not_every_dispatched_one(dsn: str) -> None:
    """Consumers lagging behind a relay: 20,000 dispatched, a claim of 10 records' effects
    (it read all 20,000, 15 ms a claim of 100 per 30,000 waiting)."""
    analyzed_backlog(dsn)
    batch = [row.id for row in claimed(dsn, DISPATCH_QUEUE, RELAY)][5_000:5_010]
    plan = plan_of(dsn, claim_dispatched(), {"ids": batch, "owner": OWNER, "lease_seconds": 30.0})
    read_by_id(plan, "outbox_effects_dispatched")
    assert "rows=10" in plan.splitlines()[0], plan


@pytest.mark.slow
def test_a_heartbeat_extends_its_leases_not_reading_every_one_in_flight(dsn: str) -> None:
    """20,000 in flight, a heartbeat of 10 leases (it read all 20,000: 8.4 ms, now 0.7)."""
    analyzed_backlog(dsn)
    held = [(row.id, row.attempt) for row in claimed(dsn, EFFECT_QUEUE, OWNER)][5_000:5_010]
    plan = plan_of(
        dsn, extend_leases(EFFECT_QUEUE), extend_params(held, owner=OWNER, lease_seconds=30.0)
    )
    read_by_id(plan, "outbox_effects_leased")
    assert "rows=10" in plan.splitlines()[0], plan
