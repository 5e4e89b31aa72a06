"""Helpers of the runctl, async and console sections: scratch databases, backlogs, claims."""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from sqlalchemy.engine import make_url

MB = 1024 * 1024


# -- helpers --------------------------------------------------------------------------


def libpq(dsn: str) -> str:
    return make_url(dsn).set(drivername="postgresql").render_as_string(hide_password=False)


def with_database(dsn: str, name: str) -> str:
    return make_url(dsn).set(database=name).render_as_string(hide_password=False)


@contextmanager
def scratch(admin: str, name: str) -> Iterator[str]:
    """A fresh, empty database for one measurement."""
    with psycopg.connect(libpq(admin), autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")
    try:
        yield with_database(admin, name)
    finally:
        with psycopg.connect(libpq(admin), autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def migrated(dsn: str) -> None:
    from outbox.storage.engine import make_engine
    from outbox.storage.migrate import migrate

    engine = make_engine(dsn)
    migrate(engine)
    engine.dispose()


def spread(values: list[float]) -> dict[str, float]:
    """Median and min-max of per-repetition figures."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def quantiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {
        "n": len(ordered),
        "p50": at(0.50),
        "p90": at(0.90),
        "p99": at(0.99),
        "max": ordered[-1],
    }


def backlog(dsn: str, kind: str, n: int, *, fairness_key: str | None = None) -> None:
    """``n`` pending no-op effects inserted with SQL (columns every schema version has)."""
    lane = "" if fairness_key is None else ", fairness_key"
    value = "" if fairness_key is None else f", '{fairness_key}'"
    with psycopg.connect(libpq(dsn), autocommit=True) as conn:
        conn.execute(
            f"""INSERT INTO outbox_effects
                  (id, shard, kind, payload, payload_hash, idempotency_key, status,
                   available_at{lane})
                SELECT id, outbox_shard_of(id), %(kind)s, '{{"n": 1}}'::jsonb, md5('x'),
                       md5(%(tag)s || g::text), 'pending', now(){value}
                  FROM (SELECT gen_random_uuid() AS id, g
                          FROM generate_series(1, %(n)s) AS g) AS made""",
            {"kind": kind, "n": n, "tag": uuid.uuid4().hex},
        )
        conn.execute("ANALYZE outbox_effects")


def claim_times(dsn: str, kind: str, batch: int, claims: int) -> list[float]:
    """Seconds each of ``claims`` claims of ``batch`` took (AsyncStore.claim_many, as a daemon)."""
    from outbox.storage.async_store import AsyncStore
    from outbox.storage.engine import make_async_engine
    from outbox.storage.sql.queue import EFFECT_QUEUE

    async def go() -> list[float]:
        store = AsyncStore(make_async_engine(dsn))
        times = []
        try:
            for _ in range(5):  # warm: connection, prepared statement, plan
                await store.claim_many(
                    EFFECT_QUEUE, [({"kind": kind}, batch)], owner="bench", lease_seconds=600
                )
            for _ in range(claims):
                started = time.perf_counter()
                rows = await store.claim_many(
                    EFFECT_QUEUE, [({"kind": kind}, batch)], owner="bench", lease_seconds=600
                )
                times.append(time.perf_counter() - started)
                assert len(rows) == batch, f"claimed {len(rows)} of {batch}"
        finally:
            await store.dispose()
        return times

    return asyncio.run(go())
