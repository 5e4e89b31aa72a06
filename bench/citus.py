"""Steps and deliveries on a Citus cluster beside one plain server of the same binaries.

Section ``citus`` of ``python -m bench`` (also ``python -m bench.citus``). It
starts its own cluster (a coordinator and two workers on loopback, from the
Citus files ``tests/citus_support.py`` installs) and measures, in one run:

- ``plain``: a database without Citus on the coordinator's server (same
  binaries, same settings), ``outbox migrate``;
- ``citus``: a database on the cluster, ``outbox migrate --distribute``.

In each: ``run.transaction`` with one intent from 1 and 4 writer threads
(steps/s), then a DeliveryDaemon with a no-op deliverer draining the effects
those steps wrote (effects/s). On this 2-core machine the three servers share
the cores, so the ratio is a cost ratio (coordinator + worker work per step),
not a scaling figure; docs/discussions/performance.md argues scaling from it.
"""

from __future__ import annotations

import functools
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
from click.testing import CliRunner

from bench.delivery import DaemonRunner, NoopDeliverer, check
from bench.harness import Bench, log, process_table, summary
from outbox import Outbox, StepTransaction
from outbox.cli import cli as cli_main
from outbox.delivery.settings import DeliverySettings

KIND = "bench.citus"
#: Each writer's steps before the clock starts, on the connections it then measures
#: with: a session's first steps compile the write functions and plan their
#: statements (on a cluster, on the coordinator and on each worker session it opens),
#: which is not what a step costs once running.
WARM_SECONDS = 1.0


def _migrate(dsn: str, *, distribute: bool) -> None:
    args = ["migrate", "--json", *(["--distribute"] if distribute else [])]
    result = CliRunner().invoke(cli_main, args, env={"OUTBOX_DSN": dsn})
    if result.exit_code != 0:
        raise RuntimeError(f"outbox {' '.join(args)}: {result.output}")


def _one_intent(tx: StepTransaction, n: int) -> None:
    tx.intend(KIND, {"n": n})


def _tree_cpu(roots: list[int]) -> float:
    """CPU seconds so far of servers: their postmasters and every descendant (backends)."""
    table = process_table()
    ours, grown = set(roots), True
    while grown:
        found = {pid for pid, (ppid, _) in table.items() if ppid in ours} - ours
        ours |= found
        grown = bool(found)
    return sum(table[pid][1] for pid in ours if pid in table)


def _steps(
    dsn: str, writers: int, seconds: float, nodes: dict[str, list[int]] | None = None
) -> dict[str, float]:
    """Steps per second (one intent each) from ``writers`` threads for ``seconds``.

    With ``nodes``: also CPU µs per step of each group of servers, read before the
    pool closes (a backend that exits takes its CPU figure with it).
    """
    ob = Outbox.connect(dsn, pool_size=writers + 2)
    counts = [0] * writers
    warmed = threading.Barrier(writers + 1)
    timed = threading.Event()
    stop = 0.0

    def loop(w: int) -> None:
        run = ob.start_run("bench", "1")
        n = 0

        def step() -> None:
            nonlocal n
            run.transaction(f"s{n}", functools.partial(_one_intent, n=n))
            n += 1

        warm_until = time.monotonic() + WARM_SECONDS
        while time.monotonic() < warm_until:
            step()
        warmed.wait()
        timed.wait()
        while time.monotonic() < stop:
            step()
            counts[w] += 1

    nodes = nodes or {}
    threads = [threading.Thread(target=loop, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    warmed.wait()
    before = {name: _tree_cpu(pids) for name, pids in nodes.items()}
    began = time.monotonic()
    stop = began + seconds
    timed.set()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - began
    steps = max(sum(counts), 1)
    out = {f"steps_per_s_{writers}": steps / elapsed}
    for name, pids in nodes.items():
        out[f"{name}_cpu_us_per_step"] = (_tree_cpu(pids) - before[name]) / steps * 1e6
    ob.close()
    return out


def _pending(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM outbox_effects WHERE status = 'pending'"
        ).fetchone()
    return 0 if row is None else int(row[0])


def _deliveries(dsn: str, timeout: float = 300.0) -> float:
    """Effects per second for one in-process daemon draining every pending effect.

    The end is the daemon's own count of completions: a count of pending rows
    polled meanwhile would read every shard of the cluster, several times a second,
    on the cores the daemon and the nodes share.
    """
    pending = _pending(dsn)
    settings = DeliverySettings(batch_size=100, poll_seconds=0.05)
    runner = DaemonRunner(dsn, {KIND: NoopDeliverer(KIND)}, settings)
    runner.probe.arm(pending)
    with runner:
        began = time.perf_counter()
        runner.wait(runner.probe.reached, timeout)
        seconds = runner.probe.reached_at - began
    check(_pending(dsn) == 0, "effects left pending after the drain")
    return pending / seconds


def _settle(dsn: str, servers: list[str]) -> None:
    """Leave nothing of one measurement for the next to pay: vacuum what it wrote, checkpoint.

    Otherwise the database measured second may share the cores with
    autovacuum working through the first one's rows, and with its checkpoint
    (docs/discussions/performance.md has the runs that suggested it).
    """
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
    for server in servers:
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute("CHECKPOINT")


def measure(dsn: str, nodes: dict[str, list[int]], *, quick: bool) -> dict[str, float]:
    """One database's figures; ``nodes``: the postmasters of each group of servers.

    CPU per step is counted for 4 writers, per group (the coordinator, the
    workers), from /proc: what a step costs where.
    """
    seconds = 5.0 if quick else 15.0
    out = _steps(dsn, 1, seconds) | _steps(dsn, 4, seconds, nodes)
    out["effects_per_s"] = _deliveries(dsn)
    return out


def citus(bench: Bench | None, workdir: Path, quick: bool) -> dict[str, Any]:
    """The section: plain and Citus side by side, repeated (``--quick``: once)."""
    from tests.citus_support import ensure_installed, running_cluster

    ensure_installed()
    reps = 1 if quick else 3
    runs: dict[str, list[dict[str, float]]] = {"plain": [], "citus": []}
    with running_cluster() as cluster:
        for rep in range(reps):
            database = cluster.create_database()
            plain = f"bench_plain_{rep}"
            try:
                with psycopg.connect(cluster.coordinator.dsn(), autocommit=True) as conn:
                    conn.execute(f"CREATE DATABASE {plain}")
                _migrate(cluster.coordinator.dsn(plain), distribute=False)
                _migrate(database.dsn, distribute=True)
                nodes = {
                    "coordinator": [pid for pid in [cluster.coordinator.pid()] if pid],
                    "workers": [pid for w in cluster.workers if (pid := w.pid())],
                }
                pair = [("plain", cluster.coordinator.dsn(plain)), ("citus", database.dsn)]
                # each goes first in turn: what drifts over a repetition (the machine's
                # speed, a checkpoint) weighs on both alike
                for name, dsn in pair[:: -1 if rep % 2 else 1]:
                    log(f"citus section, rep {rep + 1}/{reps}: {name}")
                    runs[name].append(measure(dsn, nodes, quick=quick))
                    _settle(dsn, [node.dsn() for node in cluster.nodes])
            finally:
                cluster.drop_database(database)
                with psycopg.connect(cluster.coordinator.dsn(), autocommit=True) as conn:
                    conn.execute(f"DROP DATABASE IF EXISTS {plain} WITH (FORCE)")
    out: dict[str, Any] = {"reps": reps}
    for name, got in runs.items():
        out[name] = {k: statistics.median(r[k] for r in got) for k in got[0]}
    rates = [k for k in out["plain"] if k.endswith("_per_s") or "_per_s_" in k]
    out["ratio"] = {k: out["citus"][k] / out["plain"][k] for k in rates}
    # Repetition i of each database paired: the min-max shows how far one pair strays.
    out["ratio_reps"] = {
        k: summary([c[k] / p[k] for c, p in zip(runs["citus"], runs["plain"], strict=True)])
        for k in rates
    }
    return out


def main() -> int:
    import json
    import sys
    import tempfile

    quick = "--quick" in sys.argv
    print(json.dumps(citus(None, Path(tempfile.mkdtemp()), quick), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
