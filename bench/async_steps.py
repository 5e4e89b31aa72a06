"""Async steps per second: ``AsyncOutbox`` with 1 and 50 concurrent runs on one event loop,
beside the sync ``Outbox`` with 1 run and with 50 runs on 50 threads.

A step is ``run.transaction`` that sets the run's state and intends one
effect (the write benchmark's step). Every variant uses the same pool
(``pool_size`` 10, as many again in overflow) on the same server, side by
side, repeated and reported as the median (min-max). The client process's
CPU per step is its user+system time over the steps (PostgreSQL's is not in it).

    python -m bench.async_steps [--seconds 5] [--reps 3] [--json PATH]

With ``OUTBOX_DSN`` set it uses that server (a scratch database is created
and dropped); otherwise it starts an embedded PostgreSQL in a temporary
directory with default durability (fsync on) and removes it afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy.engine import make_url

from outbox import AsyncOutbox, AsyncStepTransaction, Outbox, StepTransaction
from outbox.storage.admin.embedded import EmbeddedServer
from outbox.storage.engine import make_engine
from outbox.storage.migrate import migrate

POOL = 10
DATABASE = "bench_async_steps"


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _waited() -> float:
    """Seconds this process's threads spent runnable but waiting for a CPU (Linux schedstat)."""
    total = 0
    for stat in Path("/proc/self/task").glob("*/schedstat"):
        try:
            total += int(stat.read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9


def sync_steps(dsn: str, runs: int, seconds: float) -> dict[str, float]:
    """``runs`` threads, each stepping its own run with the sync client."""
    with Outbox.connect(dsn, pool_size=POOL) as ob:
        handles = [ob.start_run("bench", "1", {}) for _ in range(runs)]
        counts = [0] * runs
        stop = threading.Event()

        def work(i: int) -> None:
            run = handles[i]

            def step(tx: StepTransaction) -> None:
                tx.set_state({"n": counts[i]})
                tx.intend("bench.noop", {"n": counts[i]})

            while not stop.is_set():
                run.transaction(f"s{counts[i]}", step)
                counts[i] += 1

        threads = [threading.Thread(target=work, args=(i,)) for i in range(runs)]
        started, cpu, waited = time.perf_counter(), _cpu(), _waited()
        for thread in threads:
            thread.start()
        time.sleep(seconds)
        waited = _waited() - waited  # before the threads end and take their counts along
        stop.set()
        for thread in threads:
            thread.join()
        return _figures(sum(counts), time.perf_counter() - started, _cpu() - cpu, waited)


async def async_steps(dsn: str, runs: int, seconds: float) -> dict[str, float]:
    """``runs`` tasks on this event loop, each stepping its own run with the async client."""
    async with await AsyncOutbox.connect(dsn, pool_size=POOL) as ob:
        handles = [await ob.start_run("bench", "1", {}) for _ in range(runs)]
        counts = [0] * runs
        stop = asyncio.Event()

        async def work(i: int) -> None:
            run = handles[i]

            async def step(tx: AsyncStepTransaction) -> None:
                tx.set_state({"n": counts[i]})
                await tx.intend("bench.noop", {"n": counts[i]})

            while not stop.is_set():
                await run.transaction(f"s{counts[i]}", step)
                counts[i] += 1

        started, cpu, waited = time.perf_counter(), _cpu(), _waited()
        tasks = [asyncio.create_task(work(i)) for i in range(runs)]
        await asyncio.sleep(seconds)
        stop.set()
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - started
        return _figures(sum(counts), elapsed, _cpu() - cpu, _waited() - waited)


def _figures(steps: int, elapsed: float, cpu: float, waited: float) -> dict[str, float]:
    return {
        "steps_per_s": steps / elapsed,
        "client_cpu_us_per_step": cpu / steps * 1e6,
        # runnable threads of this process waiting for a CPU, per second of the measurement
        "cpu_wait_share": waited / elapsed,
    }


VARIANTS: dict[str, Callable[[str, float], dict[str, float]]] = {
    "sync, 1 run": lambda dsn, s: sync_steps(dsn, 1, s),
    "async, 1 run": lambda dsn, s: asyncio.run(async_steps(dsn, 1, s)),
    "sync, 50 runs on 50 threads": lambda dsn, s: sync_steps(dsn, 50, s),
    "async, 50 runs on one event loop": lambda dsn, s: asyncio.run(async_steps(dsn, 50, s)),
}


def _reset(dsn: str) -> None:
    with psycopg.connect(_libpq(dsn), autocommit=True) as conn:
        conn.execute("TRUNCATE outbox_runs, outbox_steps, outbox_effects CASCADE")
        conn.execute("CHECKPOINT")


def _libpq(dsn: str) -> str:
    return make_url(dsn).set(drivername="postgresql").render_as_string(hide_password=False)


def measure(dsn: str, seconds: float, reps: int) -> dict[str, Any]:
    """Each variant ``reps`` times, interleaved; the median (min-max) of each figure."""
    for run in VARIANTS.values():  # warm: connections, compiled statements, plans
        run(dsn, 0.5)
    got: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    for rep in range(reps):
        for name, run in VARIANTS.items():
            _reset(dsn)
            got[name].append(run(dsn, seconds))
            print(f"rep {rep + 1} {name}: {got[name][-1]['steps_per_s']:.0f} steps/s", flush=True)
    out: dict[str, Any] = {}
    for name, results in got.items():
        out[name] = {
            key: {
                "median": statistics.median(r[key] for r in results),
                "min": min(r[key] for r in results),
                "max": max(r[key] for r in results),
            }
            for key in results[0]
        }
    return out


def table(results: dict[str, Any]) -> str:
    """The figures as the Markdown table docs/performance.md shows."""
    base = results["sync, 1 run"]["steps_per_s"]["median"]
    lines = [
        "| client | steps/s | vs sync, 1 run | client CPU per step | waiting for a CPU |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        rate, cpu = r["steps_per_s"], r["client_cpu_us_per_step"]
        wait = r["cpu_wait_share"]["median"]
        lines.append(
            f"| {name} | {rate['median']:,.0f} ({rate['min']:,.0f}-{rate['max']:,.0f}) "
            f"| {rate['median'] / base:.2f}x | {cpu['median']:,.0f} µs | {wait:.2f} s/s |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.async_steps", description=__doc__)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    home: Path | None = None
    server: EmbeddedServer | None = None
    admin = os.environ.get("OUTBOX_DSN")
    if not admin:
        home = Path(tempfile.mkdtemp(prefix="outbox-bench-async-"))
        home.chmod(0o711)  # as root, the server runs as another user, who must enter it
        server = EmbeddedServer(home)
        admin = server.ensure_running()
    dsn = make_url(admin).set(database=DATABASE).render_as_string(hide_password=False)
    with psycopg.connect(_libpq(admin), autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {DATABASE}")
    try:
        engine = make_engine(dsn)
        migrate(engine)
        engine.dispose()
        results = measure(dsn, args.seconds, args.reps)
    finally:
        with psycopg.connect(_libpq(admin), autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
        if server is not None and home is not None:
            server.stop(mode="fast")
            shutil.rmtree(home, ignore_errors=True)
    print()
    print(table(results))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
