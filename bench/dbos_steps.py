"""DBOS Transact running no-op two-step workflows (a subprocess of ``python -m bench``).

``python -m bench.dbos_steps URL --threads 1,8 --seconds S --reps R`` launches
DBOS with ``URL`` as its system database (on the benchmark's server), warms up,
then for each thread count runs ``wf(i)`` (two ``@DBOS.step`` no-ops) in a loop
from that many threads for ``S`` seconds, ``R`` times, and prints one JSON
object: workflows/s, steps/s (2 per workflow) and write transactions per
workflow (transaction ids consumed on the server while measuring).

DBOS keeps process-global state (and its own threads), so it runs in a process
of its own rather than inside the benchmark.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from typing import Any

import psycopg
from dbos import DBOS, DBOSConfig


@DBOS.step()
def first_step(i: int) -> int:
    return i


@DBOS.step()
def second_step(i: int) -> int:
    return i


@DBOS.workflow()
def two_step_workflow(i: int) -> int:
    first_step(i)
    second_step(i)
    return i


def next_xid(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT pg_snapshot_xmax(pg_current_snapshot())::text").fetchone()
    assert row is not None
    return int(row[0])


def measure(url: str, threads: int, seconds: float, offset: int) -> dict[str, float]:
    counts = [0] * threads
    stop = threading.Event()
    barrier = threading.Barrier(threads + 1)
    errors: list[BaseException] = []

    def loop(t: int) -> None:
        barrier.wait()
        n = 0
        try:
            while not stop.is_set():
                two_step_workflow(offset + t * 10_000_000 + n)
                n += 1
        except BaseException as exc:
            errors.append(exc)
        counts[t] = n

    workers = [threading.Thread(target=loop, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    xid = next_xid(url)
    barrier.wait()
    started = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for w in workers:
        w.join(60)
    wall = time.perf_counter() - started
    xids = next_xid(url) - xid - 1
    if errors:
        raise RuntimeError(f"a workflow failed: {errors[0]!r}") from errors[0]
    done = sum(counts)
    return {
        "workflows_per_s": done / wall,
        "steps_per_s": 2 * done / wall,
        "write_tx_per_workflow": xids / max(1, done),
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.dbos_steps")
    parser.add_argument("url")
    parser.add_argument("--threads", default="1,8")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    logging.getLogger("dbos").setLevel(logging.WARNING)
    config: DBOSConfig = {
        "name": "outbox-bench",
        "system_database_url": args.url,
        "log_level": "WARNING",
    }
    DBOS(config=config)
    DBOS.launch()
    out: dict[str, Any] = {}
    try:
        for i in range(100):  # warm: connections, prepared plans
            two_step_workflow(-1 - i)
        offset = 0
        for threads in (int(t) for t in args.threads.split(",")):
            reps = []
            for _ in range(args.reps):
                offset += 100_000_000
                reps.append(measure(args.url, threads, args.seconds, offset))
            out[str(threads)] = reps
    finally:
        DBOS.destroy()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
