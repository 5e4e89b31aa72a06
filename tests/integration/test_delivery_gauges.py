"""The deliverer's gauges follow its own deliveries, not only the ``stats_seconds`` round."""

from __future__ import annotations

import asyncio
import re
import threading

from prometheus_client import CollectorRegistry

from deliverers.testing import RecordingDeliverer
from outbox import Outbox
from outbox.delivery import Delivery, Outcome, Succeeded
from tests.support import DaemonThread, wait_for


def _open(registry: CollectorRegistry) -> float:
    """Effects of the kind the gauge counts as not finished (pending or in flight)."""
    return sum(
        registry.get_sample_value("outbox_effects", {"state": state, "kind": "test.record"}) or 0
        for state in ("pending", "in_flight")
    )


def test_a_delivery_clears_the_effect_gauges_within_seconds(ob: Outbox, dsn: str) -> None:
    with ob.transaction() as tx:
        tx.intend("test.record", {"n": 1})
    release = threading.Event()

    def held(delivery: Delivery) -> Outcome:
        release.wait(30)
        return Succeeded({"ok": True})

    recorder = RecordingDeliverer(outcome=held)
    # One scheduled round an hour: only a count after the change can clear the gauge.
    with DaemonThread(dsn, {"test.record": recorder}, stats_seconds=3600) as running:
        assert running.daemon is not None
        registry = running.daemon.metrics.registry
        wait_for(lambda: _open(registry) == 1, message="the gauges count the open effect")
        release.set()
        wait_for(lambda: len(recorder.keys) == 1, message="delivered")
        wait_for(
            lambda: (
                _open(registry) == 0
                and registry.get_sample_value("outbox_oldest_pending_age_seconds") == 0
            ),
            timeout=10,
            message="the gauges counted again after the delivery",
        )


def test_the_stats_round_ends_when_cancelled_just_after_a_change(dsn: str) -> None:
    """A change noted as the daemon stops must not swallow the round's cancellation.

    The daemon notes a change while it records its last outcomes and then cancels
    its rounds; Python 3.11's ``asyncio.wait_for`` returns normally when the
    awaited event is set at the moment of the cancel, and a round waiting with it
    lived on, so the daemon never stopped.
    """
    from outbox.delivery.leases import Leases
    from outbox.delivery.maintenance import Maintenance
    from outbox.delivery.metrics import DeliveryMetrics
    from outbox.delivery.settings import DeliverySettings
    from outbox.storage.async_store import AsyncStore
    from outbox.storage.engine import make_async_engine

    async def main() -> None:
        store = AsyncStore(make_async_engine(dsn))
        metrics = DeliveryMetrics()
        settings = DeliverySettings(stats_seconds=60)
        maintenance = Maintenance(
            store, {}, settings, Leases({}, 1, metrics), metrics, lambda: None
        )
        try:
            rounds = asyncio.create_task(maintenance._stats_rounds())
            await asyncio.sleep(1.0)  # the first count is done; waiting for a change
            maintenance.changed()
            rounds.cancel()
            done, _ = await asyncio.wait({rounds}, timeout=5)
            assert done == {rounds}, "the stats round outlived its cancellation"
            assert rounds.cancelled()
        finally:
            await store.dispose()

    asyncio.run(main())


def test_a_slow_count_spaces_out_the_next(dsn: str) -> None:
    """A count that takes long (a large backlog) is not repeated every second while work goes on.

    Counting a million pending effects takes about 0.3 s; counted again a second
    after each change, the gauges cost the server a quarter of a CPU while a
    deliverer drains the backlog. The next count waits 20 times the last one's
    duration.
    """
    from outbox.delivery.leases import Leases
    from outbox.delivery.maintenance import STATS_COST_FACTOR, Maintenance
    from outbox.delivery.metrics import DeliveryMetrics
    from outbox.delivery.settings import DeliverySettings
    from outbox.storage.async_store import AsyncStore
    from outbox.storage.engine import make_async_engine

    async def main() -> list[tuple[float, float]]:
        store = AsyncStore(make_async_engine(dsn))
        metrics = DeliveryMetrics()
        maintenance = Maintenance(
            store,
            {},
            DeliverySettings(stats_seconds=60),
            Leases({}, 1, metrics),
            metrics,
            lambda: None,
        )
        counts: list[tuple[float, float]] = []
        count = maintenance.stats

        async def slow_count() -> None:  # as slow as a large backlog's
            began = asyncio.get_running_loop().time()
            await asyncio.sleep(0.15)
            await count()
            counts.append((began, asyncio.get_running_loop().time()))

        maintenance.stats = slow_count  # type: ignore[method-assign]
        rounds = asyncio.create_task(maintenance._stats_rounds())
        try:
            while len(counts) < 2:  # changes all the time, as while draining
                maintenance.changed()
                await asyncio.sleep(0.05)
                assert not rounds.done()
        finally:
            rounds.cancel()
            await asyncio.wait({rounds}, timeout=5)
            await store.dispose()
        return counts

    (began, ended), (again, _) = asyncio.run(asyncio.wait_for(main(), 60))
    assert again - ended >= STATS_COST_FACTOR * (ended - began)


def test_the_oldest_pending_gauge_is_an_index_probe_not_a_scan(dsn: str) -> None:
    """Its value is the longest-due pending effect's wait; its plan reads the claim index only.

    Regression: ``min(created_at)`` over every pending row, a scan of the backlog
    (0.3 s at a million rows, every few seconds).
    """
    import psycopg
    from sqlalchemy.dialects import postgresql

    from outbox.storage.sql.maintenance import oldest_pending_age

    sql = str(
        oldest_pending_age().compile(
            dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True}
        )
    )
    insert = (
        "INSERT INTO outbox_effects (id, shard, kind, payload, payload_hash, idempotency_key,"
        " status, available_at, fairness_key) SELECT i, outbox_shard_of(i), %s, '{}', md5('{}'),"
        " md5(random()::text || g), 'pending', now() + %s * interval '1 second', %s"
        " FROM (SELECT gen_random_uuid() AS i, g FROM generate_series(1, %s) AS g) AS s"
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(insert, ("k.big", 0, "", 20_000))
        conn.execute(insert, ("k.big", -600, "tenant-b", 1))  # due ten minutes ago
        conn.execute(insert, ("k.later", 3600, "", 50))  # not due: no wait yet
        conn.execute("VACUUM ANALYZE outbox_effects")
        (age,) = conn.execute(sql).fetchone() or (None,)
        assert 599 <= float(age) < 660
        plan = "\n".join(row[0] for row in conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql))
    assert "Seq Scan" not in plan, plan
    buffers = sum(int(n) for n in re.findall(r"shared hit=(\d+)", plan.split("Planning")[0]))
    assert buffers < 200, plan  # a scan of 20,000 index entries reads far more
