"""Deliverer *processes* (``python -m outbox deliver``): drain rate, recovery, memory.

Each section starts real ``outbox deliver`` subprocesses against the benchmark
database, serving the no-op (or slow) ``python.call`` kinds of :mod:`bench.noop`,
and watches the database (never the processes' logs) to time them:

- drain: one and two processes, warm, drain a backlog committed at once (with
  a NOTIFY); the clock runs from that commit to the last ``completed_at``.
- recovery: a process with ``--lease 10`` is killed with SIGKILL while it holds
  in-flight effects of a slow sink; another is started at once; the clock runs
  from the kill to the moment every effect the dead one held has succeeded again.
- latency: commit -> handler start through an ``outbox deliver`` process (the
  writer of ``bench.delivery``'s latency section, a handler that logs its start).
- memory: peak RSS (sampled with psutil, and the kernel's ``VmHWM``) of one
  process draining a small and a large backlog.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from bench.delivery import (
    BACKLOG_INSERT,
    Bench,
    Meter,
    latency_figures,
    latency_writer,
    log,
    summary,
)
from bench.noop import (
    LATENCY_KIND,
    LATENCY_LOG_ENV,
    NOOP_KIND,
    SINK_LOG_ENV,
    SLOW_KIND,
    SLOW_SECONDS,
    deliverers_config,
)

REPO = Path(__file__).resolve().parent.parent


# -- a deliverer subprocess -------------------------------------------------------------


class RssSampler:
    """Samples the resident set size of one process every ``interval`` seconds."""

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        self.process = psutil.Process(pid)
        self.interval = interval
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                rss = self.process.memory_info().rss
            except psutil.Error:
                return
            self.peak = max(self.peak, rss)
            self.samples += 1
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def vm_hwm(pid: int) -> int | None:
    """The kernel's peak resident set size of ``pid`` in bytes (``VmHWM``), if readable."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


class Deliverer:
    """One ``python -m outbox deliver`` subprocess (stderr goes to a log file)."""

    def __init__(
        self,
        bench: Bench,
        workdir: Path,
        kind: str,
        *,
        name: str,
        lease: float | None = None,
        concurrency: int | None = None,
        env: dict[str, str] | None = None,
        sample_rss: bool = False,
    ) -> None:
        config = deliverers_config(workdir / "deliverers.toml")
        self.log_path = workdir / f"{name}.log"
        args = [sys.executable, "-m", "outbox", "deliver", "--config", str(config)]
        args += ["--kind", kind]
        if lease is not None:
            args += ["--lease", str(lease)]
        if concurrency is not None:
            args += ["--concurrency", str(concurrency)]
        environ = dict(os.environ)
        environ["OUTBOX_DSN"] = bench.dsn
        environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO), environ.get("PYTHONPATH", "")) if p
        )
        environ.update(env or {})
        self._log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            args, cwd=REPO, env=environ, stdout=self._log, stderr=subprocess.STDOUT
        )
        self.pid = self.process.pid
        self.ps = psutil.Process(self.pid)
        self.rss = RssSampler(self.pid) if sample_rss else None

    def cpu_seconds(self) -> float:
        with contextlib.suppress(psutil.Error):
            times = self.ps.cpu_times()
            return float(times.user + times.system)
        return 0.0

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill9(self) -> float:
        """SIGKILL; returns ``time.time()`` just before the signal."""
        when = time.time()
        os.kill(self.pid, signal.SIGKILL)
        self.process.wait(10)
        return when

    def stop(self) -> None:
        if self.rss is not None:
            self.rss.stop()
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(40)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()

    def tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


def start_deliverers(
    bench: Bench, workdir: Path, kind: str, count: int, **options: Any
) -> list[Deliverer]:
    """Start ``count`` deliverer processes and wait until each one is listening."""
    procs = [
        Deliverer(
            bench, workdir, kind, name=f"deliver-{kind}-{i}-{uuid.uuid4().hex[:4]}", **options
        )
        for i in range(count)
    ]
    try:
        wait_listening(procs)
    except BaseException:
        stop_all(procs)
        raise
    return procs


def stop_all(procs: list[Deliverer]) -> None:
    for proc in procs:
        proc.stop()


def wait_listening(procs: list[Deliverer], timeout: float = 60.0) -> None:
    """Wait until every process logged its start banner (it then claims at once).

    Not by its LISTEN session: ``outbox deliver`` hands the SQLAlchemy URL
    (``postgresql+psycopg://``) to psycopg for LISTEN, which refuses it, so the
    CLI daemon runs on its poll alone (see the report); the benchmark measures
    what the command does.
    """
    deadline = time.monotonic() + timeout
    for proc in procs:
        while "delivering kinds" not in proc.tail(50):
            if not proc.alive():
                raise RuntimeError(f"deliverer {proc.pid} exited:\n{proc.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"deliverer {proc.pid} did not start within {timeout:.0f} s")
            time.sleep(0.05)


def listen_works(procs: list[Deliverer]) -> bool:
    """False when a process logged that its LISTEN connection failed."""
    return not any("LISTEN outbox_effects connection lost" in p.tail(200) for p in procs)


def open_count(bench: Bench, kind: str) -> int:
    """Effects of ``kind`` not finished yet."""
    with bench.connect() as conn:
        row = conn.execute(
            "SELECT count(*) FROM outbox_effects "
            "WHERE kind = %s AND status IN ('pending', 'in_flight')",
            [kind],
        ).fetchone()
    return int(row[0]) if row else 0


def wait_drained(
    bench: Bench, kind: str, procs: list[Deliverer], timeout: float, poll: float = 0.1
) -> float:
    """Wait until no effect of ``kind`` is open; return the last ``completed_at`` (epoch s)."""
    deadline = time.monotonic() + timeout
    while open_count(bench, kind) > 0:
        for proc in procs:
            if not proc.alive():
                raise RuntimeError(f"deliverer {proc.pid} exited:\n{proc.tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{kind} not drained within {timeout:.0f} s")
        time.sleep(poll)
    with bench.connect() as conn:
        row = conn.execute(
            "SELECT extract(epoch FROM max(completed_at))::float8, count(*) FILTER "
            "(WHERE status <> 'succeeded') FROM outbox_effects WHERE kind = %s",
            [kind],
        ).fetchone()
    assert row is not None
    if row[1]:
        raise RuntimeError(f"{row[1]} effects of {kind} did not succeed")
    return float(row[0])


def insert_backlog(bench: Bench, n: int, kind: str, *, chunk: int = 250_000) -> None:
    """Insert ``n`` pending effects of ``kind`` (committed, in chunks) and ANALYZE."""
    with bench.connect() as conn:
        done = 0
        while done < n:
            step = min(chunk, n - done)
            conn.execute(BACKLOG_INSERT, {"kind": kind, "tag": uuid.uuid4().hex, "n": step})
            done += step
        conn.execute("ANALYZE outbox_effects")


def attempts_by_worker(bench: Bench) -> dict[str, int]:
    with bench.connect() as conn:
        rows = conn.execute(
            "SELECT worker, count(*) FROM outbox_effect_attempts GROUP BY worker"
        ).fetchall()
    return {str(w): int(n) for w, n in rows}


# -- 1. drain rate of one and of two processes --------------------------------------------


def first_start(bench: Bench, kind: str) -> float:
    with bench.connect() as conn:
        row = conn.execute(
            "SELECT extract(epoch FROM min(attempt_started_at))::float8 FROM outbox_effects "
            "WHERE kind = %s",
            [kind],
        ).fetchone()
    assert row is not None and row[0] is not None
    return float(row[0])


def drain_rep(bench: Bench, procs: list[Deliverer], n: int) -> dict[str, Any]:
    bench.reset()
    time.sleep(1.2)  # back to their idle poll (1 s at most)
    cpu_before = [p.cpu_seconds() for p in procs]
    meter = Meter()
    with bench.backlog(n) as conn, meter.measure():
        committed = time.time()
        conn.commit()
        finished = wait_drained(bench, NOOP_KIND, procs, timeout=900)
    began = first_start(bench, NOOP_KIND)
    deliverer_cpu = sum(p.cpu_seconds() - c for p, c in zip(procs, cpu_before, strict=True))
    by_worker = attempts_by_worker(bench)
    return {
        # From the first claim to the last completion: the drain itself.
        "rate": n / (finished - began),
        # From the backlog's commit (which carries a NOTIFY) to the last completion.
        "rate_from_commit": n / (finished - committed),
        "wakeup_ms": 1000 * (began - committed),
        "deliverer_cpu_us_per_effect": 1e6 * deliverer_cpu / n,
        # The rest of the machine's busy CPU: PostgreSQL (and this process's polling).
        "other_cpu_us_per_effect": 1e6 * max(0.0, meter.server_cpu - deliverer_cpu) / n,
        "share_of_busiest": max(by_worker.values()) / max(1, sum(by_worker.values())),
    }


#: (label, processes, --concurrency): the default, two processes, and one process with
#: room for two batches in flight (a claim overlaps the previous batch's completion).
PROCESS_VARIANTS: tuple[tuple[str, int, int | None], ...] = (
    ("1", 1, None),
    ("2", 2, None),
    ("1_concurrency_200", 1, 200),
)


def processes_section(bench: Bench, workdir: Path, n: int, reps: int) -> dict[str, Any]:
    out: dict[str, Any] = {"n": n}
    for label, count, concurrency in PROCESS_VARIANTS:
        procs = start_deliverers(bench, workdir, NOOP_KIND, count, concurrency=concurrency)
        try:
            drain_rep(bench, procs, min(n, 2000))  # warm: imports, connections, plans
            got = [drain_rep(bench, procs, n) for _ in range(reps)]
            out["listen_works"] = listen_works(procs)
        finally:
            stop_all(procs)
        out[label] = {key: summary([g[key] for g in got]) for key in got[0]}
        log(
            f"deliverer processes {label}, {n} effects: "
            f"{out[label]['rate']['median']:.0f} effects/s "
            f"(wake-up after the commit {out[label]['wakeup_ms']['median']:.0f} ms)"
        )
    return out


# -- latency through a deliverer process ----------------------------------------------------


def process_latency_rep(
    bench: Bench, workdir: Path, rate: float, seconds: float, warmup: int = 20
) -> dict[str, Any]:
    bench.reset(runs=True)
    path = workdir / f"latency-{uuid.uuid4().hex[:6]}.log"
    proc = Deliverer(bench, workdir, LATENCY_KIND, name="latency", env={LATENCY_LOG_ENV: str(path)})
    try:
        wait_listening([proc])
        time.sleep(1.5)  # as for the in-process daemon: settled into its idle poll
        ctx = multiprocessing.get_context("spawn")
        receive, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=latency_writer, args=(bench.dsn, rate, seconds, warmup, send))
        child.start()
        send.close()
        commits: list[tuple[int, float, float]] = receive.recv()
        child.join(30)
        started: dict[int, float] = {}
        deadline = time.monotonic() + 30
        while len(started) < len(commits) and time.monotonic() < deadline:
            time.sleep(0.1)
            with contextlib.suppress(OSError):
                for line in path.read_text().splitlines():
                    i, when = line.split()
                    started[int(i)] = float(when)
        listened = listen_works([proc])
    finally:
        proc.stop()
    measured = [(i, c) for i, _, c in commits if i >= warmup]
    missing = [i for i, _ in measured if i not in started]
    if missing:
        raise RuntimeError(f"{len(missing)} intents were not delivered within 30 s")
    figures = latency_figures([1000 * (started[i] - c) for i, c in measured])
    return {**figures, "listen_works": listened}


# -- 2. recovery after kill -9 ---------------------------------------------------------------


@dataclass
class RecoveryRep:
    kill_to_redelivered_s: float
    kill_to_last_restart_s: float
    expiry_to_redelivered_s: float
    lease_left_at_kill_s: float
    held: int
    effects: int
    raw_sink_calls: int
    keys_called_twice: int
    resent_outside_held: int
    keys_missing_at_sink: int
    effects_succeeded_twice: int
    all_succeeded: bool


def _held_by(bench: Bench, pid: int) -> list[tuple[Any, float, str]]:
    """(id, lease expiry epoch, key) of the effects a deliverer process holds in flight."""
    with bench.connect() as conn:
        rows = conn.execute(
            "SELECT id, extract(epoch FROM lease_expires_at)::float8, idempotency_key "
            "FROM outbox_effects WHERE status = 'in_flight' AND lease_owner LIKE %s",
            [f"%:{pid}:%"],
        ).fetchall()
    return [(r[0], float(r[1]), str(r[2])) for r in rows]


def recovery_rep(bench: Bench, workdir: Path, lease: float, backlog: int) -> RecoveryRep:
    bench.reset()
    sink_log = workdir / f"sink-{uuid.uuid4().hex[:6]}.log"
    env = {SINK_LOG_ENV: str(sink_log)}
    insert_backlog(bench, backlog, SLOW_KIND)
    victim = Deliverer(bench, workdir, SLOW_KIND, name="victim", lease=lease, env=env)
    rescuer: Deliverer | None = None
    try:
        # Wait until the victim holds its first batch, then kill it mid-call.
        deadline = time.monotonic() + 60
        while not _held_by(bench, victim.pid):
            if not victim.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the victim never claimed:\n{victim.tail()}")
            time.sleep(0.01)
        time.sleep(SLOW_SECONDS / 2)
        killed_at = victim.kill9()
        held = _held_by(bench, victim.pid)
        if not held:
            raise RuntimeError("the victim held nothing when it was killed")
        ids = [row[0] for row in held]
        held_keys = {row[2] for row in held}
        expires = max(row[1] for row in held)
        rescuer = Deliverer(bench, workdir, SLOW_KIND, name="rescuer", lease=lease, env=env)
        deadline = time.monotonic() + 10 * lease + 60
        while True:
            with bench.connect() as conn:
                row = conn.execute(
                    "SELECT count(*) FILTER (WHERE status = 'succeeded'), "
                    "extract(epoch FROM max(completed_at))::float8, "
                    "extract(epoch FROM max(attempt_started_at))::float8 "
                    "FROM outbox_effects WHERE id = ANY(%s)",
                    [ids],
                ).fetchone()
            assert row is not None
            if row[0] == len(ids):
                redelivered, restarted = float(row[1]), float(row[2])
                break
            if not rescuer.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the held effects were not redelivered:\n{rescuer.tail()}")
            time.sleep(0.02)
        wait_drained(bench, SLOW_KIND, [rescuer], timeout=120)
    finally:
        victim.stop()
        if rescuer is not None:
            rescuer.stop()
    calls = Counter(line.split()[1] for line in sink_log.read_text().splitlines() if line.strip())
    twice = {key for key, count in calls.items() if count > 1}
    with bench.connect() as conn:
        doubled = conn.execute(
            "SELECT count(*) FROM (SELECT effect_id FROM outbox_effect_attempts "
            "WHERE outcome = 'succeeded' GROUP BY effect_id HAVING count(*) > 1) AS t"
        ).fetchone()
        keys = {
            str(r[0])
            for r in conn.execute(
                "SELECT idempotency_key FROM outbox_effects "
                "WHERE kind = %s AND status = 'succeeded'",
                [SLOW_KIND],
            ).fetchall()
        }
    return RecoveryRep(
        kill_to_redelivered_s=redelivered - killed_at,
        kill_to_last_restart_s=restarted - killed_at,
        expiry_to_redelivered_s=redelivered - expires,
        lease_left_at_kill_s=expires - killed_at,
        held=len(ids),
        effects=backlog,
        raw_sink_calls=sum(calls.values()),
        keys_called_twice=len(twice),
        resent_outside_held=len(twice - held_keys),
        keys_missing_at_sink=len(keys - set(calls)),
        effects_succeeded_twice=int(doubled[0]) if doubled else -1,
        all_succeeded=len(keys) == backlog,
    )


def recovery_section(
    bench: Bench, workdir: Path, reps: int, lease: float = 10.0, backlog: int = 192
) -> dict[str, Any]:
    got = []
    for rep in range(reps):
        r = recovery_rep(bench, workdir, lease, backlog)
        log(
            f"recovery rep {rep + 1}: {r.held} held, kill -> redelivered "
            f"{r.kill_to_redelivered_s:.2f} s (lease left at kill {r.lease_left_at_kill_s:.2f} s)"
        )
        got.append(r)
    numeric = (
        "kill_to_redelivered_s",
        "kill_to_last_restart_s",
        "expiry_to_redelivered_s",
        "lease_left_at_kill_s",
        "held",
        "raw_sink_calls",
        "keys_called_twice",
    )
    out: dict[str, Any] = {key: summary([float(getattr(r, key)) for r in got]) for key in numeric}
    out.update(
        lease_s=lease,
        backlog=backlog,
        sink_seconds=SLOW_SECONDS,
        effects_succeeded_twice=max(r.effects_succeeded_twice for r in got),
        resent_outside_held=max(r.resent_outside_held for r in got),
        keys_missing_at_sink=max(r.keys_missing_at_sink for r in got),
        all_succeeded=all(r.all_succeeded for r in got),
    )
    return out


# -- 3. memory ---------------------------------------------------------------------------


def memory_rep(bench: Bench, workdir: Path, n: int) -> dict[str, Any]:
    bench.reset()
    insert_backlog(bench, n, NOOP_KIND)
    with bench.connect() as conn:
        conn.execute("CHECKPOINT")
    started = time.time()
    proc = Deliverer(bench, workdir, NOOP_KIND, name=f"memory-{n}", sample_rss=True)
    try:
        finished = wait_drained(bench, NOOP_KIND, [proc], timeout=3600, poll=0.5)
        hwm = vm_hwm(proc.pid)
        assert proc.rss is not None
        proc.rss.stop()
        peak, samples = proc.rss.peak, proc.rss.samples
    finally:
        proc.stop()
    return {
        "n": n,
        "peak_rss_mb": peak / 2**20,
        "vm_hwm_mb": (hwm or 0) / 2**20,
        "rss_samples": samples,
        "seconds": finished - started,
        # From process start (imports and connecting included) to the last completion.
        "rate": n / (finished - started),
    }


def memory_section(bench: Bench, workdir: Path, sizes: tuple[int, int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n in sizes:
        out[str(n)] = memory_rep(bench, workdir, n)
        log(
            f"memory, backlog {n}: peak RSS {out[str(n)]['peak_rss_mb']:.1f} MB "
            f"(VmHWM {out[str(n)]['vm_hwm_mb']:.1f} MB), {out[str(n)]['rate']:.0f} effects/s"
        )
    small, large = (out[str(n)] for n in sizes)
    out["ratio"] = large["vm_hwm_mb"] / small["vm_hwm_mb"] if small["vm_hwm_mb"] else None
    bench.reset()
    return out
