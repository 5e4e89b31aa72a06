"""Commit → handler start, beside Procrastinate's defer → job start, measured alike.

A writer process commits one item every 10 ms (after 20 unmeasured): for the
outbox a step with one intent (``run.transaction``), delivered by a
``DeliveryDaemon`` in this process (:class:`StartTimes` records each start) or by
an ``outbox deliver`` process (:func:`bench.sinks.record_start`); for
Procrastinate ``defer`` through its synchronous API, one worker process. All
with default settings (LISTEN/NOTIFY, 1 s poll backstop). The three take
turns, one repetition each, so a disturbance hits all of them alike, and the
targets judge each repetition's pair (``paired``: the outbox's p50 and p99 over
Procrastinate's, the same repetition), as the stream and Citus sections do.
Clock: ``time.time()`` when the commit call returns and when the handler starts.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import time
from collections.abc import Callable
from multiprocessing.connection import Connection as PipeEnd
from pathlib import Path
from typing import Any

import psycopg

from bench import delivery
from bench.harness import (
    Bench,
    importable,
    latency_figures,
    log,
    percentile,
    run_python,
    spawn_python,
    summarize,
    summary,
)
from bench.processes import DelivererProcess
from bench.sinks import LATENCY_KIND, LATENCY_LOG_ENV
from outbox import Outbox, StepTransaction
from outbox.delivery import Deliverer, Delivery, Outcome, Succeeded
from outbox.delivery.settings import DeliverySettings

RATE = 100.0
WARMUP = 20


class StartTimes(Deliverer):
    """Records when each delivery starts (``time.time()``), by the payload's ``i``."""

    default_idempotent = True

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.started: dict[int, float] = {}

    async def deliver(self, delivery: Delivery) -> Outcome:
        self.started[int(delivery.payload["i"])] = time.time()
        return Succeeded()


def writer(dsn: str, seconds: float, pipe: PipeEnd) -> None:
    """Child process: commit one step with one intent every 1/RATE s; send the commit times."""
    with Outbox.connect(dsn) as ob:
        run = ob.start_run(agent="bench-latency", version="1")
        commits: list[tuple[int, float, float]] = []
        begin = time.perf_counter()
        for i in range(WARMUP + round(RATE * seconds)):
            time.sleep(max(0.0, begin + i / RATE - time.perf_counter()))
            before = time.time()

            def step(tx: StepTransaction, i: int = i) -> None:
                tx.intend(LATENCY_KIND, {"i": i})

            run.transaction(f"s{i}", step)
            commits.append((i, before, time.time()))
        pipe.send(commits)
    pipe.close()


def _write(bench: Bench, seconds: float) -> list[tuple[int, float, float]]:
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=writer, args=(bench.dsn, seconds, send))
    child.start()
    send.close()
    commits: list[tuple[int, float, float]] = receive.recv()
    child.join(30)
    return commits


def _figures(
    commits: list[tuple[int, float, float]], started: Callable[[], dict[int, float]]
) -> dict[str, Any]:
    """Wait (30 s at most) until every item started; latencies of the measured ones."""
    deadline = time.monotonic() + 30
    while len(found := started()) < len(commits) and time.monotonic() < deadline:
        time.sleep(0.05)
    measured = [(i, c) for i, _, c in commits if i >= WARMUP]
    missing = [i for i, _ in measured if i not in found]
    delivery.check(not missing, f"{len(missing)} items never started within 30 s")
    figures = latency_figures([1000 * (found[i] - c) for i, c in measured])
    figures["writer_tx_p50_ms"] = percentile([1000 * (c - b) for i, b, c in commits], 50)
    return figures


def daemon_rep(bench: Bench, seconds: float) -> dict[str, Any]:
    bench.reset(runs=True)
    starts = StartTimes(LATENCY_KIND)
    with delivery.DaemonRunner(bench.dsn, {LATENCY_KIND: starts}, DeliverySettings()) as runner:
        time.sleep(1.5)  # warm: connected, listening, back to the 1 s idle poll
        runner.probe.arm(-1)
        out = _figures(_write(bench, seconds), lambda: dict(starts.started))
    # The daemon's claims that found rows (one autocommit statement each): part of every latency.
    claims = [1000 * d for d in runner.probe.claim_durations] or [0.0]
    out.update(claim_tx_p50_ms=percentile(claims, 50), claim_tx_p99_ms=percentile(claims, 99))
    return out


def process_rep(bench: Bench, workdir: Path, seconds: float) -> dict[str, Any]:
    bench.reset(runs=True)
    path = workdir / f"latency-{time.monotonic_ns()}.log"
    env = {LATENCY_LOG_ENV: str(path)}
    proc = DelivererProcess(bench, workdir, LATENCY_KIND, name="latency", env=env).wait_started()
    try:
        time.sleep(1.5)  # as for the in-process daemon: settled into its idle poll

        def started() -> dict[int, float]:
            with contextlib.suppress(OSError):
                return {int(i): float(t) for i, t in map(str.split, path.read_text().splitlines())}
            return {}

        return _figures(_write(bench, seconds), started)
    finally:
        proc.stop()


def procrastinate_rep(dsn: str, seconds: float) -> dict[str, Any]:
    total = WARMUP + round(RATE * seconds)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE procrastinate_jobs, procrastinate_events CASCADE")
    jobs = ["-m", "bench.procrastinate_jobs", dsn]
    worker = spawn_python([*jobs, "worker", "--expect", str(total)])
    try:
        deadline = time.monotonic() + 60
        while not _listening(dsn):
            delivery.check(worker.poll() is None and time.monotonic() < deadline, "no worker")
            time.sleep(0.05)
        time.sleep(1.5)  # as for the outbox: settled into its idle wait
        args = ["writer", "--rate", str(RATE), "--seconds", str(seconds), "--warmup", str(WARMUP)]
        commits = [(i, c, c) for i, c in run_python([*jobs, *args], timeout=seconds + 120)]
        out, err = worker.communicate(timeout=60)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    delivery.check(worker.returncode == 0, f"procrastinate worker failed:\n{err[-3000:]}")
    started = {int(k): v for k, v in json.loads(out.strip().splitlines()[-1]).items()}
    figures = _figures(commits, lambda: started)
    del figures["writer_tx_p50_ms"]  # defer's own time is not measured apart
    return figures


def _listening(dsn: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND query LIKE 'LISTEN %%'"
        ).fetchone()
    return bool(row and row[0])


def latency(bench: Bench, workdir: Path, quick: bool) -> dict[str, Any]:
    seconds, reps = (3.0, 2) if quick else (10.0, 3)
    systems: dict[str, Callable[[], dict[str, Any]]] = {
        "outbox": lambda: daemon_rep(bench, seconds),
        "outbox_process": lambda: process_rep(bench, workdir, seconds),
    }
    if importable("procrastinate") is None:
        dsn = delivery.procrastinate_setup(bench)
        systems["procrastinate"] = lambda: procrastinate_rep(dsn, seconds)
    got: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
    for rep in range(reps):
        for name, measure in systems.items():
            got[name].append(measure())
        log(
            f"latency rep {rep + 1}: "
            + "; ".join(
                f"{k} p50 {v[-1]['p50_ms']:.2f} p99 {v[-1]['p99_ms']:.2f} ms"
                for k, v in got.items()
            )
        )
    out: dict[str, Any] = {"rate_per_s": RATE, "seconds": seconds}
    if theirs := got.get("procrastinate"):
        out["paired"] = {
            name: {
                q: summary(
                    [ours[q] / other[q] for ours, other in zip(got[name], theirs, strict=True)]
                )
                for q in ("p50_ms", "p99_ms")
            }
            for name in ("outbox", "outbox_process")
        }
    for name, figures in got.items():
        pooled = [x for f in figures for x in f.pop("latencies_ms")]
        out[name] = {"per_rep": summarize(figures), "pooled": latency_figures(pooled)}
        del out[name]["pooled"]["latencies_ms"]
    return out
