"""The client library agents use: start a run, record tool calls, commit atomic steps.

A step's checkpoint, its intents and the caller's own rows are written in one
transaction (G1). Every step id is recorded once: a replayed step returns what
was recorded without running its function again (G5). The operations that are
not about waiting live once in :mod:`outbox.client_core`; ``Outbox`` inherits them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec

from outbox.client_core import ClientCore, LoadedRun, connect_settings, exposed
from outbox.runs.context import RunContext, VersionUpgrades
from outbox.runs.intents import OutboxTransaction
from outbox.runs.run import Run
from outbox.runs.worker import Worker, WorkerSettings
from outbox.settings import Settings
from outbox.storage import Connection, Engine
from outbox.storage.engine import open_engine
from outbox.storage.notify import WakeupThrottle
from outbox.storage.sql.common import EFFECTS_CHANNEL, RUNS_CHANNEL
from outbox.storage.store import Store
from outbox.validation import name_field, validated

if TYPE_CHECKING:
    from outbox.async_client import BlockingAsyncWorker

__all__ = ["Outbox"]

P = ParamSpec("P")


def _handle(
    operation: Callable[Concatenate[ClientCore, P], LoadedRun], name: str | None = None
) -> Callable[Concatenate[Outbox, P], Run]:
    """A client method that returns a :class:`Run` on what ``operation`` loaded."""

    @exposed(operation, name, returns=Run)
    def method(self: Outbox, /, *args: P.args, **kwargs: P.kwargs) -> Run:
        loaded = operation(self, *args, **kwargs)
        run = Run(self._ctx, loaded.record, loaded.steps)
        run.started = loaded.started
        return run

    return method


class Outbox(ClientCore):
    """Entry point: a connection to the outbox store.

    Use :meth:`connect`; close it (or use it as a context manager) when done.
    """

    def __init__(self, engine: Engine, settings: Settings | None = None) -> None:
        settings = settings or Settings()
        store = Store(engine)
        window = settings.notify_window_ms / 1000
        super().__init__(
            RunContext(
                store,
                settings,
                WakeupThrottle(lambda: store.notify(EFFECTS_CHANNEL), window_s=window),
                WakeupThrottle(lambda: store.notify(RUNS_CHANNEL), window_s=window),
                VersionUpgrades(),
            )
        )
        self.engine = engine

    @classmethod
    def connect(
        cls, dsn: str | None = None, *, settings: Settings | None = None, **overrides: Any
    ) -> Outbox:
        """Connect to ``dsn``, else ``OUTBOX_DSN``, else the embedded PostgreSQL in ``./.outbox``.

        Keyword overrides (``home=``, ``max_payload_bytes=``, ...) are
        :class:`~outbox.Settings` fields. The embedded server is started when
        needed and migrated automatically; another database must be migrated
        with ``outbox migrate`` first.
        """
        settings = connect_settings(dsn, settings, overrides)
        return cls(open_engine(settings), settings)

    def close(self) -> None:
        """Send owed wake-ups and release every connection."""
        self._effects_wakeup.close()
        self._runs_wakeup.close()
        self.engine.dispose()

    def __enter__(self) -> Outbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    start_run = _handle(ClientCore._start_run)
    run = _handle(ClientCore._load_run, name="run")
    fork = _handle(ClientCore._fork)

    @contextmanager
    def transaction(self, connection: Connection | None = None) -> Iterator[OutboxTransaction]:
        """Intents that belong to no run, committed with the caller's rows (plain outbox use).

        With ``connection``, the intents join the caller's open transaction (in a
        savepoint) and commit when the caller commits.
        """
        with self.store.begin(connection) as conn:
            tx = OutboxTransaction(self._ctx, conn)
            yield tx
            tx._flush()
        if connection is None:
            self._effects_wakeup.committed(tx._notified)

    def worker(
        self, agent: str, version: str, handler: Callable[..., Any], **settings: Any
    ) -> Worker | BlockingAsyncWorker:
        """A worker that executes runnable runs of exactly this agent and version.

        ``handler(run)`` is called for each claimed run; steps it already
        recorded replay. Call ``.run()`` to work until ``.stop()``. Settings:
        see :class:`~outbox.WorkerSettings`. An ``async def`` handler gets an
        :class:`~outbox.AsyncRun`, and ``concurrency`` of them run at once on
        one event loop (an :class:`~outbox.AsyncWorker` driven from ``.run()``).
        """
        name_field(agent, "agent")
        name_field(version, "version", max_length=100)
        worker_settings = validated(WorkerSettings, **settings)
        if inspect.iscoroutinefunction(handler):
            from outbox.async_client import BlockingAsyncWorker

            return BlockingAsyncWorker(
                self.settings.model_copy(update={"dsn": self._ctx.dsn}),
                self.upgrades,
                agent,
                version,
                handler,
                worker_settings,
            )
        return Worker(self._ctx, agent, version, handler, worker_settings)
