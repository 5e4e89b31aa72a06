"""The contract between the delivery daemon and a deliverer (one per kind of sink).

A deliverer receives a :class:`Delivery` (never a database connection) and
answers with an outcome: :class:`Succeeded`, :class:`Retry` or :class:`Failed`.
It may raise :class:`RetryableError` or :class:`PermanentError` instead; any
other exception counts as retryable. It declares whether its sink honours the
idempotency key (``idempotent``) and may offer :meth:`Deliverer.lookup`, which
asks the sink whether a key was applied: the reconciler uses both after a crash.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Self, get_args
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import TypeVar  # a default for a type variable (PEP 696) before 3.13

from outbox.errors import (
    DeliveryError,
    PermanentError,
    RetryableError,
    check_seconds,
)
from outbox.storage.sql.queue import Rate
from outbox.validation import validated_table

__all__ = [
    "AttemptNotes",
    "Deliverer",
    "DelivererConfig",
    "Delivery",
    "DeliveryError",
    "Failed",
    "NotApplied",
    "Outcome",
    "PermanentError",
    "Retry",
    "RetryableError",
    "Succeeded",
    "Unknown",
]


class AttemptNotes:
    """Where a deliverer writes, before it calls the sink, what it will need to ask it later.

    Kafka's deliverer notes the partition and the offset it will publish after,
    so that :meth:`Deliverer.lookup` can read the partition back from there
    after a crash. The note is stored on the effect, fenced by the attempt: it
    returns False when the attempt is no longer this deliverer's (then do not
    call the sink). ``write`` is awaited by async deliverers; a plain deliverer,
    which runs in a worker thread, calls ``write_blocking``.
    """

    def __init__(
        self,
        write: Callable[[Mapping[str, Any]], Coroutine[Any, Any, bool]],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._write = write
        self._loop = loop

    async def write(self, note: Mapping[str, Any]) -> bool:
        """Store ``note`` (JSON) for this attempt; False when the attempt is no longer ours."""
        return await self._write(note)

    def write_blocking(self, note: Mapping[str, Any], timeout: float = 30.0) -> bool:
        """:meth:`write` from a worker thread (a plain ``deliver`` runs in one)."""
        return asyncio.run_coroutine_threadsafe(self._write(note), self._loop).result(timeout)


@dataclass(frozen=True, slots=True)
class Delivery:
    """One attempt at one effect, as a deliverer sees it.

    ``notes`` (during ``deliver``) stores a note for this attempt before the call;
    ``note`` (during ``lookup``) is the note the attempt being looked up stored,
    or None when it stored none (a deliverer that notes before every call then
    knows the call never happened).
    """

    effect_id: UUID
    run_id: UUID | None
    kind: str
    payload: Any
    idempotency_key: str
    attempt: int
    schema_version: int = 1
    ordering_key: str | None = None
    created_at: Any = None
    notes: AttemptNotes | None = None
    note: Any = None
    #: The W3C ``traceparent`` of this attempt's span (send it on, as HTTP does), or None.
    traceparent: str | None = None


@dataclass(frozen=True, slots=True)
class Succeeded:
    """The sink applied the effect; ``result`` (JSON) is recorded, ``detail`` logged."""

    result: Any = None
    detail: Any = None


@dataclass(frozen=True, slots=True)
class Retry:
    """Not applied this time; try again with the same key.

    ``after`` (seconds) is honoured as the earliest next attempt (a sink's
    ``Retry-After``). ``rate_limited`` slows every effect of this kind in this
    daemon, not just this one.
    """

    reason: str
    after: float | None = None
    rate_limited: bool = False
    detail: Any = None

    def __post_init__(self) -> None:
        # Refused here, where the deliverer made it: an infinite or NaN delay would
        # fail the statement recording the attempt (and its whole batch).
        object.__setattr__(self, "after", check_seconds("Retry.after", self.after))


@dataclass(frozen=True, slots=True)
class Failed:
    """Will never succeed as it stands (a 4xx, a rejected payload): stop trying."""

    reason: str
    detail: Any = None


@dataclass(frozen=True, slots=True)
class Unknown:
    """The call may or may not have taken effect (e.g. a timeout after the request was sent).

    A deliverer of a sink that cannot dedup answers this instead of ``Retry``
    for an ambiguous failure: the effect goes to ``unknown`` for an operator
    rather than being sent a second time.
    """

    reason: str
    detail: Any = None


@dataclass(frozen=True, slots=True)
class NotApplied:
    """A lookup's answer: the sink has no trace of the key, so redelivery is safe."""


Outcome = Succeeded | Retry | Failed | Unknown


class DelivererConfig(BaseModel):
    """Settings every deliverer accepts (a kind's table in the deliverers config file)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: The deliverer type serving this kind (an ``outbox.deliverers`` entry point
    #: name); default: the kind's own name.
    type: str | None = None
    #: Whether the sink dedups on the idempotency key, overriding the type's own
    #: declaration: decides whether a lost attempt is redelivered or ``unknown``.
    idempotent: bool | None = None
    #: Attempts an effect of this kind gets (unless its intent says).
    max_attempts: int = Field(default=10, ge=1, le=1000)
    #: At most this many calls of this kind at once in one daemon (default: no limit
    #: of its own, only the daemon's ``concurrency``).
    concurrency: int | None = Field(default=None, ge=1)
    #: Calls per second for this kind, shared by every deliverer process through
    #: PostgreSQL (a provider's known quota). None: no rate of its own.
    rate: float | None = Field(default=None, gt=0, le=1_000_000)
    #: Calls a rate lets through at once after an idle spell (default: one second's worth).
    burst: int | None = Field(default=None, ge=1, le=1_000_000)


#: A deliverer's settings model. Covariant, so that every ``Deliverer[HttpConfig]``
#: is a ``Deliverer`` (registries hold several types); defaulted, so that a bare
#: ``Deliverer`` means the common settings.
ConfigT = TypeVar("ConfigT", bound=DelivererConfig, default=DelivererConfig, covariant=True)


class Deliverer(Generic[ConfigT]):
    """Base class of deliverers: subclasses implement :meth:`deliver`.

    ``deliver`` and ``lookup`` may be plain or ``async`` methods: the daemon
    runs plain ones in a worker thread. One instance serves one effect kind.
    A subclass names its settings model once, as the parameter of its base
    (``class SmsDeliverer(Deliverer[SmsConfig])``): that sets ``config_model``
    and types ``self.config``.
    """

    #: The sink dedups on the idempotency key: a crash mid-call is redelivered.
    default_idempotent: ClassVar[bool] = False
    #: Without a config file, the default registry serves the kind of this type's name.
    #: False for types that only make sense configured (the test stand-in).
    default_registered: ClassVar[bool] = True
    #: Validates payloads (and is exported to ``schemas/``); None accepts any JSON.
    payload_model: ClassVar[type[BaseModel] | None] = None
    #: Validates this deliverer's settings.
    config_model: ClassVar[type[DelivererConfig]] = DelivererConfig
    #: Payload schema versions this deliverer understands.
    schema_versions: ClassVar[frozenset[int]] = frozenset({1})

    #: This kind's settings, an instance of ``config_model``.
    config: ConfigT

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # ``Deliverer[SmsConfig]`` as a base names the model; a ``config_model``
        # the class sets itself wins, and a subclass of a subclass inherits it
        # (its parent's ``__orig_bases__`` is not its own).
        if "config_model" in cls.__dict__:
            return
        for base in cls.__dict__.get("__orig_bases__", ()):
            for arg in get_args(base):
                if isinstance(arg, type) and issubclass(arg, DelivererConfig):
                    cls.config_model = arg

    def __init__(self, kind: str, config: DelivererConfig | None = None) -> None:
        self.kind = kind
        config = config or self.config_model()
        if not isinstance(config, self.config_model):
            raise TypeError(
                f"deliverer {kind!r}: config must be a {self.config_model.__name__}, "
                f"not {type(config).__name__}"
            )
        # Checked above against config_model, which __init_subclass__ took from ConfigT.
        self.config = config  # type: ignore[assignment]
        self.idempotent = (
            self.default_idempotent if self.config.idempotent is None else self.config.idempotent
        )
        self.max_attempts = self.config.max_attempts
        #: At most this many calls of this kind at once in one daemon (None: no own limit).
        self.concurrency = self.config.concurrency
        #: The kind's declared rate, shared by every deliverer process (None: none).
        self.rate: Rate | None = None
        if self.config.rate is not None:
            burst = self.config.burst or max(1, math.ceil(self.config.rate))
            self.rate = Rate(self.config.rate, burst)

    @classmethod
    def parse_config(cls, kind: str, table: Mapping[str, Any]) -> DelivererConfig:
        """Validate a kind's config table with ``config_model`` (errors name the kind and field)."""
        not_a_table = f"kinds.{kind} must be a table"
        return validated_table(cls.config_model, table, f"deliverer {kind!r}: ", not_a_table)

    @classmethod
    def from_config(cls, kind: str, raw: Mapping[str, Any]) -> Self:
        """Build from a config table (validated; errors name the kind and the field)."""
        return cls(kind, cls.parse_config(kind, raw))

    def deliver(self, delivery: Delivery) -> Outcome | Awaitable[Outcome]:
        """Perform the effect once, passing ``delivery.idempotency_key`` to the sink."""
        raise NotImplementedError

    def lookup(self, delivery: Delivery) -> Any:
        """Ask the sink whether the key was applied: ``Succeeded`` or ``NotApplied``.

        Deliverers whose sink cannot answer leave this unimplemented.
        """
        raise NotImplementedError

    @property
    def has_lookup(self) -> bool:
        """True when this deliverer overrides :meth:`lookup`."""
        return type(self).lookup is not Deliverer.lookup

    def parse_payload(self, payload: Any) -> Any:
        """Validate a payload with ``payload_model`` (pydantic errors propagate)."""
        if self.payload_model is None:
            return payload
        return self.payload_model.model_validate(payload)

    def close(self) -> None:
        """Release clients and connections (sync part)."""

    async def aclose(self) -> None:
        """Release clients and connections; the daemon awaits this when it stops."""
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} kind={self.kind!r} idempotent={self.idempotent}>"


def is_async(method: Any) -> bool:
    """True when ``method`` must be awaited."""
    return inspect.iscoroutinefunction(method)
