"""Real callables for the python.call deliverer tests (imported by path, as a config names them)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from outbox.delivery import PermanentError, RetryableError

#: Every call, as (function name, argument, idempotency key, thread name).
CALLS: list[tuple[str, Any, str, str]] = []

NOT_CALLABLE = 42


def _note(name: str, argument: Any, key: str) -> None:
    CALLS.append((name, argument, key, threading.current_thread().name))


def echo(payload: Any, key: str) -> dict[str, Any]:
    """Sync: returns what it was given."""
    _note("echo", payload, key)
    return {"payload": payload, "key": key}


async def async_echo(payload: Any, key: str) -> dict[str, Any]:
    """Async: returns what it was given after yielding to the loop."""
    await asyncio.sleep(0)
    _note("async_echo", payload, key)
    return {"async": True, "payload": payload, "key": key}


def flaky(payload: Any, key: str) -> None:
    """Always a transient failure, with a Retry-After."""
    _note("flaky", payload, key)
    raise RetryableError("sink busy", retry_after=7.5, rate_limited=True)


async def async_flaky(payload: Any, key: str) -> None:
    """Async transient failure."""
    _note("async_flaky", payload, key)
    raise RetryableError("async sink busy")


def rejects(payload: Any, key: str) -> None:
    """Always a permanent failure."""
    _note("rejects", payload, key)
    raise PermanentError("account closed")


class AsyncCallable:
    """An object whose ``__call__`` is async (a configured path may name an instance)."""

    async def __call__(self, payload: Any, key: str) -> dict[str, Any]:
        await asyncio.sleep(0)
        _note("async_callable", payload, key)
        return {"instance": True, "payload": payload}


async_callable = AsyncCallable()


def returns_coroutine(payload: Any, key: str) -> Any:
    """A plain wrapper around an async function (as some decorators produce)."""
    return async_echo(payload, key)


class Namespace:
    """Holds a function reachable by a dotted attribute path (``module:Namespace.method``)."""

    @staticmethod
    def nested(payload: Any, key: str) -> str:
        _note("nested", payload, key)
        return f"nested:{key}"


def raises_nul(payload: Any, key: str) -> None:
    """An error message holding what PostgreSQL cannot store: a NUL and a lone surrogate."""
    _note("raises_nul", payload, key)
    raise ValueError("bad\x00news from \udcff the sink")


def rejects_nul(payload: Any, key: str) -> None:
    """A permanent failure whose message holds a NUL."""
    _note("rejects_nul", payload, key)
    raise PermanentError("account\x00closed")


def retry_forever(payload: Any, key: str) -> None:
    """A transient failure asking for an infinite wait (refused where it is made)."""
    _note("retry_forever", payload, key)
    raise RetryableError("come back never", retry_after=float("inf"))


def odd_result(payload: Any, key: str) -> dict[Any, Any]:
    """A result JSON cannot hold as it is: NaN, infinity, NUL, bytes, a non-text key."""
    _note("odd_result", payload, key)
    return {
        "ratio": float("nan"),
        "big": float("inf"),
        "text": "a\x00b",
        "raw": b"\xff\xfe",
        "nested": {1: ["x\x00"]},
    }


async def slow_async_handler(run: Any) -> None:
    """A worker handler that outlasts any grace period (async)."""
    await asyncio.sleep(600)


def slow_handler(run: Any) -> None:
    """A worker handler that outlasts any grace period (sync)."""

    time.sleep(600)


def intends_one(run: Any) -> str:
    """A worker handler whose one step intends one ``k.start`` effect."""
    run.transaction("s", lambda tx: tx.intend("k.start", {"n": 1}) and None)
    return "done"


async def sleepy_async_handler(run: Any) -> str:
    """A worker handler that finishes 4 s after it starts (async)."""
    await asyncio.sleep(4)
    return "done"


def sleepy_handler(run: Any) -> str:
    """A worker handler that finishes 4 s after it starts (sync)."""

    time.sleep(4)
    return "done"


def sleeps(payload: Any, key: str) -> dict[str, Any]:
    """Sync, slow: sleeps ``payload["seconds"]`` (a call that outlives a grace period)."""
    _note("sleeps", payload, key)
    time.sleep(float(payload["seconds"]))
    return {"slept": payload["seconds"]}
