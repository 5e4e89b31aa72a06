"""The async client: :class:`AsyncOutbox`, the twin of :class:`~outbox.Outbox` for async agents.

The same names and the same semantics, awaited: ``await AsyncOutbox.connect()``,
``await ob.start_run(...)``, ``await run.call(...)``, ``await run.transaction(...)``
(``tx.connection`` is an ``AsyncConnection``), waits, signals, cancellation and
``async with ob.transaction() as tx``. Validation comes from the helpers both
clients call (:mod:`outbox.client_args`), statements from :class:`~outbox.storage.store.Store`
awaited through :class:`~outbox.storage.async_run_store.AsyncRunStore`, and the
rules of a run from :class:`~outbox.runs.run_base.RunBase`.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from outbox.audit_record import record_from_rows
from outbox.chain import Break, stored_values, value_breaks, verify_record
from outbox.client_args import (
    approval_decider,
    cancel_args,
    connect_settings,
    diff_args,
    effect_filters,
    fork_args,
    new_run,
    not_changed,
    reason_args,
    refused,
    resolve_params,
    retry_params,
    run_args,
    run_filters,
    signal_sender,
    started_run,
)
from outbox.effect_diff import RunDiff, diff_effects
from outbox.errors import EffectNotFound, RunNotFound
from outbox.gates import Gate
from outbox.models import Effect, RunRecord, RunStatus
from outbox.runs.approvals import expire_approvals
from outbox.runs.async_run import AsyncOutboxTransaction, AsyncRun
from outbox.runs.async_worker import AsyncWorker
from outbox.runs.context import AsyncRunContext, VersionUpgrades
from outbox.runs.control import fork_run, pause_run, resume_run
from outbox.runs.signals import SignalReceipt
from outbox.runs.stopping import (
    advance_stopping_run,
    advance_stopping_runs,
    cancel_run,
    canceller,
)
from outbox.runs.worker import WorkerSettings
from outbox.settings import Settings
from outbox.storage import AsyncConnection, AsyncEngine
from outbox.storage.async_run_store import AsyncRunStore
from outbox.storage.engine import open_async_engine
from outbox.storage.notify import Notifier, WakeupThrottle
from outbox.storage.sql.common import EFFECTS_CHANNEL, RUNS_CHANNEL
from outbox.tracing import current_traceparent, run_span
from outbox.validation import as_uuid, name_field, row_limit, validated

__all__ = ["AsyncOutbox", "BlockingAsyncWorker"]

log = logging.getLogger(__name__)


class AsyncOutbox:
    """Entry point for async agents: a connection pool on the outbox store.

    Use ``await AsyncOutbox.connect()``; ``await ob.close()`` (or ``async with``)
    when done. One instance serves every task of its event loop.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        settings: Settings | None = None,
        *,
        upgrades: VersionUpgrades | None = None,
    ) -> None:
        self.settings = settings or Settings()
        self.engine = engine
        self.aio = AsyncRunStore(engine)
        dsn = self.aio.dsn
        window = self.settings.notify_window_ms / 1000
        # The trailing NOTIFY is sent from the throttle's thread, on a connection of its own.
        self._notifier = Notifier(dsn)
        self._effects_wakeup = WakeupThrottle(
            lambda: self._notifier.send(EFFECTS_CHANNEL), window_s=window
        )
        self._runs_wakeup = WakeupThrottle(
            lambda: self._notifier.send(RUNS_CHANNEL), window_s=window
        )
        #: Agent-version upgrades workers of this client may apply (:meth:`register_upgrade`).
        self.upgrades = upgrades or VersionUpgrades()
        self._ctx = AsyncRunContext(
            self.aio.sync,
            self.settings,
            self._effects_wakeup,
            self._runs_wakeup,
            self.upgrades,
            aio=self.aio,
        )

    @classmethod
    async def connect(
        cls, dsn: str | None = None, *, settings: Settings | None = None, **overrides: Any
    ) -> AsyncOutbox:
        """Connect to ``dsn``, else ``OUTBOX_DSN``, else the embedded PostgreSQL in ``./.outbox``.

        As :meth:`outbox.Outbox.connect`; starting the embedded server and
        checking the schema happen in a thread, off the event loop.
        """
        settings = connect_settings(dsn, settings, overrides)
        engine = await asyncio.to_thread(open_async_engine, settings)
        return cls(engine, settings)

    async def close(self) -> None:
        """Send owed wake-ups and release every connection."""
        await asyncio.to_thread(self._effects_wakeup.close)
        await asyncio.to_thread(self._runs_wakeup.close)
        await asyncio.to_thread(self._notifier.close)
        await self.aio.dispose()

    async def __aenter__(self) -> AsyncOutbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- runs -------------------------------------------------------------------

    async def start_run(
        self,
        agent: str,
        version: str,
        inputs: Any = None,
        *,
        budget: float | None = None,
        run_id: uuid.UUID | str | None = None,
        key: str | None = None,
        on_conflict: str = "return_existing",
        priority: int = 0,
        fairness_key: str = "",
        mode: str = "live",
    ) -> AsyncRun:
        """Start a run of ``agent`` pinned to ``version`` (see :meth:`outbox.Outbox.start_run`)."""
        new = new_run(
            self.settings,
            agent,
            version,
            inputs,
            budget=budget,
            run_id=run_id,
            key=key,
            on_conflict=on_conflict,
            priority=priority,
            fairness_key=fairness_key,
            mode=mode,
        )
        notify = self._runs_wakeup.inline()
        with run_span(agent=new.start.agent, version=new.start.version):
            # The run's trace: its steps are spans of it, in whichever process.
            start = replace(new.start, trace_parent=current_traceparent(), wake=notify is not None)
            record, created = await self.aio.call(self.aio.sync.insert_run, start)
        if created:
            self._runs_wakeup.committed(notify)
        record = started_run(new, record, created)
        log.info("run started", extra={"run_id": str(record.id), "agent": agent})
        if not created:
            return await self.run(record.id)
        run = AsyncRun(self._ctx, record, [])
        run.started = True
        return run

    async def run(self, run_id: uuid.UUID | str, *, step_id: str | None = None) -> AsyncRun:
        """Load a run (in any process) to inspect or resume it.

        With ``step_id``, the handle knows only that step of the run's history
        (if it was recorded): it reads two rows, not every step, for a caller
        that records that one step and lets the handle go (the HTTP API does,
        per request). That step replays as always; its ``completed_steps``
        lists at most that step, so use a full handle for anything else.
        """
        rid = run_args(run_id, step_id)
        loaded = await self.aio.call(self.aio.sync.load_run, rid, step_id)
        if loaded is None:
            raise RunNotFound(rid)
        return AsyncRun(self._ctx, *loaded)

    async def runs(
        self, *, status: str | None = None, agent: str | None = None, limit: int = 100
    ) -> list[RunRecord]:
        """Recent runs, newest first."""
        filters = run_filters(status=status, agent=agent, limit=limit)
        return await self.aio.call(self.aio.sync.list_runs, **filters)

    async def diff_runs(self, run_a: uuid.UUID | str, run_b: uuid.UUID | str) -> RunDiff:
        """Compare the effects two runs intended (see :meth:`outbox.Outbox.diff_runs`)."""
        a, b = diff_args(run_a, run_b)
        sync = self.aio.sync
        found = {
            rid: await self.aio.call(sync.list_effects, run_id=rid, limit=1_000_000)
            for rid in (a, b)
        }
        for rid in (a, b):
            if not found[rid] and await self.aio.call(sync.load_run, rid) is None:
                raise RunNotFound(rid)
        return diff_effects(a, found[a], b, found[b])

    # -- the tamper-evident record --------------------------------------------------

    async def audit_record(self, run_id: uuid.UUID | str) -> dict[str, Any]:
        """A self-contained record of a run (see :meth:`outbox.Outbox.audit_record`)."""
        return (await self.checked_record(run_id))[0]

    async def checked_record(self, run_id: uuid.UUID | str) -> tuple[dict[str, Any], list[Break]]:
        """A run's record and every break in it (see :meth:`outbox.Outbox.checked_record`)."""
        rid = as_uuid(run_id, "run_id")
        rows = await self.aio.call(self.aio.sync.audit_rows, rid)
        if not rows:
            raise RunNotFound(rid)
        record = record_from_rows(rows, exported_at=datetime.now(UTC))
        return record, verify_record(record) + value_breaks(stored_values(rows), rows["blobs"])

    async def verify_run(self, run_id: uuid.UUID | str) -> list[Break]:
        """Recompute a run's hash chains and value digests from the database: every break."""
        return (await self.checked_record(run_id))[1]

    # -- effects ----------------------------------------------------------------

    async def effect(self, effect_id: uuid.UUID | str) -> Effect:
        """One effect by id."""
        eid = as_uuid(effect_id, "effect_id")
        found = await self.aio.call(self.aio.sync.get_effect, eid)
        if found is None:
            raise EffectNotFound(eid)
        return found

    async def effects(
        self,
        *,
        run_id: uuid.UUID | str | None = None,
        step_id: str | None = None,
        status: str | None = None,
        kind: str | None = None,
        limit: int = 100,
    ) -> list[Effect]:
        """Effects in intent order, filtered by run (and step of that run), status or kind."""
        filters = effect_filters(
            run_id=run_id, step_id=step_id, status=status, kind=kind, limit=limit
        )
        return await self.aio.call(self.aio.sync.list_effects, **filters)

    async def resolve_effect(
        self, effect_id: uuid.UUID | str, *, outcome: str, note: str, operator: str
    ) -> Effect:
        """Close an ``unknown`` effect (see :meth:`outbox.Outbox.resolve_effect`)."""
        params = resolve_params(outcome=outcome, note=note, operator=operator)
        effect = await self.effect(effect_id)
        changed = await self.aio.call(
            self.aio.sync.operator_change, "resolve", {"effect_id": effect.id, **params}
        )
        if not changed:
            raise not_changed(effect, "resolve")
        if outcome == "retry":
            self._effects_wakeup.committed(None)
        return await self.effect(effect.id)

    async def retry_effect(
        self,
        effect_id: uuid.UUID | str,
        *,
        operator: str,
        extra_attempts: int = 3,
        note: str | None = None,
    ) -> Effect:
        """Put a ``failed`` effect back to ``pending`` (same key) with ``extra_attempts`` tries."""
        params = retry_params(extra_attempts=extra_attempts, operator=operator, note=note)
        effect = await self.effect(effect_id)
        changed = await self.aio.call(
            self.aio.sync.operator_change, "retry", {"effect_id": effect.id, **params}
        )
        if not changed:
            raise not_changed(effect, "retry")
        self._effects_wakeup.committed(None)
        return await self.effect(effect.id)

    # -- approvals ----------------------------------------------------------------

    async def approve_effect(
        self,
        effect_id: uuid.UUID | str,
        *,
        digest: str,
        note: str,
        by: str,
        request_id: str | None = None,
        via: str = "api",
    ) -> Effect:
        """Release a held effect if ``digest`` is its payload's (see ``Outbox.approve_effect``)."""
        decide_in = approval_decider(
            effect_id,
            approve=True,
            digest=digest,
            note=note,
            by=by,
            via=via,
            request_id=request_id,
        )
        decision = await self.aio.run_tx(decide_in)
        refused(decision)
        self._effects_wakeup.committed(None)
        return await self.effect(decision.effect_id)

    async def reject_effect(
        self,
        effect_id: uuid.UUID | str,
        *,
        note: str,
        by: str,
        digest: str | None = None,
        request_id: str | None = None,
        via: str = "api",
    ) -> Effect:
        """End a held effect as ``rejected`` (see ``Outbox.reject_effect``)."""
        decide_in = approval_decider(
            effect_id,
            approve=False,
            digest=digest,
            note=note,
            by=by,
            via=via,
            request_id=request_id,
        )
        decision = await self.aio.run_tx(decide_in)
        refused(decision)
        self._runs_wakeup.committed(None)
        return await self.effect(decision.effect_id)

    async def expire_approvals(self, max_rows: int = 100) -> dict[str, int]:
        """Apply ``on_timeout`` to held effects past their deadline."""
        limit = row_limit(max_rows)
        return await self.aio.run_tx(lambda tx: expire_approvals(tx, limit))

    async def apply_gates(self, gates: list[Gate], *, prune: bool = False) -> list[str]:
        """Store approval gates (see ``Outbox.apply_gates``)."""
        rows = [g.row() for g in gates]
        return await self.aio.call(self.aio.sync.apply_gates, rows, prune=prune)

    async def gates(self) -> list[Gate]:
        """The approval gates in force, by name."""
        return [Gate.from_row(r) for r in await self.aio.call(self.aio.sync.list_gates)]

    async def remove_gates(self, names: list[str]) -> list[str]:
        """Remove gates by name; returns those that existed."""
        return await self.aio.call(self.aio.sync.remove_gates, names)

    @asynccontextmanager
    async def transaction(
        self, connection: AsyncConnection | None = None
    ) -> AsyncIterator[AsyncOutboxTransaction]:
        """Intents that belong to no run, committed with the caller's rows (plain outbox use).

        ``async with ob.transaction() as tx: await tx.intend(...)``. With
        ``connection`` (an ``AsyncConnection``), the intents join the caller's
        open transaction (in a savepoint) and commit when the caller commits.
        """
        async with self.aio.begin(connection) as conn:
            tx = AsyncOutboxTransaction(self._ctx, conn)
            yield tx
            await tx._flush()
        if connection is None:
            self._effects_wakeup.committed(tx._notified)

    # -- run control ----------------------------------------------------------------

    async def pause(self, run_id: uuid.UUID | str, reason: str) -> RunStatus:
        """Pause a run (see :meth:`outbox.Outbox.pause`); returns ``paused`` or ``running``."""
        rid = reason_args(run_id, reason, "paused")
        return await self.aio.run_tx(lambda tx: pause_run(tx, rid, reason))

    async def resume(self, run_id: uuid.UUID | str) -> RunStatus:
        """Lift a pause (see :meth:`outbox.Outbox.resume`)."""
        rid = as_uuid(run_id, "run_id")
        return await self.aio.run_tx(lambda tx: resume_run(tx, rid))

    async def fork(
        self,
        run_id: uuid.UUID | str,
        from_step: str,
        *,
        version: str | None = None,
        fork_id: uuid.UUID | str | None = None,
        allow_unsettled: bool = False,
    ) -> AsyncRun:
        """Fork a run from a step (see :meth:`outbox.Outbox.fork`)."""
        original, new_id, step, pinned = fork_args(run_id, from_step, version, fork_id)
        await self.aio.run_tx(
            lambda tx: fork_run(
                tx, original, step, fork_id=new_id, version=pinned, allow_unsettled=allow_unsettled
            )
        )
        return await self.run(new_id)

    # -- signals, stopping, versions ----------------------------------------------

    async def signal(
        self,
        run_id: uuid.UUID | str,
        name: str,
        payload: Any = None,
        *,
        dedup_key: str | None = None,
        request_id: str | None = None,
    ) -> SignalReceipt:
        """Send signal ``name`` with a JSON ``payload`` to a run (``Outbox.signal``'s twin)."""
        send = signal_sender(self.settings, run_id, name, payload, dedup_key, request_id)
        return await self.aio.run_tx(send)

    async def cancel(
        self, run_id: uuid.UUID | str, reason: str, *, by: str | None = None, via: str = "api"
    ) -> RunStatus:
        """Stop a run (see :meth:`outbox.Outbox.cancel`, who and why logged); returns its status."""
        rid = cancel_args(run_id, reason)
        who, where = canceller(by, via)
        await self.aio.run_tx(lambda tx: cancel_run(tx, rid, reason, by=who, via=where))
        status = await self.aio.run_tx(lambda tx: advance_stopping_run(tx, rid))
        self._effects_wakeup.committed(None)
        return status

    async def advance_stopping_runs(self) -> dict[str, int]:
        """Move cancelling and compensating runs on (workers and deliverers do this on a timer)."""
        return await self.aio.run_tx(advance_stopping_runs)

    async def run_versions(self) -> list[dict[str, Any]]:
        """Unfinished runs per agent, version and status (a version with none may retire)."""
        return await self.aio.call(self.aio.sync.run_versions)

    def register_upgrade(
        self, agent: str, from_version: str, to_version: str, fn: Callable[[Any], Any]
    ) -> None:
        """Let workers of ``to_version`` take runs of ``from_version`` (see ``Outbox``'s)."""
        self.upgrades.register(agent, from_version, to_version, fn)

    def worker(
        self,
        agent: str,
        version: str,
        handler: Callable[[AsyncRun], Awaitable[Any]],
        **settings: Any,
    ) -> AsyncWorker:
        """An async worker: ``await handler(run)`` for up to ``concurrency`` runs at once.

        ``await worker.run()`` works until ``worker.stop()`` (called on the same
        loop). Leases, heartbeats, waits and version pinning are those of the
        sync worker. Settings: see :class:`~outbox.WorkerSettings`.
        """
        name_field(agent, "agent")
        name_field(version, "version", max_length=100)
        return AsyncWorker(
            self._ctx, agent, version, handler, validated(WorkerSettings, **settings)
        )


class BlockingAsyncWorker:
    """An :class:`AsyncWorker` with the sync worker's face: ``run()`` blocks, ``stop()`` anywhere.

    What ``Outbox.worker`` (and ``outbox worker``) returns for an ``async def``
    handler: ``run()`` opens an :class:`AsyncOutbox` on its own event loop.
    """

    def __init__(
        self,
        settings: Settings,
        upgrades: VersionUpgrades,
        agent: str,
        version: str,
        handler: Callable[[AsyncRun], Awaitable[Any]],
        worker_settings: WorkerSettings,
    ) -> None:
        self.settings = settings
        self.upgrades = upgrades
        self.agent = agent
        self.version = version
        self.handler = handler
        self.worker_settings = worker_settings
        self.worker: AsyncWorker | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_requested = False

    @property
    def counts(self) -> dict[str, int]:
        """Handler outcomes so far (see :attr:`outbox.Worker.counts`)."""
        return {} if self.worker is None else dict(self.worker.counts)

    def run(self) -> None:
        """Work until :meth:`stop`."""
        asyncio.run(self._main())

    async def _main(self) -> None:
        engine = await asyncio.to_thread(open_async_engine, self.settings)
        ob = AsyncOutbox(engine, self.settings, upgrades=self.upgrades)
        try:
            self.worker = ob.worker(
                self.agent, self.version, self.handler, **self.worker_settings.model_dump()
            )
            self._loop = asyncio.get_running_loop()
            if self._stop_requested:
                return
            await self.worker.run()
        finally:
            await ob.close()

    def stop(self) -> None:
        """Stop claiming (from any thread or a signal handler); handlers get their grace."""
        self._stop_requested = True
        loop, worker = self._loop, self.worker
        if loop is not None and worker is not None and not loop.is_closed():
            loop.call_soon_threadsafe(worker.stop)
