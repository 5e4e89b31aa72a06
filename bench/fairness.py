"""Fairness: a trickle beside a 50,000-effect backlog, commit → handler start (p99 ≤ 100 ms).

Two cases, each with a :class:`~outbox.delivery.daemon.DeliveryDaemon` in a
thread of this process (default settings, no-op sink) draining the backlog
while a writer process trickles 10 steps a second (one intent each, after 5
unmeasured), for ``seconds``:

- ``key``: the backlog and the trickle are of one kind; the backlog's effects
  carry fairness key ``a``, the trickle's run fairness key ``b``;
- ``kind``: the backlog is of one kind, the trickle of another.

The backlog is topped up four times a second so it stays at 50,000 while the
trickle runs (a drained backlog would make the case easy). The latency is the
trickle's, measured as in the latency section (``time.time()`` when the commit
returned and when the handler started).
"""

from __future__ import annotations

import multiprocessing
import threading
import time
import uuid
from multiprocessing.connection import Connection as PipeEnd
from pathlib import Path
from typing import Any

from bench import delivery
from bench.harness import Bench, latency_figures, log, summarize
from bench.sinks import LATENCY_KIND, NOOP_KIND
from outbox import Outbox, StepTransaction
from outbox.delivery import Deliverer, Delivery, Outcome, Succeeded
from outbox.delivery.settings import DeliverySettings

HOLD = 50_000
RATE = 10.0
WARMUP = 5
TOP_UP = """
INSERT INTO outbox_effects
    (id, shard, kind, payload, payload_hash, idempotency_key, status, available_at,
     fairness_key)
SELECT id, outbox_shard_of(id), %(kind)s, '{}'::jsonb, md5('{}'), md5(%(tag)s || g::text),
       'pending', now(), %(key)s
  FROM (SELECT gen_random_uuid() AS id, g FROM generate_series(1, %(n)s) AS g) AS made
"""
PENDING = "SELECT count(*) FROM outbox_effects WHERE status = 'pending' AND kind = %s"
#: case -> (backlog kind, backlog fairness key, trickle kind, trickle run's fairness key)
CASES = {
    "key": (LATENCY_KIND, "a", LATENCY_KIND, "b"),
    "kind": (NOOP_KIND, "", LATENCY_KIND, ""),
}


class Trickle(Deliverer):
    """Succeeds at once; notes when a trickle effect (payload ``t``) started, and counts all."""

    default_idempotent = True

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.started: dict[int, float] = {}
        self.delivered = 0

    async def deliver(self, delivery: Delivery) -> Outcome:
        if isinstance(delivery.payload, dict) and "t" in delivery.payload:
            self.started[int(delivery.payload["t"])] = time.time()
        self.delivered += 1
        return Succeeded()


def writer(dsn: str, kind: str, key: str, seconds: float, pipe: PipeEnd) -> None:
    """Child process: one step with one intent every 1/RATE s; sends (i, commit time)."""
    with Outbox.connect(dsn) as ob:
        run = ob.start_run(agent="bench-fairness", version="1", fairness_key=key)
        commits: list[tuple[int, float]] = []
        begin = time.perf_counter()
        for i in range(WARMUP + round(RATE * seconds)):
            time.sleep(max(0.0, begin + i / RATE - time.perf_counter()))

            def step(tx: StepTransaction, i: int = i) -> None:
                tx.intend(kind, {"t": i})

            run.transaction(f"t{i}", step)
            commits.append((i, time.time()))
        pipe.send(commits)
    pipe.close()


def _trickle(bench: Bench, kind: str, key: str, seconds: float) -> list[tuple[int, float]]:
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=writer, args=(bench.dsn, kind, key, seconds, send))
    child.start()
    send.close()
    commits: list[tuple[int, float]] = receive.recv()
    child.join(30)
    return commits


def _top_up(bench: Bench, kind: str, key: str, stop: threading.Event) -> None:
    """Keep ``kind``'s pending backlog at HOLD until ``stop``."""
    with bench.connect() as conn:
        while not stop.wait(0.25):
            row = conn.execute(PENDING, [kind]).fetchone()
            missing = HOLD - int(row[0] if row else 0)
            if missing > 0:
                params = {"kind": kind, "key": key, "tag": uuid.uuid4().hex, "n": missing}
                conn.execute(TOP_UP, params)


def rep(bench: Bench, case: str, seconds: float) -> dict[str, Any]:
    """One repetition of ``case``: the trickle's latencies and the backlog's drain rate."""
    held_kind, held_key, kind, key = CASES[case]
    bench.reset(runs=True)
    with bench.connect() as conn:
        conn.execute(TOP_UP, {"kind": held_kind, "key": held_key, "tag": "held", "n": HOLD})
        conn.execute("ANALYZE outbox_effects")
    sinks = {k: Trickle(k) for k in {held_kind, kind}}
    stop = threading.Event()
    filler = threading.Thread(target=_top_up, args=(bench, held_kind, held_key, stop))
    with delivery.DaemonRunner(bench.dsn, sinks, DeliverySettings()):
        deadline = time.monotonic() + 60
        while sum(s.delivered for s in sinks.values()) < 1000:  # draining the backlog
            delivery.check(time.monotonic() < deadline, "the backlog is not being drained")
            time.sleep(0.05)
        filler.start()
        before, began = sinks[held_kind].delivered, time.perf_counter()
        try:
            commits = _trickle(bench, kind, key, seconds)
        finally:
            stop.set()
            filler.join(30)
        rate = (sinks[held_kind].delivered - before) / (time.perf_counter() - began)
        started = sinks[kind].started
        deadline = time.monotonic() + 60
        while len(started) < len(commits) and time.monotonic() < deadline:
            time.sleep(0.05)
    measured = [(i, c) for i, c in commits if i >= WARMUP]
    missing = [i for i, _ in measured if i not in started]
    delivery.check(not missing, f"{len(missing)} trickle effects never started")
    figures = latency_figures([1000 * (started[i] - c) for i, c in measured])
    del figures["latencies_ms"]
    return {**figures, "backlog_effects_per_s": rate}


def fairness(bench: Bench, workdir: Path, quick: bool) -> dict[str, Any]:
    seconds, reps = (10.0, 1) if quick else (30.0, 3)
    out: dict[str, Any] = {"hold": HOLD, "rate_per_s": RATE, "seconds": seconds}
    for case in CASES:
        got = [rep(bench, case, seconds) for _ in range(reps)]
        out[case] = summarize(got)
        p99 = out[case]["p99_ms"]["median"]
        log(f"fairness {case}: trickle p50 {out[case]['p50_ms']['median']:.1f} p99 {p99:.1f} ms")
    return out


# -- the page -------------------------------------------------------------------------

LABELS = {
    "key": "a trickle of fairness key `b` beside 50,000 effects of key `a`, one kind",
    "kind": "a trickle of one kind beside 50,000 effects of another",
}
TABLE = (
    "=label | p50 ms=p50_ms:r1 | p90 ms=p90_ms:r1 | p99 ms=p99_ms:r1 | max ms=max_ms:r1"
    " | backlog drained meanwhile, effects/s=backlog_effects_per_s:r0"
)


def fairness_targets(t: Any, r: dict[str, Any]) -> None:
    """p99 ≤ 100 ms for each case (``t``: :class:`bench.targets.Targets`)."""
    from bench.cells import get, rng

    for case, text in (("key", "fairness key"), ("kind", "kind")):
        p99 = get(r, "fairness", case, "p99_ms")
        target = f"fairness: a trickle of one {text} beside a 50,000 backlog, p99 ≤ 100 ms"
        t.add(target, p99, 100, f"{rng(p99, 1)} ms (in-process daemon)", most=True)


def fairness_sections(r: dict[str, Any]) -> list[tuple[str, str, str, list[dict[str, Any]]]]:
    """The fairness table."""
    f = r.get("fairness")
    if not f:
        return []
    caption = (
        f"Commit → handler start of a trickle of {f['rate_per_s']:.0f} steps/s for"
        f" {f['seconds']:.0f} s while a DeliveryDaemon in this process drains a backlog kept"
        f" at {f['hold']:,} (default settings, no-op sink)."
    )
    rows = [{"label": text, **f[k]} for k, text in LABELS.items() if k in f]
    return [("Fairness: a trickle beside a backlog", caption, TABLE, rows)]
