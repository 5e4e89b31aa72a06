"""The ``fairness`` section of ``python -m bench.runctl``: a trickle beside a flood."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg

from bench.runctl_support import REPO, backlog, libpq, migrated, quantiles, scratch

# -- fairness -----------------------------------------------------------------------------

#: Where :func:`record_trickle` appends ``i time`` (set for the deliverer process).
TRICKLE_LOG_ENV = "BENCH_RUNCTL_TRICKLE_LOG"
FAIR_KIND = "bench.fair"


async def record_trickle(payload: Any, key: str) -> None:
    """The ``python.call`` sink of the deliverer process: log when a trickle effect starts."""
    if "trickle" in payload:
        started = time.time()
        fd = os.open(os.environ[TRICKLE_LOG_ENV], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{payload['trickle']} {started!r}\n".encode())
        finally:
            os.close(fd)


@contextmanager
def deliverer_process(dsn: str, work: Path) -> Iterator[Path]:
    """An ``outbox deliver`` process (default settings) serving FAIR_KIND; yields its start log."""
    config = work / "fair.toml"
    config.write_text(
        f'[kinds."{FAIR_KIND}"]\ntype = "python.call"\n'
        'function = "bench.runctl_fairness:record_trickle"\nidempotent = true\n'
    )
    log = work / "trickle.log"
    log.write_text("")
    env = {**os.environ, "OUTBOX_DSN": dsn, TRICKLE_LOG_ENV: str(log)}
    env["OUTBOX_HOME"] = str(work / "no-embedded-server")
    with (work / "deliver.out").open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "outbox", "deliver", "--config", str(config)],
            env=env,
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        yield log
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@contextmanager
def deliverer_thread(dsn: str, starts: dict[int, float], delivered: list[int]) -> Iterator[None]:
    """A DeliveryDaemon (default settings) on its own event loop in a thread of this process."""
    from outbox.delivery import Deliverer, Delivery, Outcome, Succeeded
    from outbox.delivery.daemon import DeliveryDaemon
    from outbox.delivery.settings import DeliverySettings
    from outbox.storage.async_store import AsyncStore
    from outbox.storage.engine import make_async_engine

    class NoOp(Deliverer):
        default_idempotent = True

        async def deliver(self, delivery: Delivery) -> Outcome:
            if "trickle" in delivery.payload:
                starts[delivery.payload["trickle"]] = time.time()
            delivered[0] += 1
            return Succeeded()

    ready = threading.Event()
    holder: dict[str, Any] = {}

    def main() -> None:
        async def run() -> None:
            store = AsyncStore(make_async_engine(dsn))
            daemon = DeliveryDaemon(store, {FAIR_KIND: NoOp(FAIR_KIND)}, DeliverySettings())
            holder["daemon"], holder["loop"] = daemon, asyncio.get_running_loop()
            ready.set()
            try:
                await daemon.run()
            finally:
                await store.dispose()

        asyncio.run(run())

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    assert ready.wait(30)
    try:
        yield
    finally:
        holder["loop"].call_soon_threadsafe(holder["daemon"].stop)
        thread.join(60)


def pending_a(conn: Any) -> int:
    (n,) = conn.execute(
        "SELECT count(*) FROM outbox_effects WHERE status = 'pending' AND fairness_key = 'a'"
    ).fetchone()
    return int(n)


def fairness_run(
    dsn: str, work: Path, *, fair: bool, seconds: float, hold: int, process: bool
) -> dict[str, Any]:
    """Tenant A holds ``hold`` pending effects; B trickles 10/s. B's commit -> start latency."""
    from outbox import Outbox

    starts: dict[int, float] = {}
    delivered = [0]
    backlog(dsn, FAIR_KIND, hold, fairness_key="a")
    stop = threading.Event()

    def top_up() -> None:  # A keeps holding its backlog while the trickle runs
        with psycopg.connect(libpq(dsn), autocommit=True) as conn:
            while not stop.wait(0.25):
                missing = hold - pending_a(conn)
                if missing > 0:
                    backlog(dsn, FAIR_KIND, missing, fairness_key="a")
                    if process:  # A is held at ``hold``: what was topped up was delivered
                        delivered[0] += missing

    deliverer = (
        deliverer_process(dsn, work) if process else deliverer_thread(dsn, starts, delivered)
    )
    committed: dict[int, float] = {}
    with deliverer as log, Outbox.connect(dsn) as ob:
        with psycopg.connect(libpq(dsn), autocommit=True) as conn:
            deadline = time.time() + 60
            while pending_a(conn) > hold - 1000 and time.time() < deadline:
                time.sleep(0.05)  # until the deliverer is draining A's backlog
        filler = threading.Thread(target=top_up, daemon=True)
        filler.start()
        run = ob.start_run("bench", "1", {}, fairness_key="b" if fair else "a")
        time.sleep(1.0)
        before = delivered[0]
        began = time.time()
        i = 0
        while time.time() - began < seconds:
            due = began + i * 0.1
            time.sleep(max(0.0, due - time.time()))

            def trickle(tx: Any, i: int = i) -> None:
                tx.intend(FAIR_KIND, {"trickle": i})

            run.transaction(f"t{i}", trickle)
            committed[i] = time.time()
            i += 1
        rate = (delivered[0] - before) / (time.time() - began)
        stop.set()
        filler.join(10)
        deadline = time.time() + 120
        while time.time() < deadline:
            if log is not None:
                for line in Path(log).read_text().splitlines():
                    n, at = line.split()
                    starts[int(n)] = float(at)
            if len(starts) >= len(committed):
                break
            time.sleep(0.1)
    latencies = [starts[k] - committed[k] for k in committed if k in starts]
    with psycopg.connect(libpq(dsn)) as conn:
        left = pending_a(conn)
        # commit -> claim in database time (created_at is the intending transaction's start)
        claimed = [
            float(row[0])
            for row in conn.execute(
                "SELECT extract(epoch FROM attempt_started_at - created_at) FROM outbox_effects"
                " WHERE payload ? 'trickle' AND attempt_started_at IS NOT NULL"
            )
        ]
    return {
        **quantiles(latencies),
        "commit_to_claim": quantiles(claimed),
        "trickle_sent": len(committed),
        "trickle_started": len(starts),
        "effects_per_s": rate,
        "a_pending_at_end": left,
    }


def fairness_section(admin: str, reps: int, seconds: float, work: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, fair, window, process in (
        ("two fairness keys, an `outbox deliver` process", True, seconds, True),
        ("two fairness keys, DeliveryDaemon in this process", True, seconds, False),
        ("one lane (no fairness keys), for comparison", False, min(seconds, 10.0), True),
    ):
        runs = []
        for _rep in range(reps if fair else 1):
            with scratch(admin, "bench_runctl_fair") as dsn:
                migrated(dsn)
                runs.append(
                    fairness_run(dsn, work, fair=fair, seconds=window, hold=50_000, process=process)
                )
            print(
                f"  fairness {name}: p50 {runs[-1]['p50'] * 1000:.1f} ms "
                f"p99 {runs[-1]['p99'] * 1000:.1f} ms ({runs[-1]['trickle_started']} of "
                f"{runs[-1]['trickle_sent']} started)",
                flush=True,
            )
        out[name] = {"reps": runs}
    return out
