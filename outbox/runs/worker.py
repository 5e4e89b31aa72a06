"""Agent workers: claim runnable runs of one agent version, run the handler, keep the lease.

A worker claims runs with the same claim/lease/fence machinery the deliverers
use (:mod:`outbox.storage.sql.queue`), calls ``handler(run)`` in a thread of its own, and pushes
its leases out while handlers run. A run whose worker died becomes runnable
again when its lease expires and is resumed by another worker: its recorded
steps replay, so the handler continues at the first step not yet recorded.

A background sweep (every worker runs it; compare-and-set makes duplicates
harmless) fires due timers, rescues runs of dead workers, and moves cancelled
runs through compensation. A ``LISTEN`` connection wakes the claim loop when a
run becomes runnable.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field

from outbox.blobs import store_value
from outbox.errors import BudgetExceeded, LeaseLost, RunTerminal
from outbox.faults import crash_point
from outbox.governance.intent_rules import MAX_DELAY_SECONDS
from outbox.ids import default_owner
from outbox.models import Lease, RunRecord, RunStatus
from outbox.payloads import decode, encode
from outbox.retry import RetryPolicy
from outbox.runs.context import RunContext, StateUpgrade
from outbox.runs.run import Run, Suspended
from outbox.runs.run_base import Paused, RunBase
from outbox.runs.stopping import StoppingSweep
from outbox.storage.notify import listen_blocking
from outbox.storage.sql.common import RUNS_CHANNEL

__all__ = ["Worker", "WorkerCore", "WorkerSettings"]

log = logging.getLogger(__name__)


class WorkerSettings(BaseModel):
    """How one agent worker behaves."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    #: Runs worked on at once (a run parked in a wait does not count).
    concurrency: int = Field(default=4, ge=1, le=1000)
    #: Seconds a claimed run is leased; heartbeats extend it three times per lease.
    lease_seconds: float = Field(default=30.0, gt=0, le=86_400)
    #: Longest wait between claims when idle (a NOTIFY usually wakes the worker sooner).
    poll_seconds: float = Field(default=1.0, gt=0, le=3600)
    #: How often timers are fired, runs of dead workers rescued and stopping runs moved on.
    sweep_seconds: float = Field(default=0.25, gt=0, le=3600)
    #: A step that raises is retried this many times before the run fails.
    max_step_retries: int = Field(default=3, ge=0, le=1000)
    #: Backoff before a failed step's run is retried: doubling from this...
    retry_base_seconds: float = Field(default=1.0, ge=0, le=86_400)
    #: ... up to this (a ``retry_after`` attribute on the exception wins).
    retry_cap_seconds: float = Field(default=300.0, ge=0, le=MAX_DELAY_SECONDS)
    #: On stop, how long running handlers may take to finish (their leases are kept);
    #: a handler still running then is left to its lease.
    grace_seconds: float = Field(default=30.0, ge=0, le=86_400)
    #: This worker's name in leases and logs (default: host, process id and a random part).
    owner: str = Field(default_factory=default_owner)


class WorkerCore:
    """What the sync and the async worker share: claims, upgrades, failures, leases (no I/O)."""

    def __init__(self, ctx: RunContext, agent: str, version: str, settings: WorkerSettings) -> None:
        self.ctx = ctx
        self.agent = agent
        self.version = version
        self.settings = settings
        self.owner = settings.owner
        self._held: dict[UUID, int] = {}
        self._lock = threading.Lock()
        self._policy = RetryPolicy(settings.retry_base_seconds, settings.retry_cap_seconds)
        #: Handler outcomes so far: completed, failed, suspended, paused, retried, abandoned.
        self.counts: dict[str, int] = {}

    def _upgrades(self) -> dict[str, StateUpgrade]:
        return self.ctx.upgrades.into(self.agent, self.version)

    def _log_start(self) -> None:
        log.info(
            "worker %s: %s %s (also from %s)",
            self.owner,
            self.agent,
            self.version,
            sorted(self._upgrades()) or "no other version",
        )

    def _quotas(self, free: int) -> list[tuple[dict[str, str], int]]:
        """The partitions this worker claims from: its version, then those it may upgrade."""
        versions = [self.version, *self._upgrades()]
        return [({"agent": self.agent, "agent_version": v}, free) for v in versions]

    def _count(self, outcome: str) -> None:
        with self._lock:
            self.counts[outcome] = self.counts.get(outcome, 0) + 1

    def _hold(self, record: RunRecord) -> None:
        with self._lock:
            self._held[record.id] = record.attempt

    def _release(self, run_id: UUID) -> None:
        with self._lock:
            self._held.pop(run_id, None)

    def _held_now(self) -> list[tuple[UUID, int]]:
        with self._lock:
            return list(self._held.items())

    @staticmethod
    def _context(record: RunRecord, owner: str) -> dict[str, Any]:
        return {"run_id": str(record.id), "worker": owner, "attempt": record.attempt}

    def _upgrade_args(self, record: RunRecord, lease: Lease) -> dict[str, Any]:
        """``Store.upgrade_run`` arguments: the registered upgrade applied to the run's state.

        ``record`` is the run as loaded (its values read back, not references).
        """
        fn = self._upgrades()[record.agent_version]
        state = store_value(fn(record.state), field="state", limits=self.ctx.settings.value_limits)
        return {
            "from_version": record.agent_version,
            "to_version": self.version,
            "state_json": state.json,
            "blobs": [state.blob],
        }

    def _upgraded(self, record: RunRecord, upgraded: RunRecord | None) -> RunRecord:
        if upgraded is None:
            raise LeaseLost(f"run_id={str(record.id)!r}: lost while upgrading")
        crash_point("after_upgrade", f"{record.agent_version}->{self.version}", run=record.id)
        log.info(
            "run upgraded %s -> %s",
            record.agent_version,
            self.version,
            extra={"run_id": str(record.id)},
        )
        return upgraded

    def _failure_args(self, run: RunBase, exc: Exception) -> dict[str, Any]:
        """``Store.record_step_failure`` arguments for a step that raised ``exc``.

        Over budget, the run fails now with the budget error: the budget does
        not grow by waiting, so a retry would only be refused again (after
        paying for another model call, when the step makes one).
        """
        over_budget = _over_budget(exc)
        if over_budget is not None:
            exc = over_budget  # the error worth recording, even inside a task group's
        step = run.active_step or "<handler>"
        failures = run.record.step_retries.get(step, 0) + 1
        delay = self._policy.backoff(failures)
        retry_after = getattr(exc, "retry_after", None)
        if isinstance(retry_after, int | float):
            delay = max(delay, float(retry_after))
        failure = {
            "step": step,
            "type": type(exc).__name__,
            "message": str(exc)[:2000],
            "traceback": "".join(traceback.format_exception(exc))[-4000:],
            "failures": failures,
        }
        return {
            "step": step,
            "max_retries": 0 if over_budget is not None else self.settings.max_step_retries,
            "delay": delay,
            "failure_json": encode(failure, field="error"),
        }

    def _failure_recorded(
        self, status: str | None, args: dict[str, Any], exc: Exception, context: dict[str, Any]
    ) -> None:
        step = args["step"]
        failures = decode(args["failure_json"])["failures"]
        if status == "failed":
            self._count("failed")
            log.warning(
                "run failed at step %s after %d failures: %s", step, failures, exc, extra=context
            )
        elif status == "runnable":
            self._count("retried")
            log.info(
                "step %s failed (%s); retry %d in %.1fs",
                step,
                exc,
                failures,
                args["delay"],
                extra=context,
            )
        else:
            self._count("abandoned")

    def _parked(self, status: str | None, context: dict[str, Any]) -> None:
        """A pause waited for the step just recorded; the run was let go (``Store.park_paused``)."""
        self._count("paused" if status == "paused" else "abandoned")
        log.info("run let go after its step: %s", status or "no longer ours", extra=context)

    @staticmethod
    def _report_lost(held: list[tuple[UUID, int]], kept: set[UUID]) -> None:
        for run_id, _ in held:
            if run_id not in kept:
                log.warning("lease on run %s was lost", run_id, extra={"run_id": str(run_id)})


def _over_budget(exc: BaseException) -> BudgetExceeded | None:
    """The :class:`BudgetExceeded` behind ``exc``: itself, in a task group, or its cause."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, BudgetExceeded):
            return current
        if isinstance(current, BaseExceptionGroup):
            todo.extend(current.exceptions)
        if current.__cause__ is not None:
            todo.append(current.__cause__)
    return None


class Worker(WorkerCore):
    """Executes runs of ``agent`` at ``version`` (and of older versions upgraded to it)."""

    def __init__(
        self,
        ctx: RunContext,
        agent: str,
        version: str,
        handler: Callable[[Run], Any],
        settings: WorkerSettings,
    ) -> None:
        super().__init__(ctx, agent, version, settings)
        self.handler = handler
        self._wake = threading.Event()
        #: Set by :meth:`stop`: claim no more. ``_stopping`` follows after the grace
        #: period; until then the sweep keeps renewing the leases of running handlers.
        self._closing = threading.Event()
        self._stopping = threading.Event()

    # -- lifecycle ------------------------------------------------------------------

    def stop(self) -> None:
        """Stop claiming; running handlers get ``grace_seconds`` to finish."""
        self._closing.set()
        self._wake.set()

    def run(self) -> None:
        """Work until :meth:`stop` (call it from another thread or a signal handler)."""
        background = [
            threading.Thread(target=self._listen, name="outbox-worker-listen", daemon=True),
            threading.Thread(target=self._sweep, name="outbox-worker-sweep", daemon=True),
        ]
        for thread in background:
            thread.start()
        self._log_start()
        try:
            self._claim_loop()
        finally:
            deadline = time.monotonic() + self.settings.grace_seconds
            while self._held and time.monotonic() < deadline:
                time.sleep(0.02)
            if self._held:
                # Their threads are daemons: they do not hold the process open. Their
                # leases are no longer renewed, so the runs resume elsewhere.
                log.warning("grace period over: %d runs are left to their leases", len(self._held))
            self._stopping.set()
            for thread in background:  # they notice within a second
                thread.join(timeout=5)

    # -- claiming ---------------------------------------------------------------------

    def _claim_loop(self) -> None:
        idle = 0.01
        while not self._closing.is_set():
            free = self.settings.concurrency - len(self._held)
            rows: list[RunRecord] = []
            if free > 0:
                self._wake.clear()
                try:
                    rows = self.ctx.store.claim_runs(
                        self._quotas(free),
                        owner=self.owner,
                        lease_seconds=self.settings.lease_seconds,
                    )
                except Exception:
                    log.exception("claiming runs failed")
                for record in rows:
                    self._hold(record)
                    # One daemon thread per run (at most ``concurrency``): a handler
                    # still running when the grace period ends must not keep the
                    # process alive, as a pool's threads would at exit.
                    thread = threading.Thread(
                        target=self._execute, args=(record,), name="outbox-run", daemon=True
                    )
                    try:
                        thread.start()
                    except RuntimeError:  # the interpreter is exiting; the lease will expire
                        self._closing.set()
                        break
            if rows and len(rows) >= free:
                continue
            self._wake.wait(idle)
            idle = 0.01 if rows else min(self.settings.poll_seconds, idle * 2)

    # -- one run ------------------------------------------------------------------------

    def _execute(self, record: RunRecord) -> None:
        lease = Lease(self.owner, record.attempt)
        context = self._context(record, self.owner)
        store = self.ctx.store
        try:
            loaded = store.load_run(record.id)
            if loaded is None:
                return
            record = loaded[0]
            if record.agent_version != self.version:
                upgraded = store.upgrade_run(record.id, lease, **self._upgrade_args(record, lease))
                record = self._upgraded(record, upgraded)
            run = Run(self.ctx, record, loaded[1], lease=lease)
            try:
                result = self.handler(run)
            except Paused:
                self._parked(store.park_paused(run.id, lease), context)
                return
            except Suspended:
                self._count("suspended")
                log.info("run waits", extra=context)
                return
            except (RunTerminal, LeaseLost) as exc:
                self._count("abandoned")
                log.warning("run left by this worker: %s", exc, extra=context)
                return
            except Exception as exc:
                args = self._failure_args(run, exc)
                status = store.record_step_failure(run.id, lease, **args)
                self._failure_recorded(status, args, exc, context)
                return
            if run.status not in (RunStatus.COMPLETED, RunStatus.FAILED):
                try:
                    run.complete(result)
                except (RunTerminal, LeaseLost) as exc:
                    self._count("abandoned")
                    log.warning("could not complete the run: %s", exc, extra=context)
                    return
            self._count("completed")
        except Exception:
            log.exception("worker error on run", extra=context)
        finally:
            self._release(record.id)
            self._wake.set()

    # -- background -----------------------------------------------------------------------

    def _listen(self) -> None:
        listen_blocking(self.ctx.dsn, RUNS_CHANNEL, self._wake, self._stopping)

    def _sweep(self) -> None:
        last_heartbeat = last_stopping = 0.0
        store, stopping = self.ctx.store, StoppingSweep()
        while not self._stopping.is_set():
            time.sleep(self.settings.sweep_seconds)
            try:
                woken = store.wake_due_runs()
                woken += store.rescue_expired_runs()
                if woken:
                    self._wake.set()
                now = time.monotonic()
                if now - last_heartbeat >= self.settings.lease_seconds / 3:
                    last_heartbeat = now
                    held = self._held_now()
                    kept = store.extend_run_leases(
                        held, owner=self.owner, lease_seconds=self.settings.lease_seconds
                    )
                    self._report_lost(held, kept)
                if now - last_stopping >= 1.0:
                    last_stopping = now
                    with store.run_tx() as tx:
                        stopping(tx)
            except Exception:
                log.exception("worker sweep failed")
