"""A busy daemon's background duties ride its batches: about one commit per batch.

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

import psycopg

from outbox import Outbox
from outbox.delivery import Deliverer, Delivery, Outcome, Succeeded
from outbox.storage.engine import libpq_dsn
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


def test_background_duties_ride_the_batches(ob: Outbox, dsn: str) -> None:
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
        with DaemonThread(dsn, {KIND: SlowSink(KIND)}, **settings):
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
    # The daemon's whole life counts, its start and stop included (a few commits).
    per_batch = during / batches
    assert per_batch <= 1.2, f"{during} commits for {batches} batches: {per_batch:.2f} per batch"
