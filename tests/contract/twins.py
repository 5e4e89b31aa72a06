"""One test body, two clients: the sync ``Outbox`` seen through ``await``, and ``AsyncOutbox``.

Contract tests are written once as ``async def body(ob)`` in the async
client's own words (``await run.call``, ``await tx.intend``,
``await tx.connection.execute``, ``async with ob.transaction()``). For the
async twin the body runs on an event loop against a real ``AsyncOutbox``. For
the sync client every call goes to the real ``Outbox``/``Run``/``StepTransaction``
and its result is wrapped in an already-finished awaitable, so the body's
coroutine never suspends and is driven to its end without a loop: the sync
methods do all the work, nothing is faked.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Generator
from typing import Any

from outbox import AsyncOutbox, Outbox, Run

Body = Callable[[Any], Awaitable[Any]]


class Ready:
    """An awaitable that is already done (a sync call's result)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __await__(self) -> Generator[Any, None, Any]:
        return self.value
        yield  # a generator, so `await` works; never reached


def drive(awaitable: Any) -> Any:
    """Run a coroutine that never suspends (every await is a ``Ready``) to its result."""
    if isinstance(awaitable, Ready):
        return awaitable.value
    if not inspect.iscoroutine(awaitable):
        return awaitable
    try:
        awaitable.send(None)
    except StopIteration as done:
        return done.value
    awaitable.close()
    raise RuntimeError("a sync-client body suspended: it awaited something real")


class Awaited:
    """Every method call of ``target`` returns a ``Ready``; ``plain`` methods stay plain."""

    plain: frozenset[str] = frozenset()

    def __init__(self, target: Any) -> None:
        self._target = target

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if not callable(value) or name in self.plain:
            return value

        def call(*args: Any, **kwargs: Any) -> Ready:
            return Ready(_wrap(value(*args, **kwargs)))

        return call


def _wrap(value: Any) -> Any:
    return SyncRun(value) if isinstance(value, Run) else value


class SyncTx(Awaited):
    """A ``StepTransaction`` or ``OutboxTransaction`` as the async body sees one."""

    plain = frozenset({"set_state", "set_plan", "spend"})

    @property
    def connection(self) -> Awaited:
        return Awaited(self._target.connection)


class SyncRun(Awaited):
    """A sync ``Run``: the step function the body passes is async, so drive it in the step."""

    plain = frozenset({"step"})

    def transaction(self, step_id: str, fn: Callable[[Any], Any], **kwargs: Any) -> Ready:
        return Ready(self._target.transaction(step_id, lambda tx: drive(fn(SyncTx(tx))), **kwargs))


class _SyncOutboxTransaction:
    def __init__(self, outbox: Outbox, **kwargs: Any) -> None:
        self._cm = outbox.transaction(**kwargs)

    async def __aenter__(self) -> SyncTx:
        return SyncTx(self._cm.__enter__())

    async def __aexit__(self, *exc: Any) -> Any:
        return self._cm.__exit__(*exc)


class SyncOutbox(Awaited):
    """The sync ``Outbox`` in the async client's words."""

    plain = frozenset({"register_upgrade"})

    def transaction(self, **kwargs: Any) -> _SyncOutboxTransaction:
        return _SyncOutboxTransaction(self._target, **kwargs)


class Twin:
    """Runs a contract body against one client (``kind`` is ``sync`` or ``async``)."""

    def __init__(self, kind: str, dsn: str) -> None:
        self.kind = kind
        self.dsn = dsn

    def run(self, body: Body) -> Any:
        if self.kind == "sync":
            with Outbox.connect(self.dsn) as ob:
                return drive(body(SyncOutbox(ob)))

        async def main() -> Any:
            async with await AsyncOutbox.connect(self.dsn) as ob:
                return await body(ob)

        return asyncio.run(main())
