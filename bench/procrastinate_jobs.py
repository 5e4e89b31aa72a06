"""Procrastinate 3.10 beside the outbox (subprocesses of ``python -m bench``).

``python -m bench.procrastinate_jobs DSN COMMAND ...`` on its own database of
the benchmark's server, with the ``PsycopgConnector``:

- ``schema``: apply Procrastinate's schema (``procrastinate schema --apply``).
- ``drain --n N --concurrency C --reps R``: per rep, empty the job tables,
  defer N no-op jobs (``batch_defer_async``, committed), then time one worker
  (``run_worker_async(wait=False)``: it returns once the queue is empty) from
  its start to its return; also from the first job's ``started`` event to the
  last ``succeeded`` one. Prints JSON.
- ``worker --expect K``: a worker (LISTEN/NOTIFY on, defaults otherwise) whose
  job records ``time.time()`` when it starts; after K jobs it stops and prints
  ``{i: start}`` as JSON.
- ``writer --rate R --seconds S --warmup W``: defers one job every 1/R s with
  the synchronous API, recording ``time.time()`` after each ``defer`` returns
  (the job is committed), and prints ``[[i, committed_at], ...]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import resource
import sys
import time
from typing import Any

import psycopg
from procrastinate import App, PsycopgConnector

started_at: dict[int, float] = {}
expected = 0
enough = asyncio.Event()


def make_app(dsn: str) -> App:
    app = App(connector=PsycopgConnector(conninfo=dsn))

    @app.task(name="bench_noop")
    async def bench_noop(i: int) -> None:
        return None

    @app.task(name="bench_latency")
    async def bench_latency(i: int) -> None:
        started_at[i] = time.time()
        if len(started_at) >= expected:
            enough.set()

    return app


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def reset(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(
            "TRUNCATE procrastinate_jobs, procrastinate_events, procrastinate_periodic_defers, "
            "procrastinate_workers CASCADE"
        )
        await conn.execute("CHECKPOINT")


async def drain(dsn: str, n: int, concurrency: int, reps: int) -> list[dict[str, float]]:
    app = make_app(dsn)
    task = app.tasks["bench_noop"]
    out = []
    async with app.open_async():
        for rep in range(reps + 1):  # the first is a warm-up
            size = min(n, 500) if rep == 0 else n
            await reset(dsn)
            for first in range(0, size, 5000):
                jobs: list[dict[str, Any]] = [
                    {"i": i} for i in range(first, min(size, first + 5000))
                ]
                await task.batch_defer_async(*jobs)
            cpu = cpu_seconds()
            began = time.perf_counter()
            await app.run_worker_async(
                wait=False, concurrency=concurrency, install_signal_handlers=False
            )
            wall = time.perf_counter() - began
            cpu = cpu_seconds() - cpu
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                cur = await conn.execute(
                    "SELECT count(*) FILTER (WHERE status = 'succeeded') FROM procrastinate_jobs"
                )
                row = await cur.fetchone()
                cur = await conn.execute(
                    "SELECT extract(epoch FROM max(at) FILTER (WHERE type = 'succeeded') "
                    "- min(at) FILTER (WHERE type = 'started'))::float8 FROM procrastinate_events"
                )
                span = await cur.fetchone()
            if not row or row[0] != size:
                raise RuntimeError(f"procrastinate finished {row} of {size} jobs")
            if rep == 0:
                continue
            events_s = float(span[0]) if span and span[0] else wall
            out.append(
                {
                    "rate": n / wall,
                    "rate_events": n / events_s,
                    "seconds": wall,
                    "worker_cpu_us_per_job": 1e6 * cpu / n,
                }
            )
    return out


async def worker(dsn: str, expect: int) -> dict[int, float]:
    global expected
    expected = expect
    app = make_app(dsn)
    async with app.open_async():
        running = asyncio.create_task(app.run_worker_async(install_signal_handlers=False))
        waiting = asyncio.create_task(enough.wait())
        await asyncio.wait({running, waiting}, return_when=asyncio.FIRST_COMPLETED)
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        waiting.cancel()
    return started_at


def writer(dsn: str, rate: float, seconds: float, warmup: int) -> list[tuple[int, float]]:
    app = make_app(dsn)
    task = app.tasks["bench_latency"]
    commits: list[tuple[int, float]] = []
    with app.open():
        total = warmup + round(rate * seconds)
        begin = time.perf_counter()
        for i in range(total):
            pause = begin + i / rate - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            task.defer(i=i)
            commits.append((i, time.time()))
    return commits


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.procrastinate_jobs")
    parser.add_argument("dsn")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("schema")
    p = sub.add_parser("drain")
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p = sub.add_parser("worker")
    p.add_argument("--expect", type=int, required=True)
    p = sub.add_parser("writer")
    p.add_argument("--rate", type=float, required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    result: Any
    if args.command == "schema":
        app = make_app(args.dsn)
        with app.open():
            app.schema_manager.apply_schema()
        result = {"ok": True}
    elif args.command == "drain":
        result = asyncio.run(drain(args.dsn, args.n, args.concurrency, args.reps))
    elif args.command == "worker":
        result = asyncio.run(worker(args.dsn, args.expect))
    else:
        result = writer(args.dsn, args.rate, args.seconds, args.warmup)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
