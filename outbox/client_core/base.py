"""The state both clients' operations share, and how a client exposes one operation."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

from outbox.models import RunRecord, StepRecord
from outbox.runs.context import RunContext
from outbox.runs.stopping import StoppingSweep
from outbox.settings import Settings

__all__ = ["ClientBase", "LoadedRun", "connect_settings", "exposed"]

F = TypeVar("F", bound=Callable[..., Any])


class LoadedRun(NamedTuple):
    """A run as an operation read it; each client wraps it in its own handle."""

    record: RunRecord
    steps: list[StepRecord]
    #: From ``start_run``: True when that call started the run.
    started: bool = False


class ClientBase:
    """What every operation reaches: the store, the settings and the wake-ups of one client."""

    def __init__(self, ctx: RunContext) -> None:
        self._ctx = ctx
        self.settings = ctx.settings
        #: Agent-version upgrades workers of this client may apply (:meth:`register_upgrade`).
        self.upgrades = ctx.upgrades
        self.store = ctx.store
        self._effects_wakeup = ctx.effects_wakeup
        self._runs_wakeup = ctx.runs_wakeup
        #: Each call of ``advance_stopping_runs`` goes on where the last one stopped.
        self._stopping = StoppingSweep()


def exposed(
    operation: Callable[..., Any], name: str | None = None, returns: type | None = None
) -> Callable[[F], F]:
    """``functools.wraps`` for a client method made from ``operation``, under its public name.

    ``_start_run`` becomes ``start_run`` (or ``name``). With ``returns``, the method
    returns that (a client's own run handle) where the operation returns a
    :class:`LoadedRun`: its signature says so.
    """

    def wrap(method: F) -> F:
        functools.update_wrapper(method, operation)
        method.__name__ = method.__qualname__ = name or operation.__name__.lstrip("_")
        if returns is not None:
            method.__annotations__ = {**operation.__annotations__, "return": returns}
            signature = inspect.signature(operation).replace(return_annotation=returns)
            method.__signature__ = signature  # type: ignore[attr-defined]
        return method

    return wrap


def connect_settings(
    dsn: str | None, settings: Settings | None, overrides: dict[str, Any]
) -> Settings:
    """The settings ``connect(dsn, settings=..., **overrides)`` means (both clients)."""
    if settings is None:
        return Settings.from_env(dsn=dsn, **overrides)
    if dsn is not None or overrides:
        return settings.model_copy(update={"dsn": dsn or settings.dsn, **overrides})
    return settings
