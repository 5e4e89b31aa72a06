"""Procrastinate 3.10 beside the outbox: ``python -m bench.procrastinate_jobs DSN COMMAND``.

A subprocess of the benchmark, on its own database of the same server, with the
``PsycopgConnector``. Commands (each prints one JSON line):

- ``schema``: apply Procrastinate's schema;
- ``drain --n N --concurrency C --reps R``: per repetition (after a small warm
  one), defer N no-op jobs, then time one worker from its start until it returns
  on an empty queue (``run_worker_async(wait=False)``), and from the first
  ``started`` event to the last ``succeeded`` one;
- ``worker --expect K``: a worker with its defaults (LISTEN/NOTIFY) whose job
  records ``time.time()`` when it starts; after K jobs it prints ``{i: start}``;
- ``writer --rate R --seconds S --warmup W``: defers one job every 1/R s with
  the synchronous API and prints ``[[i, time after defer returned], ...]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import resource
import time
from typing import Any

import psycopg
from procrastinate import App, PsycopgConnector

started_at: dict[int, float] = {}
expected = [0]
enough = asyncio.Event()


def make_app(dsn: str) -> App:
    app = App(connector=PsycopgConnector(conninfo=dsn))

    @app.task(name="bench_noop")
    async def bench_noop(i: int) -> None:
        return None

    @app.task(name="bench_latency")
    async def bench_latency(i: int) -> None:
        started_at[i] = time.time()
        if len(started_at) >= expected[0]:
            enough.set()

    return app


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def drain(dsn: str, n: int, concurrency: int, reps: int) -> list[dict[str, float]]:
    app = make_app(dsn)
    out = []
    async with app.open_async(), await psycopg.AsyncConnection.connect(dsn, autocommit=True) as db:
        for rep in range(reps + 1):  # the first, small, warms
            size = n if rep else min(n, 500)
            await db.execute(
                "TRUNCATE procrastinate_jobs, procrastinate_events, procrastinate_periodic_defers,"
                " procrastinate_workers CASCADE"
            )
            await db.execute("CHECKPOINT")
            for first in range(0, size, 5000):
                jobs: list[dict[str, Any]] = [
                    {"i": i} for i in range(first, min(size, first + 5000))
                ]
                await app.tasks["bench_noop"].batch_defer_async(*jobs)
            cpu, began = cpu_seconds(), time.perf_counter()
            await app.run_worker_async(
                wait=False, concurrency=concurrency, install_signal_handlers=False
            )
            wall, cpu = time.perf_counter() - began, cpu_seconds() - cpu
            cur = await db.execute(
                "SELECT (SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'),"
                " extract(epoch FROM max(at) FILTER (WHERE type = 'succeeded')"
                " - min(at) FILTER (WHERE type = 'started'))::float8 FROM procrastinate_events"
            )
            done, span = await cur.fetchone() or (0, None)
            if done != size:
                raise RuntimeError(f"procrastinate finished {done} of {size} jobs")
            if rep:
                events = n / float(span) if span else n / wall
                out.append({"rate": n / wall, "rate_events": events, "seconds": wall})
                out[-1]["worker_cpu_us_per_job"] = 1e6 * cpu / n
    return out


async def worker(dsn: str, expect: int) -> dict[int, float]:
    expected[0] = expect
    app = make_app(dsn)
    async with app.open_async():
        running = asyncio.create_task(app.run_worker_async(install_signal_handlers=False))
        await asyncio.wait(
            {running, asyncio.create_task(enough.wait())}, return_when="FIRST_COMPLETED"
        )
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
    return started_at


def writer(dsn: str, rate: float, seconds: float, warmup: int) -> list[tuple[int, float]]:
    app = make_app(dsn)
    commits: list[tuple[int, float]] = []
    with app.open():
        begin = time.perf_counter()
        for i in range(warmup + round(rate * seconds)):
            time.sleep(max(0.0, begin + i / rate - time.perf_counter()))
            app.tasks["bench_latency"].defer(i=i)
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
    sub.add_parser("worker").add_argument("--expect", type=int, required=True)
    p = sub.add_parser("writer")
    p.add_argument("--rate", type=float, required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
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
