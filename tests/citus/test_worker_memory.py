"""A worker's sessions keep a bounded memory however many steps they write.

Citus 14.0.1 adds a copy of a shard's plan to a kept (generic) plan each time it
runs on the node holding the shard, and never finds it again (citusdata/citus
pull request 8824): about 100 kB a step in every session the coordinator keeps
open to a worker, which grows until the server runs out of memory. The step's
writes on a worker are planned per call instead (``outbox_write_step_apart``), or
go to the worker's own copies of the shards by statements prepared once a session
(``outbox_prepare_placements``: four a shard, plans of plain tables, which do not
grow).
The same holds for the triggers that run on a worker's shards as a deliverer
completes (a costed effect settles its run's budget). These tests write steps
and deliver effects through the coordinator, as clients and deliverers do, and
read the private memory of every session on the workers before and after.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from deliverers.testing import RecordingDeliverer
from outbox import Outbox, Run, StepTransaction
from tests.citus.test_single_shard import distributed_and_guarded
from tests.citus_support import CitusDatabase
from tests.support import DaemonThread, wait_for

KIND = "k.memory"
#: A session's private memory may grow this much over a segment (caches warming up);
#: the leak this guards against grew a session by 30-100 MB over the same steps.
ALLOWED_GROWTH_MB = 6.0


def _private_mb(pid: int) -> float | None:
    """The session's private memory (RssAnon, not the shared buffers it touches), in MB."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return None
    for line in status.splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return None


def _worker_sessions(database: CitusDatabase) -> dict[tuple[str, int], float]:
    """Each worker's client sessions in ``database`` (the coordinator's among them), by pid."""
    found: dict[tuple[str, int], float] = {}
    for worker in database.workers:
        with psycopg.connect(worker, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                " AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
            ).fetchall()
        for (pid,) in rows:
            mb = _private_mb(pid)
            if mb is not None:
                found[(worker, pid)] = mb
    return found


def _growth(
    database: CitusDatabase,
    runs: list[Run],
    steps: int,
    body: Callable[[StepTransaction, int], None],
) -> dict[tuple[str, int], float]:
    """MB each worker session grew by while ``runs`` wrote ``steps`` steps of ``body``."""
    before = _worker_sessions(database)
    _write(runs, steps, body)
    after = _worker_sessions(database)
    return {session: after[session] - mb for session, mb in before.items() if session in after}


def _assert_bounded(grown: dict[tuple[str, int], float]) -> None:
    assert grown, "no session on the workers was seen both before and after"
    assert max(grown.values()) < ALLOWED_GROWTH_MB, {
        f"port {conninfo_to_dict(dsn).get('port')} pid {pid}": round(mb, 1)
        for (dsn, pid), mb in grown.items()
    }


def _write(runs: list[Run], steps: int, body: Callable[[StepTransaction, int], None]) -> None:
    prefix = uuid.uuid4().hex[:8]
    for n in range(steps):
        runs[n % len(runs)].transaction(f"{prefix}-{n}", functools.partial(_step, body, n))


def _step(body: Callable[[StepTransaction, int], None], n: int, tx: StepTransaction) -> None:
    body(tx, n)


def _one_intent(tx: StepTransaction, n: int) -> None:
    tx.intend(KIND, {"n": n})


def _keyed_intent(tx: StepTransaction, n: int) -> None:
    # a caller's key lives on its own shard: taken first, then checked on the run's
    tx.intend(KIND, {"n": n}, key=f"memory-{uuid.uuid4()}")


@pytest.fixture(scope="module")
def runs(citus_module_db: CitusDatabase) -> Iterator[list[Run]]:
    ob = Outbox.connect(distributed_and_guarded(citus_module_db), pool_size=3)
    started = [ob.start_run("memory", "1") for _ in range(2)]
    # every session on the workers opened and warmed (catalog caches, shards met)
    _growth(citus_module_db, started, 200, _one_intent)
    _growth(citus_module_db, started, 200, _keyed_intent)
    yield started
    ob.close()


@pytest.mark.parametrize(
    ("body", "steps"),
    [(_one_intent, 1000), (_keyed_intent, 1200)],
    ids=["one intent", "a caller's key"],
)
def test_a_workers_sessions_do_not_grow_with_the_steps_they_write(
    citus_module_db: CitusDatabase,
    runs: list[Run],
    body: Callable[[StepTransaction, int], None],
    steps: int,
) -> None:
    _assert_bounded(_growth(citus_module_db, runs, steps, body))


def _ten_costed_intents(tx: StepTransaction, n: int) -> None:
    for i in range(10):
        tx.intend(KIND, {"n": n, "i": i}, cost=1)


def test_a_workers_sessions_do_not_grow_with_the_costed_effects_they_complete(
    citus_module_db: CitusDatabase,
    runs: list[Run],  # (the schema distributed, the steps' sessions warmed)
) -> None:
    # each completion settles its run's budget: a trigger on the effect's shard
    # updates the run and writes a ledger row, from PL/pgSQL on the worker
    ob = Outbox.connect(citus_module_db.dsn, pool_size=2)
    try:
        budgeted = [ob.start_run("memory", "1", budget=1_000_000) for _ in range(4)]
        _write(budgeted, 300, _ten_costed_intents)
    finally:
        ob.close()
    deliverer = RecordingDeliverer(KIND)
    with DaemonThread(citus_module_db.dsn, {KIND: deliverer}, batch_size=100, poll_seconds=0.05):
        # the deliverer's sessions on the workers open, and warm, with the first ones
        wait_for(lambda: len(deliverer.deliveries) >= 600, timeout=120, message="600 delivered")
        before = _worker_sessions(citus_module_db)
        wait_for(lambda: len(deliverer.deliveries) >= 3000, timeout=240, message="all delivered")
        after = _worker_sessions(citus_module_db)
    _assert_bounded({s: after[s] - mb for s, mb in before.items() if s in after})
