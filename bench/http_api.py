"""The ``http`` section of ``python -m bench``: steps over HTTP, and the long poll's latency.

A real ``outbox serve`` subprocess with an API token, on a scratch database of
the bench's server, measured side by side in one run:

- steps/s with one intent each, by 1 and 8 client threads (each with its own
  run and keep-alive connection) posting ``/api/v1/runs/{id}/steps``, next to
  as many threads calling ``run.transaction`` directly in this process (what
  the server itself does per request), order rotated over the repetitions;
  each repetition's pair gives a ratio;
- the long poll: for each of N effects, a client waits on
  ``/outcome?wait=30`` while an in-process no-op deliverer completes it; the
  figure is the effect's ``completed_at`` (database clock) to the answer's
  arrival (this machine's clock, the same one), p50 / p95 / max.
"""

from __future__ import annotations

import asyncio
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from bench.harness import Bench, summary
from bench.runctl_support import migrated, scratch
from outbox import Outbox, StepTransaction
from outbox.delivery import Deliverer, DelivererConfig, Delivery, Outcome, Succeeded
from outbox.delivery.daemon import DeliveryDaemon
from outbox.delivery.settings import DeliverySettings
from outbox.storage.async_store import AsyncStore
from outbox.storage.engine import make_async_engine

TOKEN = "bench-api-token-0123456789"
KIND = "bench.http_api"
DATABASE = "outbox_bench_http_api"


class NoOp(Deliverer):
    """Succeeds at once."""

    def __init__(self) -> None:
        super().__init__(KIND, DelivererConfig(idempotent=True))

    def deliver(self, delivery: Delivery) -> Outcome:
        return Succeeded({"ok": True})


def rate(threads: int, seconds: float, make: Callable[[int], Callable[[int], None]]) -> float:
    """Calls per second of ``threads`` threads each calling its work(i) for ``seconds``."""
    works = [make(t) for t in range(threads)]
    counts = [0] * threads
    stop = threading.Event()
    barrier = threading.Barrier(threads + 1)

    def loop(t: int) -> None:
        barrier.wait()
        while not stop.is_set():
            works[t](counts[t])
            counts[t] += 1

    pool = [threading.Thread(target=loop, args=(t,), daemon=True) for t in range(threads)]
    for thread in pool:
        thread.start()
    barrier.wait()
    began = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for thread in pool:
        thread.join(60)
    return sum(counts) / (time.perf_counter() - began)


def over_http(base: str) -> Callable[[int], Callable[[int], None]]:
    def make(t: int) -> Callable[[int], None]:
        client = httpx.Client(
            base_url=f"{base}/api/v1", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60
        )
        started = client.post("/runs", json={"agent": "bench-http", "version": "1"})
        path = f"/runs/{started.json()['run']['id']}/steps"

        def work(i: int) -> None:
            body = {"step_id": f"s{i}", "intents": [{"kind": KIND, "payload": {"t": t, "i": i}}]}
            answer = client.post(path, json=body)
            if answer.status_code != 201:
                raise RuntimeError(answer.text)

        return work

    return make


def direct(ob: Outbox) -> Callable[[int], Callable[[int], None]]:
    def make(t: int) -> Callable[[int], None]:
        run = ob.start_run("bench-direct", "1")

        def work(i: int) -> None:
            def step(tx: StepTransaction) -> None:
                tx.intend(KIND, {"t": t, "i": i})

            run.transaction(f"s{i}", step)

        return work

    return make


def long_poll_latency(base: str, dsn: str, ob: Outbox, n: int) -> dict[str, float]:
    """completed_at → answer, ms, for ``n`` effects awaited one at a time."""
    client = httpx.Client(
        base_url=f"{base}/api/v1", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60
    )
    ready = threading.Event()
    stopping: list[Callable[[], None]] = []

    def deliverer() -> None:
        async def main() -> None:
            store = AsyncStore(make_async_engine(dsn))
            daemon = DeliveryDaemon(store, {KIND: NoOp()}, DeliverySettings())
            loop = asyncio.get_running_loop()
            stopping.append(lambda: (loop.call_soon_threadsafe(daemon.stop), None)[1])
            ready.set()
            try:
                await daemon.run()
            finally:
                await store.dispose()

        asyncio.run(main())

    thread = threading.Thread(target=deliverer, daemon=True)
    latencies = []
    run = ob.start_run("bench-poll", "1")
    try:
        thread.start()
        ready.wait(30)
        waited = 0
        for i in range(n):
            # The poll is asked right after the commit: the deliverer, woken by the
            # commit's NOTIFY, usually finishes while it waits.
            def step(tx: StepTransaction, i: int = i) -> str:
                return str(tx.intend(KIND, {"i": i}).id)

            effect = run.transaction(f"p{i}", step)
            asked = time.time()
            outcome = client.get(f"/effects/{effect}/outcome", params={"wait": 30}).json()
            got_at = time.time()
            assert outcome["done"], outcome
            completed = datetime.fromisoformat(outcome["effect"]["completed_at"]).timestamp()
            waited += completed > asked
            latencies.append(1000 * (got_at - completed))
    finally:
        for stop in stopping:
            stop()
        thread.join(30)
        client.close()
    latencies.sort()
    return {
        "polls": n,
        "polls_that_waited": waited,
        "p50_ms": statistics.median(latencies),
        "p95_ms": latencies[int(0.95 * (len(latencies) - 1))],
        "max_ms": latencies[-1],
    }


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def measure(dsn: str, seconds: float, reps: int, polls: int) -> dict[str, Any]:
    port = _free_port()
    env = {**os.environ, "OUTBOX_DSN": dsn, "OUTBOX_API_TOKEN": TOKEN}
    server = subprocess.Popen(
        [sys.executable, "-m", "outbox", "serve", "--port", str(port), "--no-console"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/healthz").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("outbox serve did not start")
            time.sleep(0.1)
        out: dict[str, Any] = {"seconds": seconds, "reps": reps}
        with Outbox.connect(dsn) as ob:
            makers = {"http": over_http(base), "direct": direct(ob)}
            rate(2, 0.5, makers["http"])  # warm both
            rate(2, 0.5, makers["direct"])
            for threads in (1, 8):
                got: dict[str, list[float]] = {name: [] for name in makers}
                for rep in range(reps):
                    for name in list(makers)[rep % 2 :] + list(makers)[: rep % 2]:
                        got[name].append(rate(threads, seconds, makers[name]))
                ratios = [h / d for h, d in zip(got["http"], got["direct"], strict=True)]
                out[str(threads)] = {
                    "http_steps_per_s": summary(got["http"]),
                    "direct_steps_per_s": summary(got["direct"]),
                    "ratio": summary(ratios),
                }
            out["long_poll"] = long_poll_latency(base, dsn, ob, polls)
        return out
    finally:
        server.terminate()
        server.wait(30)


def http(bench: Bench, workdir: Path, quick: bool) -> dict[str, Any]:
    """The section: steps over HTTP beside direct ones, then the long poll."""
    seconds, reps, polls = (2.0, 1, 20) if quick else (4.0, 3, 50)
    with scratch(bench.server.dsn("postgres"), DATABASE) as dsn:
        migrated(dsn)
        return measure(dsn, seconds, reps, polls)
