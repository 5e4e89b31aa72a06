"""A busy daemon's background duties ride its batches: about one commit per batch.

And the lease renewals that ride are real renewals: a call that outlasts its
lease lives on through them.

Counted on the real server: ``pg_stat_database.xact_commit`` of the test's
database over the daemon's whole life (a backend's counts reach it at the
latest when the backend exits, and the daemon's engine is disposed before the
count is read). Batches are counted from what the claims wrote: every claim
transaction stamps its rows' ``attempt_started_at`` with its own ``now()``.
Counting is deterministic; nothing here asserts a duration.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any
from uuid import UUID

import psycopg
import pytest

from outbox import Outbox
from outbox.delivery import Deliverer, Delivery, Outcome, Succeeded
from outbox.delivery.daemon import DeliveryDaemon
from outbox.delivery.settings import DeliverySettings
from outbox.storage.async_store import AsyncStore
from outbox.storage.dsn import libpq_dsn
from outbox.storage.engine import make_async_engine
from tests.support import DaemonThread, wait_for

KIND = "test.slow"
N = 3000


class SlowSink(Deliverer):
    """An idempotent sink whose every call takes a few milliseconds (no thread per call)."""

    default_idempotent = True

    async def deliver(self, delivery: Delivery) -> Outcome:
        await asyncio.sleep(0.01)
        return Succeeded()


class Reader:
    """One autocommit session that reads, and counts its own commits (one per read)."""

    def __init__(self, dsn: str) -> None:
        self.conn = psycopg.connect(libpq_dsn(dsn), autocommit=True)
        self.reads = 0

    def value(self, sql: str) -> Any:
        self.reads += 1
        row = self.conn.execute(sql).fetchone()
        assert row is not None
        return row[0]

    def commits(self) -> int:
        """Committed transactions of this database, as far as they are reported yet."""
        sql = "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        self.conn.execute("SELECT pg_stat_force_next_flush()")  # our own counts, now
        self.reads += 1
        return int(self.value(sql))


@pytest.mark.parametrize(
    "idle_kinds",
    [
        pytest.param(0, id="one-kind"),
        # A kind with nothing to deliver beside the busy one: its unused quota must not
        # send the claim loop into its idle backoff (and the outcomes out of riding).
        pytest.param(1, id="beside-an-idle-kind"),
    ],
)
def test_background_duties_ride_the_batches(ob: Outbox, dsn: str, idle_kinds: int) -> None:
    run = ob.start_run("agent", "1")
    run.transaction("s", lambda tx: [tx.intend(KIND, {"i": i}) for i in range(N)] and None)
    ob.close()
    # Rounds much more frequent than the defaults: run on their own, as before, the
    # reconciler's and the gone-owner check's statements would add about 20
    # commits a second, several tenths of a commit per batch here.
    settings: dict[str, Any] = {
        "batch_size": 20,
        "concurrency": 20,
        "reconcile_seconds": 0.2,
        "gone_check_seconds": 0.2,
    }
    reader = Reader(dsn)
    try:
        time.sleep(1.1)  # what other backends committed so far is reported by now
        before, reads_before = reader.commits(), reader.reads
        sinks = {KIND: SlowSink(KIND)} | {
            f"test.idle{i}": SlowSink(f"test.idle{i}") for i in range(idle_kinds)
        }
        with DaemonThread(dsn, sinks, **settings):
            wait_for(
                lambda: (
                    reader.value("SELECT count(*) FROM outbox_effects WHERE status = 'succeeded'")
                    == N
                ),
                timeout=120,
                interval=0.1,
                message="all delivered",
            )
        # The daemon's backends have exited, so their counts are all reported.
        during = reader.commits() - before - (reader.reads - reads_before)
        batches = reader.value("SELECT count(DISTINCT started_at) FROM outbox_effect_attempts")
        attempts = reader.value("SELECT count(*) FROM outbox_effect_attempts")
    finally:
        reader.conn.close()
    assert attempts == N  # each delivered once: nothing expired or was put back
    assert batches >= N / 20
    # The daemon's whole life counts, its start and stop included: a fixed handful of
    # commits, which weigh more per batch when a loaded machine makes fewer, fuller
    # batches (CI once: 184 commits for 150 batches). Duties run apart, as before,
    # would add several tenths of a commit to every batch.
    per_batch = during / batches
    shown = f"{during} commits for {batches} batches: {per_batch:.2f} per batch"
    assert during <= 1.2 * batches + 10, shown


class CountingStore(AsyncStore):
    """The real store, noting which lease renewals rode a batch and which ran alone."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.rode: list[int] = []
        self.alone: list[int] = []

    async def complete_and_claim(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("extend"):
            self.rode.append(len(kwargs["extend"]))
        return await super().complete_and_claim(*args, **kwargs)

    async def extend(self, spec: Any, held: Any, **kwargs: Any) -> set[UUID]:
        if held:
            self.alone.append(len(held))
        return await super().extend(spec, held, **kwargs)


class SomeLong(Deliverer):
    """An idempotent sink: calls flagged ``long`` outlast the lease (they live by renewals)."""

    default_idempotent = True

    async def deliver(self, delivery: Delivery) -> Outcome:
        await asyncio.sleep(2.5 if delivery.payload.get("long") else 0.01)
        return Succeeded()


def test_held_leases_are_renewed_by_the_batches_while_busy(ob: Outbox, dsn: str) -> None:
    run = ob.start_run("agent", "1")
    payloads = [{"long": True, "i": i} for i in range(3)] + [{"i": i} for i in range(N)]
    run.transaction("s", lambda tx: [tx.intend(KIND, p) for p in payloads] and None)
    ob.close()
    # A lease of 1.2 s: a call of 2.5 s survives only if its lease is pushed out,
    # again and again, while the fast kind's batches flow past it.
    settings = DeliverySettings(lease_seconds=1.2, batch_size=20, concurrency=24)

    async def main() -> CountingStore:
        store = CountingStore(make_async_engine(dsn))
        daemon = DeliveryDaemon(store, {KIND: SomeLong(KIND)}, settings)
        task = asyncio.create_task(daemon.run())
        try:
            for _ in range(600):
                counts = await store.state_counts()
                if not any(s in ("pending", "in_flight") for s, _ in counts.effects):
                    break
                await asyncio.sleep(0.1)
        finally:
            daemon.stop()
            await task
            await store.dispose()
        return store

    store = asyncio.run(main())
    reader = Reader(dsn)
    try:
        attempts = reader.value(
            "SELECT array_agg(DISTINCT attempt) FROM outbox_effects WHERE payload ? 'long'"
        )
        statuses = reader.value("SELECT array_agg(DISTINCT status) FROM outbox_effects")
    finally:
        reader.conn.close()
    assert statuses == ["succeeded"]
    assert attempts == [1]  # never expired, never taken over: the leases were renewed
    assert store.rode, f"no renewal rode a batch transaction (alone: {store.alone})"
