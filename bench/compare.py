"""The systems the targets compare against, on databases of the same server.

- Procrastinate 3.10: one worker draining N no-op jobs (the same N as the
  deliverer processes), and enqueue -> job start latency at the same trickle
  as the outbox's commit -> handler start (``bench.delivery`` section 3).
- DBOS Transact: no-op two-step workflows, steps/s = 2 x workflows/s.

Both run in subprocesses (:mod:`bench.procrastinate_jobs`, :mod:`bench.dbos_steps`)
with this benchmark's interpreter, so their process-global state stays out of
this one; the benchmark still measures them side by side on its one server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

from bench.delivery import Bench, latency_figures, log, pooled_figures, summary

REPO = Path(__file__).resolve().parent.parent
PROCRASTINATE_DB = "procrastinate_bench"
DBOS_DB = "dbos_bench"


def available(module: str) -> str | None:
    """None when ``module`` imports, else why not (the bench extra is not installed)."""
    done = subprocess.run(
        [sys.executable, "-c", f"import {module}"], capture_output=True, text=True, cwd=REPO
    )
    return None if done.returncode == 0 else done.stderr.strip().splitlines()[-1]


def create_database(bench: Bench, name: str) -> str:
    with psycopg.connect(bench.server.dsn("postgres"), autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")
    return bench.server.dsn(name)


def _child(args: list[str], timeout: float) -> Any:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    done = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:3])} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _spawn(args: list[str]) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )


# -- Procrastinate ------------------------------------------------------------------------


def procrastinate_setup(bench: Bench) -> str:
    dsn = create_database(bench, PROCRASTINATE_DB)
    _child(["-m", "bench.procrastinate_jobs", dsn, "schema"], timeout=120)
    return dsn


def procrastinate_drain_section(
    bench: Bench, n: int, reps: int, concurrencies: tuple[int, ...]
) -> dict[str, Any]:
    dsn = procrastinate_setup(bench)
    out: dict[str, Any] = {"n": n}
    for concurrency in concurrencies:
        got = _child(
            [
                "-m",
                "bench.procrastinate_jobs",
                dsn,
                "drain",
                "--n",
                str(n),
                "--concurrency",
                str(concurrency),
                "--reps",
                str(reps),
            ],
            timeout=3600,
        )
        out[str(concurrency)] = {key: summary([g[key] for g in got]) for key in got[0]}
        log(
            f"procrastinate worker (concurrency {concurrency}), {n} jobs: "
            f"{out[str(concurrency)]['rate']['median']:.0f} jobs/s"
        )
    return out


def _listening(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND query LIKE 'LISTEN %%'"
        ).fetchone()
    return int(row[0]) if row else 0


def procrastinate_latency_rep(dsn: str, rate: float, seconds: float, warmup: int) -> dict[str, Any]:
    total = warmup + round(rate * seconds)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE procrastinate_jobs, procrastinate_events CASCADE")
    worker = _spawn(["-m", "bench.procrastinate_jobs", dsn, "worker", "--expect", str(total)])
    try:
        deadline = time.monotonic() + 60
        while _listening(dsn) < 1:
            if worker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"procrastinate worker did not start: {worker.stderr}")
            time.sleep(0.05)
        time.sleep(1.5)  # as for the outbox daemon: settled into its idle wait
        commits = _child(
            [
                "-m",
                "bench.procrastinate_jobs",
                dsn,
                "writer",
                "--rate",
                str(rate),
                "--seconds",
                str(seconds),
                "--warmup",
                str(warmup),
            ],
            timeout=seconds + 120,
        )
        out, err = worker.communicate(timeout=60)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    if worker.returncode != 0:
        raise RuntimeError(f"procrastinate worker failed:\n{err[-3000:]}")
    started = {int(k): v for k, v in json.loads(out.strip().splitlines()[-1]).items()}
    measured = [(i, c) for i, c in commits if i >= warmup]
    missing = [i for i, _ in measured if i not in started]
    if missing:
        raise RuntimeError(f"{len(missing)} procrastinate jobs never started")
    return latency_figures([1000 * (started[i] - c) for i, c in measured])


def latency_summary(reps: list[dict[str, Any]], rate: float, seconds: float) -> dict[str, Any]:
    """Per-repetition figures (median, min-max) and the pooled distribution."""
    pooled = [x for r in reps for x in r.pop("latencies_ms")]
    numeric = [k for k, v in reps[0].items() if isinstance(v, int | float)]
    flags = {k: all(r[k] for r in reps) for k, v in reps[0].items() if isinstance(v, bool)}
    return {
        "rate_per_s": rate,
        "seconds": seconds,
        **flags,
        "per_rep": {k: summary([r[k] for r in reps]) for k in numeric if k not in flags},
        "pooled": pooled_figures(pooled),
    }


# -- DBOS -------------------------------------------------------------------------------------


def dbos_section(
    bench: Bench, threads: tuple[int, ...], seconds: float, reps: int
) -> dict[str, Any]:
    url = create_database(bench, DBOS_DB)
    got = _child(
        [
            "-m",
            "bench.dbos_steps",
            url,
            "--threads",
            ",".join(str(t) for t in threads),
            "--seconds",
            str(seconds),
            "--reps",
            str(reps),
        ],
        timeout=600 + len(threads) * reps * seconds,
    )
    out: dict[str, Any] = {"seconds": seconds}
    for count, runs in got.items():
        out[count] = {key: summary([r[key] for r in runs]) for key in runs[0]}
        log(
            f"DBOS {count} thread(s): {out[count]['steps_per_s']['median']:.0f} steps/s, "
            f"{out[count]['write_tx_per_workflow']['median']:.1f} write tx per workflow"
        )
    return out
