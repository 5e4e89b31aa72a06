"""The async client: :class:`AsyncOutbox`, the twin of :class:`~outbox.Outbox` for async agents.

The same names and the same semantics, awaited: ``await AsyncOutbox.connect()``,
``await ob.start_run(...)``, ``await run.call(...)``, ``await run.transaction(...)``
(``tx.connection`` is an ``AsyncConnection``), waits, signals, cancellation and
``async with ob.transaction() as tx``. Every operation that is not about
waiting is :mod:`outbox.client_core`'s sync method, awaited through a greenlet
on the async driver (:meth:`~outbox.storage.async_run_store.AsyncRunStore.call`):
one implementation, two faces. The rules of a run come from
:class:`~outbox.runs.run_base.RunBase`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, Concatenate, ParamSpec, TypeVar

from outbox.client_core import ClientCore, LoadedRun, connect_settings, exposed
from outbox.runs.async_run import AsyncOutboxTransaction, AsyncRun
from outbox.runs.async_worker import AsyncWorker
from outbox.runs.context import AsyncRunContext, VersionUpgrades
from outbox.runs.worker import WorkerSettings
from outbox.settings import Settings
from outbox.storage import AsyncConnection, AsyncEngine
from outbox.storage.async_run_store import AsyncRunStore
from outbox.storage.engine import open_async_engine
from outbox.storage.notify import Notifier, WakeupThrottle
from outbox.storage.sql.common import EFFECTS_CHANNEL, RUNS_CHANNEL
from outbox.validation import name_field, validated

__all__ = ["AsyncOutbox", "BlockingAsyncWorker"]

P = ParamSpec("P")
T = TypeVar("T")


def _awaited(
    operation: Callable[Concatenate[ClientCore, P], T],
) -> Callable[Concatenate[AsyncOutbox, P], Coroutine[Any, Any, T]]:
    """``operation`` (a sync method of the core), awaited on the async driver."""

    @exposed(operation)
    async def method(self: AsyncOutbox, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self.aio.call(operation, self._core, *args, **kwargs)

    return method


def _handle(
    operation: Callable[Concatenate[ClientCore, P], LoadedRun], name: str | None = None
) -> Callable[Concatenate[AsyncOutbox, P], Coroutine[Any, Any, AsyncRun]]:
    """An async client method that returns an :class:`AsyncRun` on what ``operation`` loaded."""

    @exposed(operation, name, returns=AsyncRun)
    async def method(self: AsyncOutbox, /, *args: P.args, **kwargs: P.kwargs) -> AsyncRun:
        loaded = await self.aio.call(operation, self._core, *args, **kwargs)
        run = AsyncRun(self._ctx, loaded.record, loaded.steps)
        run.started = loaded.started
        return run

    return method


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
        window = self.settings.notify_window_ms / 1000
        # The trailing NOTIFY is sent from the throttle's thread, on a connection of its own.
        self._notifier = Notifier(self.aio.dsn)
        self._ctx = AsyncRunContext(
            self.aio.sync,
            self.settings,
            WakeupThrottle(lambda: self._notifier.send(EFFECTS_CHANNEL), window_s=window),
            WakeupThrottle(lambda: self._notifier.send(RUNS_CHANNEL), window_s=window),
            upgrades or VersionUpgrades(),
            aio=self.aio,
        )
        self._core = ClientCore(self._ctx)
        #: Agent-version upgrades workers of this client may apply (:meth:`register_upgrade`).
        self.upgrades = self._ctx.upgrades

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
        await asyncio.to_thread(self._ctx.effects_wakeup.close)
        await asyncio.to_thread(self._ctx.runs_wakeup.close)
        await asyncio.to_thread(self._notifier.close)
        await self.aio.dispose()

    async def __aenter__(self) -> AsyncOutbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- the operations, awaited (documented in outbox.client_core) ---------------------

    start_run = _handle(ClientCore._start_run)
    run = _handle(ClientCore._load_run, name="run")
    fork = _handle(ClientCore._fork)
    runs = _awaited(ClientCore.runs)
    diff_runs = _awaited(ClientCore.diff_runs)
    run_versions = _awaited(ClientCore.run_versions)
    pause = _awaited(ClientCore.pause)
    resume = _awaited(ClientCore.resume)
    signal = _awaited(ClientCore.signal)
    cancel = _awaited(ClientCore.cancel)
    advance_stopping_runs = _awaited(ClientCore.advance_stopping_runs)
    audit_record = _awaited(ClientCore.audit_record)
    checked_record = _awaited(ClientCore.checked_record)
    verify_run = _awaited(ClientCore.verify_run)
    audited_runs = _awaited(ClientCore.audited_runs)
    effect = _awaited(ClientCore.effect)
    effects = _awaited(ClientCore.effects)
    resolve_effect = _awaited(ClientCore.resolve_effect)
    retry_effect = _awaited(ClientCore.retry_effect)
    approve_effect = _awaited(ClientCore.approve_effect)
    reject_effect = _awaited(ClientCore.reject_effect)
    expire_approvals = _awaited(ClientCore.expire_approvals)
    apply_gates = _awaited(ClientCore.apply_gates)
    gates = _awaited(ClientCore.gates)
    remove_gates = _awaited(ClientCore.remove_gates)

    def register_upgrade(
        self, agent: str, from_version: str, to_version: str, fn: Callable[[Any], Any]
    ) -> None:
        """Let workers of ``to_version`` take runs of ``from_version`` (see ``Outbox``'s)."""
        self._core.register_upgrade(agent, from_version, to_version, fn)

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
            self._ctx.effects_wakeup.committed(tx._notified)

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
