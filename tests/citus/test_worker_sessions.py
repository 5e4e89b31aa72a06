"""A deliverer's reads over many shards open no new sessions on the workers.

Citus runs a statement over many shards (the duty probe, the effect gauges) on up
to 16 new connections to each worker, each a new session on it (a process whose
caches load afresh), closed when the transaction ends. The database's
``citus.max_adaptive_executor_pool_size = 1`` (``outbox migrate --distribute``, and
every ``outbox migrate`` on a distributed database) keeps such a read on the one
session the coordinator keeps open to each worker: a drain of 4,000 effects opened
14 sessions on the workers instead of 48-58, and ran 10-20 % faster.
"""

from __future__ import annotations

import functools

import psycopg
from click.testing import CliRunner

from deliverers.testing import RecordingDeliverer
from outbox import Outbox, StepTransaction
from outbox.cli import cli as cli_main
from outbox.storage.citus import DATABASE_SETTINGS
from tests.citus_support import CitusDatabase
from tests.support import DaemonThread, wait_for

KIND = "k.sessions"
POOL = "citus.max_adaptive_executor_pool_size"


def _sessions(database: CitusDatabase) -> int:
    """Sessions opened so far on the workers in ``database``."""
    total = 0
    for worker in database.workers:
        with psycopg.connect(worker) as conn:
            row = conn.execute(
                "SELECT sessions FROM pg_stat_database WHERE datname = current_database()"
            ).fetchone()
        assert row is not None
        total += int(row[0])
    return total


def _pool_sizes(database: CitusDatabase) -> list[str]:
    sizes = []
    for node in (database.coordinator, *database.workers):
        with psycopg.connect(node) as conn:  # a new session: the database's settings
            row = conn.execute(f"SHOW {POOL}").fetchone()
        assert row is not None
        sizes.append(str(row[0]))
    return sizes


def _intend(tx: StepTransaction, n: int) -> None:
    tx.intend(KIND, {"n": n})


def test_a_plain_migrate_gives_every_node_the_databases_settings(
    dsn: str, citus_module_db: CitusDatabase
) -> None:
    """An upgrade brings a new setting: ``outbox migrate`` applies them every time."""
    assert f"{POOL} = 1" in DATABASE_SETTINGS
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT run_command_on_all_nodes(%s)",
            [f'ALTER DATABASE "{citus_module_db.name}" RESET {POOL}'],
        )
    assert _pool_sizes(citus_module_db) == ["16", "16", "16"]
    result = CliRunner().invoke(cli_main, ["migrate", "--json"], env={"OUTBOX_DSN": dsn})
    assert result.exit_code == 0, result.output
    assert _pool_sizes(citus_module_db) == ["1", "1", "1"]


def test_a_drain_opens_a_session_on_a_worker_per_connection_not_per_read(
    dsn: str, citus_module_db: CitusDatabase
) -> None:
    ob = Outbox.connect(dsn, pool_size=2)
    try:
        for r in range(4):
            run = ob.start_run("sessions", "1")
            for n in range(250):
                run.transaction(f"s{n}", functools.partial(_intend, n=r * 1000 + n))
    finally:
        ob.close()
    before = _sessions(citus_module_db)
    deliverer = RecordingDeliverer(KIND)
    # short rounds: the probe and the gauges read every shard many times meanwhile
    with DaemonThread(dsn, {KIND: deliverer}, batch_size=50, poll_seconds=0.05, stats_seconds=0.2):
        wait_for(lambda: len(deliverer.deliveries) >= 1000, timeout=120, message="all delivered")
    opened = _sessions(citus_module_db) - before
    # a session per worker for each of the daemon's connections to the coordinator
    # (and this test's own); without the setting the same drain opened 30-60
    assert opened <= 20, opened
