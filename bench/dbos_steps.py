"""DBOS Transact running no-op two-step workflows: ``python -m bench.dbos_steps URL ...``.

A subprocess of the benchmark (DBOS keeps process-global state and threads of
its own), with ``URL`` as its system database on the benchmark's server. After
a warm-up, for each thread count, workflows run in a loop from that many
threads, timed by the same harness as the outbox's writers
(:func:`bench.write.run_writers`); it prints one JSON object: per thread count,
one record per repetition (steps/s = 2 x workflows/s; write transactions and
WAL per workflow, measured on the server).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
from pathlib import Path
from typing import Any

from dbos import DBOS, DBOSConfig

from bench.harness import Bench
from bench.write import Work, run_writers

ids = itertools.count()  # every workflow gets its own id


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


def workflows(w: int) -> Work:
    return lambda i: two_step_workflow(next(ids))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.dbos_steps")
    parser.add_argument("url")
    parser.add_argument("--threads", default="1,8")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    logging.getLogger("dbos").setLevel(logging.WARNING)
    config: DBOSConfig = {"name": "outbox-bench", "system_database_url": args.url}
    DBOS(config=config)
    DBOS.launch()
    bench = Bench(Path.cwd())  # for its queries only: the parent runs the server
    bench.dsn = args.url
    out: dict[str, Any] = {}
    try:
        for _ in range(100):  # warm: connections, prepared plans
            two_step_workflow(next(ids))
        for threads in args.threads.split(","):
            out[threads] = []
            for _ in range(args.reps):
                got = run_writers(bench, int(threads), args.seconds, workflows)
                out[threads].append(
                    {
                        "workflows_per_s": got["rate"],
                        "steps_per_s": 2 * got["rate"],
                        "write_tx_per_workflow": got["write_xids_per_tx"],
                        "wal_bytes_per_workflow": got["wal_bytes_per_tx"],
                    }
                )
    finally:
        DBOS.destroy()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
