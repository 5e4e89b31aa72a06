"""``python.call``: a registered Python callable, called with the payload and the key.

The callable is named by the config (``function = "package.module:attr"``) or,
for the bare ``python.call`` kind, by a name the payload gives that must be
registered in the config's ``functions`` table or under the ``outbox.functions``
entry points. A payload can never name an arbitrary import path.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from outbox.delivery import Deliverer, DelivererConfig, Delivery, Failed, Outcome, Succeeded
from outbox.errors import ConfigurationError
from outbox.validation import import_callable

__all__ = ["CallPayload", "PythonCallConfig", "PythonCallDeliverer", "import_callable"]


class PythonCallConfig(DelivererConfig):
    """Settings of a Python-callable deliverer."""

    #: The one callable of this kind (its payload is passed whole).
    function: str | None = None
    #: Name -> ``module:attr`` for the bare ``python.call`` kind.
    functions: dict[str, str] = Field(default_factory=dict)


class CallPayload(BaseModel):
    """Payload of the bare ``python.call`` kind: which registered function, with what."""

    model_config = ConfigDict(extra="forbid")

    function: str = Field(min_length=1)
    args: Any = None


class PythonCallDeliverer(Deliverer[PythonCallConfig]):
    """Calls ``fn(payload, idempotency_key)``; its JSON return value is the result.

    The callable may be ``async``; it may raise ``RetryableError`` or
    ``PermanentError`` (from ``outbox.delivery``) to steer retries. Declare
    ``idempotent = true`` in the config when it dedups on the key.
    """

    def __init__(self, kind: str, config: DelivererConfig | None = None) -> None:
        super().__init__(kind, config)
        self._loaded: dict[str, Callable[..., Any]] = {}
        try:
            self._single = (
                import_callable(self.config.function) if self.config.function is not None else None
            )
            # Functions named in the config are imported now, so a typo fails at start-up
            # rather than as retried deliveries; entry points stay lazy (optional packages).
            for name, path in self.config.functions.items():
                self._loaded[name] = import_callable(path)
        except ConfigurationError as exc:
            raise ConfigurationError(f"deliverer {kind!r}: {exc}") from exc
        self._named = {name: path for name, path in self.config.functions.items()}
        for entry in entry_points(group="outbox.functions"):
            self._named.setdefault(entry.name, entry.value)

    def parse_payload(self, payload: Any) -> Any:
        """The bare kind's payload names a function; a configured kind passes its payload whole."""
        if self._single is not None:
            return payload
        return CallPayload.model_validate(payload)

    def _resolve(self, payload: Any) -> tuple[Callable[..., Any], Any] | str:
        if self._single is not None:
            return self._single, payload
        name = payload.function
        if name not in self._named:
            return f"function {name!r} is not registered (config 'functions' or entry points)"
        if name not in self._loaded:
            self._loaded[name] = import_callable(self._named[name])
        return self._loaded[name], payload.args

    async def deliver(self, delivery: Delivery) -> Outcome:
        """Call the function once with the payload and the key."""
        resolved = self._resolve(delivery.payload)
        if isinstance(resolved, str):
            return Failed(resolved)
        fn, argument = resolved
        if _is_async(fn):
            result = await fn(argument, delivery.idempotency_key)
        else:
            result = await asyncio.to_thread(fn, argument, delivery.idempotency_key)
            if inspect.isawaitable(result):  # e.g. a plain wrapper around an async function
                result = await result
        return Succeeded(result)


def _is_async(fn: Callable[..., Any]) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one."""
    call = getattr(fn, "__call__", None)  # noqa: B004 (the method itself, not callability)
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)
