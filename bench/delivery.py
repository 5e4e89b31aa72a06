"""Delivery throughput: the pure-SQL limit, the daemon, real processes, Procrastinate.

Sections (each drains backlogs of no-op effects committed at once, with a NOTIFY):

- ``baseline``: a pure-SQL ``SKIP LOCKED`` claim of 100 + complete loop (psycopg,
  no SQLAlchemy; autocommit, then explicit transactions): the limit.
- ``daemon``: a warm :class:`~outbox.delivery.daemon.DeliveryDaemon` in a thread
  of this process, backlogs of 500 and 20k, default settings and concurrency
  100; and, as a diagnostic, the store's claim/complete loop with no daemon.
  The store's transactions are counted and timed by :class:`StoreProbe`.
- ``processes``: one and two ``outbox deliver`` processes (and one with
  ``--concurrency 100``), timed from the first claim to the last completion.
- ``procrastinate``: one Procrastinate worker draining as many no-op jobs
  (:mod:`bench.procrastinate_jobs`, a subprocess), concurrency 1 and 64.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import event, text

from bench import processes
from bench.harness import Bench, Meter, log, run_python, summarize
from bench.sinks import NOOP_KIND
from outbox.delivery import Deliverer, Delivery, Outcome, Succeeded
from outbox.delivery.daemon import DeliveryDaemon
from outbox.delivery.settings import DeliverySettings
from outbox.storage.async_store import AsyncStore, ClaimedEffect, Completion
from outbox.storage.engine import make_async_engine
from outbox.storage.sql.queue import EFFECT_QUEUE

PROCRASTINATE_DB = "procrastinate_bench"
#: Seconds for every backend to have reported its transaction counts.
STATS_SETTLE = 1.2
# The shape of outbox.storage.sql.queue.claim(EFFECT_QUEUE) without the
# per-ordering-key check (every backlog row has ordering_key NULL), and a
# completion that only flips the status (no attempt log).
BASELINE_CLAIM = """
UPDATE outbox_effects AS t
   SET status = 'in_flight', lease_owner = %(owner)s,
       lease_expires_at = now() + %(lease)s * interval '1 second',
       attempt = t.attempt + 1, attempt_started_at = now(), updated_at = now()
  FROM (SELECT id FROM outbox_effects
         WHERE status = 'pending' AND kind = %(kind)s AND available_at <= now()
         ORDER BY available_at, seq LIMIT %(limit)s
         FOR UPDATE SKIP LOCKED) AS picked
 WHERE t.id = picked.id
RETURNING t.*
"""
BASELINE_COMPLETE = """
UPDATE outbox_effects
   SET status = 'succeeded', lease_owner = NULL, lease_expires_at = NULL,
       completed_at = now(), updated_at = now()
 WHERE id = ANY(%(ids)s)
"""


def succeeded(claimed: Sequence[ClaimedEffect]) -> list[Completion]:
    """A no-op sink's outcomes: every attempt succeeded."""
    return [
        Completion(e.id, e.attempt, "succeeded", "succeeded", started_at=e.started_iso)
        for e in claimed
    ]


def check(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(what)


# -- baseline -------------------------------------------------------------------------


def baseline_drain(bench: Bench, n: int, *, explicit: bool, batch: int = 100) -> dict[str, Any]:
    """Drain ``n`` pending rows with the pure-SQL claim/complete loop; one repetition."""
    bench.reset()
    with bench.backlog(n, NOOP_KIND) as conn:
        conn.commit()
    params = {"owner": "bench-baseline", "lease": 30.0, "kind": NOOP_KIND, "limit": batch}
    done = batches = 0
    xid = bench.next_xid()
    with bench.connect() as conn:
        conn.execute("SELECT 1")
        with Meter().measure() as meter:
            while True:
                with conn.transaction() if explicit else contextlib.nullcontext():
                    rows = conn.execute(BASELINE_CLAIM, params).fetchall()
                if not rows:
                    break
                with conn.transaction() if explicit else contextlib.nullcontext():
                    conn.execute(BASELINE_COMPLETE, {"ids": [row[0] for row in rows]})
                done, batches = done + len(rows), batches + 1
    xids = bench.next_xid() - xid
    check(done == n == bench.counts().get("succeeded"), f"baseline drained {done} of {n}")
    return {
        "rate": n / meter.wall,
        "batches": batches,
        "write_xids_per_batch": xids / batches,
        "client_cpu_ms_per_batch": 1000 * meter.client_cpu / batches,
        "server_cpu_ms_per_batch": 1000 * meter.server_cpu / batches,
    }


def baseline(bench: Bench, workdir: Path, quick: bool) -> dict[str, Any]:
    n = 5_000 if quick else 20_000
    baseline_drain(bench, 5_000, explicit=False)  # warm the server
    out: dict[str, Any] = {"n": n}
    for name, reps in (("autocommit", 3 if quick else 5), ("explicit_tx", 1 if quick else 3)):
        got = [baseline_drain(bench, n, explicit=name == "explicit_tx") for _ in range(reps)]
        out[name] = summarize(got)
        log(f"baseline {name}: {out[name]['rate']['median']:.0f} rows/s")
    return out


# -- the daemon, in-process -----------------------------------------------------------


class StoreProbe:
    """Counts and times the store's transactions (nothing subclassed).

    Claims and outcome writes are told by the store itself
    (:attr:`AsyncStore.observer`); every other transaction (heartbeat, reconciler,
    gauges) is one pooled engine connection from checkout to checkin, seen
    through SQLAlchemy events. When ``target`` effects have been completed,
    ``reached`` is set.
    """

    def __init__(self, store: AsyncStore) -> None:
        self.arm(-1)
        store.observer = self._observed
        engine = store.engine.sync_engine
        event.listen(engine, "checkout", self._checkout)
        event.listen(engine, "after_cursor_execute", self._executed)
        event.listen(engine, "checkin", self._checkin)

    def arm(self, target: int) -> None:
        self.calls: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)
        self.claimed = self.nonempty_claims = self.completed = self.delivery_tx = 0
        self.claim_durations: list[float] = []
        self.target, self.reached, self.reached_at = target, threading.Event(), 0.0

    def _checkout(self, dbapi_conn: Any, record: Any, proxy: Any) -> None:
        record.info["probe"] = [time.perf_counter(), False]

    def _executed(
        self, conn: Any, cursor: Any, sql: Any, params: Any, context: Any, many: Any
    ) -> None:
        probe = conn.info.get("probe")
        if probe is not None:
            probe[1] = True

    def _checkin(self, dbapi_conn: Any, record: Any) -> None:
        began, ran = record.info.pop("probe", (0.0, False))
        if ran:
            self.calls["other"] += 1
            self.seconds["other"] += time.perf_counter() - began

    def _observed(self, what: str, span: float, rows: Mapping[str, int]) -> None:
        self.calls[what] += 1
        self.seconds[what] += span
        if rows.get("claim"):
            self.nonempty_claims += 1
            self.claimed += rows["claim"]
            if what == "claim":
                self.claim_durations.append(span)
        if rows.get("claim") or "complete" in rows:
            self.delivery_tx += 1
        if "complete" in rows:
            self.completed += rows["complete"]
            if 0 <= self.target <= self.completed and not self.reached.is_set():
                self.reached_at = time.perf_counter()
                self.reached.set()


class NoopDeliverer(Deliverer):
    """Succeeds at once, doing nothing."""

    default_idempotent = True

    async def deliver(self, delivery: Delivery) -> Outcome:
        return Succeeded()


class DaemonRunner:
    """A real DeliveryDaemon on its own event loop in a thread of this process, probed."""

    def __init__(
        self, dsn: str, deliverers: Mapping[str, Deliverer], settings: DeliverySettings
    ) -> None:
        self.engine = make_async_engine(dsn)
        self.store = AsyncStore(self.engine)
        self.probe = StoreProbe(self.store)
        self.deliverers, self.settings = deliverers, settings
        self.daemon: DeliveryDaemon | None = None
        self.error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="bench-daemon", daemon=True)

    def _main(self) -> None:
        async def main() -> None:
            self.daemon = DeliveryDaemon(self.store, self.deliverers, self.settings)
            self._loop = asyncio.get_running_loop()
            self._ready.set()
            try:
                await self.daemon.run()
            finally:
                await self.store.dispose()

        try:
            asyncio.run(main())
        except BaseException as exc:
            self.error = exc
            self._ready.set()

    def __enter__(self) -> DaemonRunner:
        self._thread.start()
        check(self._ready.wait(30) and self.error is None, f"no daemon: {self.error!r}")
        return self

    def wait(self, event: threading.Event, timeout: float) -> None:
        """Wait for ``event`` while the daemon lives."""
        deadline = time.monotonic() + timeout
        while not event.wait(0.5):
            check(self._thread.is_alive(), f"the daemon stopped: {self.error!r}")
            check(time.monotonic() < deadline, f"not done within {timeout:.0f} s")

    def flush_stats(self) -> None:
        """Make every commit the daemon's pool made so far show in ``pg_stat_database``.

        A backend reports its counts at most once a second, and one that went
        idle within that second waits 10 s more; one that exits reports at once.
        So the pool's idle connections are closed (their backends exit), and as
        many opened again (their first report is at once), without a commit.
        """
        check(self._loop is not None, "no daemon loop")

        async def cycle() -> None:
            await self.engine.dispose()
            conns = [await self.engine.connect() for _ in range(3)]
            for conn in conns:
                await conn.execute(text("SELECT 1"))
            for conn in conns:
                await conn.close()  # a rollback: warm, and nothing committed

        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(cycle(), self._loop).result(30)

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self.daemon is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self.daemon.stop)
        self._thread.join(60)
        check(not self._thread.is_alive(), "the daemon did not stop within 60 s")
        if self.error is not None:
            raise self.error


def daemon_drain(bench: Bench, runner: DaemonRunner, n: int) -> dict[str, Any]:
    """One repetition: a backlog of ``n`` committed at once; time to the last completion."""
    probe = runner.probe
    bench.reset()
    # Let the daemon settle into its idle poll; then measure its idle rate with
    # every commit reported at both ends (see DaemonRunner.flush_stats).
    time.sleep(STATS_SETTLE)
    runner.flush_stats()
    idle_commits, idle_from = bench.xact_commits(), time.perf_counter()
    time.sleep(STATS_SETTLE)
    runner.flush_stats()
    commits, commits_from = bench.xact_commits(), time.perf_counter()
    # Commits per second while idle: the daemon's idle poll and probe, and the
    # read above (one).
    idle_rate = (commits - idle_commits - 1) / (commits_from - idle_from)
    xid = bench.next_xid()
    with bench.backlog(n, NOOP_KIND) as conn:
        probe.arm(n)
        with Meter().measure() as meter:
            started = time.perf_counter()
            conn.commit()
            runner.wait(probe.reached, 600)
    seconds = probe.reached_at - started
    xids = bench.next_xid() - xid - 1  # minus the backlog's own transaction
    runner.flush_stats()
    # Every commit in the database from before the backlog to after the drain,
    # less this function's own (the first read, two next_xid reads, the backlog)
    # and the idle rate for the time outside the drain.
    commits = bench.xact_commits() - commits - 4
    outside = time.perf_counter() - commits_from - seconds
    commits_net = commits - idle_rate * outside
    counts = bench.counts()
    check(counts.get("succeeded") == n == counts["attempt_rows"], f"daemon left {counts}")
    # A claim that took nothing returns one row of NULLs, counted as a row: the
    # rows counted beyond n are such empty claims, not batches.
    batches = max(1, probe.nonempty_claims - max(0, probe.claimed - n))
    claim_s = probe.seconds["claim"]
    complete_s = probe.seconds["complete"] + probe.seconds["complete+claim"]
    return {
        "rate": n / seconds,
        "batches": batches,
        "mean_batch": n / batches,
        # Transactions that claimed rows or recorded outcomes (one that did both
        # counts once); the empty claim that finds the queue drained, and every
        # other store transaction, in the next figure.
        "tx_per_batch": probe.delivery_tx / batches,
        "rode": probe.calls["complete+claim"],
        "xact_commits_per_batch": commits_net / batches,
        "xact_commits_per_batch_raw": commits / batches,
        "idle_commits_per_s": idle_rate,
        "all_tx_per_batch": sum(probe.calls.values()) / batches,
        "claim_ms_per_batch": 1000 * claim_s / batches,
        "complete_ms_per_batch": 1000 * complete_s / batches,
        "other_ms_per_batch": 1000 * (seconds - claim_s - complete_s) / batches,
        "write_xids_per_batch": xids / batches,
        "client_cpu_ms_per_batch": 1000 * meter.client_cpu / batches,
        "server_cpu_ms_per_batch": 1000 * meter.server_cpu / batches,
        "client_cpu_us_per_effect": 1e6 * meter.client_cpu / n,
    }


async def _store_loop(dsn: str, n: int, batch: int) -> dict[str, Any]:
    store = AsyncStore(make_async_engine(dsn))
    quota = [({"kind": NOOP_KIND}, batch)]
    try:
        for _ in range(6):  # warm the pool and the statement on a kind that has no rows
            await store.claim_many(
                EFFECT_QUEUE, [({"kind": "none"}, 1)], owner="x", lease_seconds=30
            )
        done = batches = 0
        claim_s = complete_s = 0.0
        with Meter().measure() as meter:
            while True:
                t = time.perf_counter()
                rows = await store.claim_many(EFFECT_QUEUE, quota, owner="loop", lease_seconds=30)
                claim_s += time.perf_counter() - t
                if not rows:
                    break
                t = time.perf_counter()
                await store.complete("loop", succeeded(rows))
                complete_s += time.perf_counter() - t
                done, batches = done + len(rows), batches + 1
    finally:
        await store.dispose()
    check(done == n, f"store loop drained {done} of {n}")
    return {
        "rate": n / meter.wall,
        "claim_ms_per_batch": 1000 * claim_s / batches,
        "complete_ms_per_batch": 1000 * complete_s / batches,
        "client_cpu_ms_per_batch": 1000 * meter.client_cpu / batches,
        "server_cpu_ms_per_batch": 1000 * meter.server_cpu / batches,
    }


def store_loop_drain(bench: Bench, n: int) -> dict[str, Any]:
    """Diagnostic: the daemon's statements and driver path in a bare loop, no daemon."""
    bench.reset()
    with bench.backlog(n, NOOP_KIND) as conn:
        conn.commit()
    return asyncio.run(_store_loop(bench.dsn, n, 100))


def daemon(bench: Bench, workdir: Path, quick: bool) -> dict[str, Any]:
    n = 5_000 if quick else 20_000
    out: dict[str, Any] = {}
    for name, settings in (
        ("default", DeliverySettings()),
        ("concurrency_100", DeliverySettings(concurrency=100)),
    ):
        backlogs: dict[str, Any] = {}
        with DaemonRunner(bench.dsn, {NOOP_KIND: NoopDeliverer(NOOP_KIND)}, settings) as runner:
            daemon_drain(bench, runner, 1000)  # warm: connections, plans
            sizes = {500: 3 if quick else 9, n: 2 if quick else 5}
            if name != "default":
                sizes = {n: 1 if quick else 3}
            for size, reps in sizes.items():
                backlogs[str(size)] = summarize(
                    [daemon_drain(bench, runner, size) for _ in range(reps)]
                )
                rate = backlogs[str(size)]["rate"]["median"]
                log(f"daemon {name}, backlog {size}: {rate:.0f} effects/s")
        out[name] = {"concurrency": settings.concurrency, "backlogs": backlogs}
    out["store_loop"] = summarize([store_loop_drain(bench, n) for _ in range(1 if quick else 3)])
    log(f"store loop (diagnostic): {out['store_loop']['rate']['median']:.0f} effects/s")
    return out


# -- deliverer processes --------------------------------------------------------------


def process_drain(bench: Bench, procs: list[processes.DelivererProcess], n: int) -> dict[str, Any]:
    bench.reset()
    time.sleep(1.2)  # back to their idle poll (1 s at most)
    cpu = [p.cpu_seconds() for p in procs]
    with bench.backlog(n, NOOP_KIND) as conn, Meter().measure() as meter:
        committed = time.time()
        conn.commit()
        finished = processes.wait_drained(bench, procs, timeout=900)
    began = processes.first_start(bench)
    used = sum(p.cpu_seconds() - c for p, c in zip(procs, cpu, strict=True))
    by_worker = [
        n for _, n in bench.rows("SELECT worker, count(*) FROM outbox_effect_attempts GROUP BY 1")
    ]
    return {
        "rate": n / (finished - began),  # first claim to last completion: the drain itself
        "rate_from_commit": n / (finished - committed),
        "wakeup_ms": 1000 * (began - committed),
        "deliverer_cpu_us_per_effect": 1e6 * used / n,
        # The rest of the machine's busy CPU: PostgreSQL (and this process's polling).
        "other_cpu_us_per_effect": 1e6 * max(0.0, meter.server_cpu - used) / n,
        "share_of_busiest": max(by_worker) / sum(by_worker),
    }


def deliverer_processes(bench: Bench, workdir: Path, quick: bool) -> dict[str, Any]:
    n, reps = (2_000, 2) if quick else (10_000, 3)
    out: dict[str, Any] = {"n": n}
    # The default, two processes, and one whose concurrency equals the batch size
    # (so a claim cannot overlap the previous batch's completion).
    for label, count, options in (
        ("1", 1, []),
        ("2", 2, []),
        ("1_concurrency_100", 1, ["--concurrency", "100"]),
    ):
        procs = processes.start(bench, workdir, NOOP_KIND, count, options)
        try:
            process_drain(bench, procs, min(n, 2000))  # warm: imports, connections, plans
            out[label] = summarize([process_drain(bench, procs, n) for _ in range(reps)])
        finally:
            processes.stop_all(procs)
        log(
            f"{count} deliverer process(es) {options}: {out[label]['rate']['median']:.0f} effects/s"
        )
    return out


# -- Procrastinate --------------------------------------------------------------------


def procrastinate_setup(bench: Bench) -> str:
    dsn = bench.create_database(PROCRASTINATE_DB)
    run_python(["-m", "bench.procrastinate_jobs", dsn, "schema"], timeout=120)
    return dsn


def procrastinate(bench: Bench, workdir: Path, quick: bool) -> dict[str, Any]:
    n, reps = (2_000, 2) if quick else (10_000, 3)
    dsn = procrastinate_setup(bench)
    out: dict[str, Any] = {"n": n}
    for conc in (1,) if quick else (1, 64):
        args = ["drain", "--n", str(n), "--concurrency", str(conc), "--reps", str(reps)]
        got = run_python(["-m", "bench.procrastinate_jobs", dsn, *args], timeout=3600)
        out[str(conc)] = summarize(got)
        log(f"procrastinate, concurrency {conc}: {out[str(conc)]['rate']['median']:.0f} jobs/s")
    return out
