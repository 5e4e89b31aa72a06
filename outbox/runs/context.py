"""What runs, step transactions and workers share with the ``Outbox`` that made them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from outbox.errors import ValidationError
from outbox.settings import Settings
from outbox.storage.async_run_store import AsyncRunStore
from outbox.storage.notify import WakeupThrottle
from outbox.storage.store import Store

__all__ = ["AsyncRunContext", "RunContext", "VersionUpgrades"]

#: ``fn(state) -> new_state``, run once per run when a newer worker takes it.
StateUpgrade = Callable[[Any], Any]


@dataclass
class VersionUpgrades:
    """Registered agent-version upgrades: which older versions a worker of a version may take."""

    _by_target: dict[tuple[str, str], dict[str, StateUpgrade]] = field(default_factory=dict)

    def register(self, agent: str, from_version: str, to_version: str, fn: StateUpgrade) -> None:
        """Let workers of ``to_version`` take runs of ``from_version``, upgrading their state."""
        if from_version == to_version:
            raise ValidationError("to_version", to_version, "must differ from from_version")
        self._by_target.setdefault((agent, to_version), {})[from_version] = fn

    def into(self, agent: str, version: str) -> dict[str, StateUpgrade]:
        """``{from_version: fn}`` for runs a worker of ``agent`` at ``version`` may take."""
        return dict(self._by_target.get((agent, version), {}))


@dataclass(frozen=True)
class RunContext:
    """The store, settings, wake-ups and version upgrades one ``Outbox`` shares with its runs."""

    store: Store
    settings: Settings
    effects_wakeup: WakeupThrottle
    runs_wakeup: WakeupThrottle
    upgrades: VersionUpgrades

    @property
    def dsn(self) -> str:
        """The database, for connections of its own (LISTEN)."""
        return self.store.engine.url.render_as_string(hide_password=False)


@dataclass(frozen=True)
class AsyncRunContext(RunContext):
    """The async twin's context: ``aio`` awaits the very methods of ``store``.

    ``store`` is the sync :class:`Store` over the async engine's ``sync_engine``:
    shared logic that takes a connection or a ``RunTx`` runs on it inside
    ``aio.call``/``aio.run_tx``/``run_sync``, never directly on the event loop.
    """

    aio: AsyncRunStore
