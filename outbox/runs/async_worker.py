"""Async agent workers: many runs of one agent version at once on one event loop.

The async twin of :class:`~outbox.runs.worker.Worker`. Claims, leases,
heartbeats, the sweep (timers, rescue of dead workers' runs, stopping runs),
version pinning and step-failure accounting are the same code
(:class:`~outbox.runs.worker.WorkerCore` and :class:`~outbox.storage.store.Store`'s
methods awaited through :class:`~outbox.storage.async_run_store.AsyncRunStore`).
Each claimed run is a task calling ``await handler(run)`` with an
:class:`~outbox.runs.async_run.AsyncRun`; a run that waits is parked and its
task ends, so ``concurrency`` bounds the runs *working* at once, not those
waiting.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from outbox.errors import LeaseLost, RunTerminal
from outbox.models import Lease, RunRecord, RunStatus
from outbox.retry import wait_or_wake
from outbox.runs.async_run import AsyncRun
from outbox.runs.context import AsyncRunContext
from outbox.runs.run_base import Paused, Suspended
from outbox.runs.stopping import StoppingSweep
from outbox.runs.worker import WorkerCore, WorkerSettings
from outbox.storage.notify import listen
from outbox.storage.sql.common import RUNS_CHANNEL

__all__ = ["AsyncWorker"]

log = logging.getLogger(__name__)

AsyncHandler = Callable[[AsyncRun], Awaitable[Any]]


class AsyncWorker(WorkerCore):
    """Executes runs of ``agent`` at ``version`` as tasks on the running event loop."""

    def __init__(
        self,
        ctx: AsyncRunContext,
        agent: str,
        version: str,
        handler: AsyncHandler,
        settings: WorkerSettings,
    ) -> None:
        super().__init__(ctx, agent, version, settings)
        self.actx = ctx
        self.handler = handler
        self._wake = asyncio.Event()
        #: Set by :meth:`stop`: claim no more. ``_stopping`` follows after the grace
        #: period; until then the sweep keeps renewing the leases of running handlers.
        self._closing = asyncio.Event()
        self._stopping = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()

    def stop(self) -> None:
        """Stop claiming; running handlers get ``grace_seconds`` to finish (call on the loop)."""
        self._closing.set()
        self._wake.set()

    async def run(self) -> None:
        """Work until :meth:`stop`."""
        background = [
            asyncio.create_task(listen(self.ctx.dsn, RUNS_CHANNEL, self._wake)),
            asyncio.create_task(self._sweep()),
        ]
        self._log_start()
        try:
            await self._claim_loop()
        finally:
            if self._tasks:
                _, left = await asyncio.wait(set(self._tasks), timeout=self.settings.grace_seconds)
                if left:
                    log.warning("grace period over: %d runs are left to their leases", len(left))
                    for task in left:
                        task.cancel()
                    await asyncio.gather(*left, return_exceptions=True)
            self._stopping.set()
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)

    # -- claiming ---------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        aio, store = self.actx.aio, self.ctx.store
        idle = 0.01
        while not self._closing.is_set():
            free = self.settings.concurrency - len(self._held)
            rows: list[RunRecord] = []
            if free > 0:
                self._wake.clear()
                try:
                    rows = await aio.call(
                        store.claim_runs,
                        self._quotas(free),
                        owner=self.owner,
                        lease_seconds=self.settings.lease_seconds,
                    )
                except Exception:
                    log.exception("claiming runs failed")
                for record in rows:
                    self._hold(record)
                    task = asyncio.create_task(self._execute(record))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
            if rows and len(rows) >= free:
                continue
            await wait_or_wake(self._wake, idle)
            idle = 0.01 if rows else min(self.settings.poll_seconds, idle * 2)

    # -- one run ------------------------------------------------------------------------

    async def _execute(self, record: RunRecord) -> None:
        lease = Lease(self.owner, record.attempt)
        context = self._context(record, self.owner)
        aio, store = self.actx.aio, self.ctx.store
        try:
            loaded = await aio.call(store.load_run, record.id)
            if loaded is None:
                return
            record = loaded[0]
            if record.agent_version != self.version:
                args = self._upgrade_args(record, lease)
                upgraded = await aio.call(store.upgrade_run, record.id, lease, **args)
                record = self._upgraded(record, upgraded)
            run = AsyncRun(self.actx, record, loaded[1], lease=lease)
            try:
                result = await self.handler(run)
            except Paused:
                self._parked(await aio.call(store.park_paused, run.id, lease), context)
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
                suspended = _suspension_in(exc)
                if isinstance(suspended, Paused):  # inside a task group (parallel tools)
                    self._parked(await aio.call(store.park_paused, run.id, lease), context)
                    return
                if suspended is not None:  # parked inside a task group (parallel tools)
                    self._count("suspended")
                    log.info("run waits", extra=context)
                    return
                failure = self._failure_args(run, exc)
                status = await aio.call(store.record_step_failure, run.id, lease, **failure)
                self._failure_recorded(status, failure, exc, context)
                return
            if run.status not in (RunStatus.COMPLETED, RunStatus.FAILED):
                try:
                    await run.complete(result)
                except (RunTerminal, LeaseLost) as exc:
                    self._count("abandoned")
                    log.warning("could not complete the run: %s", exc, extra=context)
                    return
            self._count("completed")
        except BaseExceptionGroup as group:
            suspended = _suspension_in(group)
            if suspended is None:
                log.exception("worker error on run", extra=context)
            elif isinstance(suspended, Paused):
                self._parked(await aio.call(store.park_paused, record.id, lease), context)
            else:
                self._count("suspended")
        except Exception:
            log.exception("worker error on run", extra=context)
        finally:
            self._release(record.id)
            self._wake.set()

    # -- background -----------------------------------------------------------------------

    async def _sweep(self) -> None:
        aio, store = self.actx.aio, self.ctx.store
        loop = asyncio.get_running_loop()
        last_heartbeat = last_stopping = 0.0
        stopping = StoppingSweep()
        while not self._stopping.is_set():
            await asyncio.sleep(self.settings.sweep_seconds)
            try:
                woken = await aio.call(store.wake_due_runs)
                woken += await aio.call(store.rescue_expired_runs)
                if woken:
                    self._wake.set()
                now = loop.time()
                if now - last_heartbeat >= self.settings.lease_seconds / 3:
                    last_heartbeat = now
                    held = self._held_now()
                    kept = await aio.call(
                        store.extend_run_leases,
                        held,
                        owner=self.owner,
                        lease_seconds=self.settings.lease_seconds,
                    )
                    self._report_lost(held, kept)
                if now - last_stopping >= 1.0:
                    last_stopping = now
                    await aio.run_tx(stopping)
            except Exception:
                log.exception("worker sweep failed")


def _suspension_in(exc: BaseException) -> Suspended | None:
    """The :class:`Suspended` a task group wrapped (a framework running tools in parallel)."""
    if isinstance(exc, Suspended):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _suspension_in(inner)
            if found is not None:
                return found
    if isinstance(exc.__cause__, Suspended):
        return exc.__cause__
    return None
