"""Every error agent-outbox raises, rooted in one class.

::

    OutboxError
    ├── ConfigurationError          bad settings, unknown deliverer config
    │   └── MissingExtra            an optional extra is not installed (names the pip install)
    ├── ValidationError             bad input from a caller; names field and value
    │   └── PayloadError            not JSON, NaN/Infinity, over the size limit
    ├── NotFound
    │   ├── RunNotFound
    │   └── EffectNotFound
    ├── IdempotencyConflict         same key, different payload
    │   └── RunExists               a run holds this key (start_run(key=..., on_conflict="reject"))
    ├── ReplayRefused               a request id (a signed webhook) was accepted before
    ├── RunStateError               the run cannot take this action now
    │   ├── RunTerminal             the run already ended
    │   ├── RunPaused               the run is paused: resume it first
    │   ├── LeaseLost               another worker owns the run now
    │   ├── ForkRefused             a fork would re-intend effects that may have happened
    │   └── StepAlreadyRecorded     the SQL API found the step recorded: roll back, replay
    ├── BudgetExceeded              a step would spend more than the run's budget
    ├── WaitTimeout                 a wait ran out (recorded; every replay raises it again)
    │   ├── SignalTimeout           ... for a signal
    │   └── EffectTimeout           ... for an effect to finish
    ├── EffectFailed                an awaited effect ended failed
    │   └── EffectRejected          ... because a person (or an approval deadline) rejected it
    ├── ApprovalRefused             an approval named the wrong digest, came late, or twice
    ├── SchemaError
    │   ├── SchemaOutdated          the database needs `outbox migrate`
    │   ├── SchemaTooNew            the database was migrated by newer code
    │   └── MigrationError          a migration failed, or an applied one was changed
    ├── DatabaseError               the store failed (the driver's error is __cause__)
    │   ├── EmbeddedServerError     the embedded PostgreSQL failed to start or stop
    │   └── StoredValueAltered      a value stored by reference does not hash to its sha256
    └── DeliveryError               raised by a deliverer, read by the daemon
        ├── RetryableError          transient: try again (retry_after, rate_limited)
        └── PermanentError          the effect can never succeed as it stands

Not errors: ``Suspended`` (a ``BaseException``) is control flow, raised out of a
worker's handler when its run parks in a wait, as psycopg's ``Rollback`` is.
"""

from __future__ import annotations

import math
import reprlib
from typing import Any

__all__ = [
    "ApprovalRefused",
    "BudgetExceeded",
    "ConfigurationError",
    "DatabaseError",
    "DeliveryError",
    "EffectFailed",
    "EffectNotFound",
    "EffectRejected",
    "EffectTimeout",
    "EmbeddedServerError",
    "ForkRefused",
    "IdempotencyConflict",
    "LeaseLost",
    "MigrationError",
    "MissingExtra",
    "NotFound",
    "OutboxError",
    "PayloadError",
    "PermanentError",
    "ReplayRefused",
    "RetryableError",
    "RunExists",
    "RunNotFound",
    "RunPaused",
    "RunStateError",
    "RunTerminal",
    "SchemaError",
    "SchemaOutdated",
    "SchemaTooNew",
    "SignalTimeout",
    "StepAlreadyRecorded",
    "StoredValueAltered",
    "ValidationError",
    "WaitTimeout",
]


_SHORT = reprlib.Repr()
_SHORT.maxlevel = 3


def _show(value: Any, limit: int = 80) -> str:
    # Whatever a caller passed must not break the error that refuses it: a value
    # nested thousands deep or an integer of thousands of digits has no repr().
    try:
        text = repr(value)
    except (RecursionError, ValueError):
        try:
            text = _SHORT.repr(value)
        except (RecursionError, ValueError):
            text = f"<{type(value).__name__} that cannot be shown>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_seconds(field: str, value: Any) -> float | None:
    """``value`` as a number of seconds (``None`` stays ``None``), refused unless finite and >= 0.

    A delay read from a deliverer ends up in ``now() + delay``: infinity or NaN
    would fail the statement that records it, so it is refused where it is made.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValidationError(field, value, "must be a number of seconds")
    try:
        seconds = float(value)
    except OverflowError:  # an int past float's range
        seconds = math.inf
    if not math.isfinite(seconds) or seconds < 0:
        raise ValidationError(field, value, "must be a finite number of seconds >= 0")
    return seconds


class OutboxError(Exception):
    """Root of every error raised by agent-outbox."""


class ConfigurationError(OutboxError):
    """Settings or deployment configuration are invalid."""


class MissingExtra(ConfigurationError, ImportError):
    """What was asked for needs an optional extra that is not installed.

    ``extra`` is its name in ``pyproject.toml``; the message is the one line to
    run. An ``ImportError`` too, so code that treats the missing library as
    absent still does.
    """

    #: The importable top-level module of each optional extra's library.
    EXTRAS: dict[str, str] = {
        "kafka": "kafka",
        "opentelemetry": "otel",
        "cryptography": "audit",
        "pydantic_ai": "pydantic-ai",
        "langgraph": "langgraph",
        "langchain_core": "langgraph",
        "agents": "openai-agents",
        "openai": "openai-agents",
    }

    def __init__(self, extra: str, what: str, module: str | None = None) -> None:
        self.extra = extra
        missing = f" ({module} is not installed)" if module else ""
        super().__init__(
            f"{what} needs the {extra!r} extra{missing}: pip install 'agent-outbox[{extra}]'",
            name=module,
        )

    @classmethod
    def of(cls, exc: ImportError, what: str) -> MissingExtra | None:
        """The extra a failed import of an optional library calls for (None: not an extra's)."""
        if isinstance(exc, MissingExtra):
            return exc
        top = (exc.name or "").split(".")[0]
        extra = cls.EXTRAS.get(top)
        return cls(extra, what, top) if extra else None


class ValidationError(OutboxError, ValueError):
    """A caller passed a value that cannot be accepted.

    ``field`` names the offending input and ``value`` holds it (shortened in the message).
    ``rule`` is the stable code of the intent rule it breaks (``outbox.governance.intent_rules``,
    e.g. ``credential-header``), when one does: the SQL API and the HTTP API report
    the same code.
    """

    def __init__(self, field: str, value: Any, reason: str, *, rule: str | None = None) -> None:
        self.field = field
        self.value = value
        self.reason = reason
        self.rule = rule
        super().__init__(f"{field}={_show(value)}: {reason}")


class PayloadError(ValidationError):
    """A payload, result or state is not storable JSON (type, NaN/Infinity, size)."""


class NotFound(OutboxError, LookupError):
    """A record does not exist."""


class RunNotFound(NotFound):
    """No run has this id."""

    def __init__(self, run_id: Any) -> None:
        self.run_id = run_id
        super().__init__(f"run_id={_show(str(run_id))}: no such run")


class EffectNotFound(NotFound):
    """No effect has this id."""

    def __init__(self, effect_id: Any) -> None:
        self.effect_id = effect_id
        super().__init__(f"effect_id={_show(str(effect_id))}: no such effect")


class IdempotencyConflict(OutboxError):
    """An idempotency key was reused with a different payload (Stripe's rule: refuse)."""

    def __init__(self, key: str, detail: str = "already intended with a different payload") -> None:
        self.key = key
        super().__init__(f"idempotency_key={key!r}: {detail}")


class RunExists(IdempotencyConflict):
    """``start_run(key=..., on_conflict="reject")``: a run with this key exists (same inputs)."""

    def __init__(self, key: str, run_id: Any) -> None:
        #: The run that holds the key, for the caller that asked to be refused.
        self.run_id = run_id
        super().__init__(key, "a run was already started with this key")


class ReplayRefused(OutboxError):
    """A request that must be accepted once (a signed webhook) came a second time."""

    def __init__(self, field: str, value: str) -> None:
        self.field = field
        super().__init__(f"{field}: this request was already accepted (a replay is refused)")


class RunStateError(OutboxError):
    """The run is not in a state that allows this action."""


class RunTerminal(RunStateError):
    """The run has ended; it accepts no further steps, signals or effects."""

    def __init__(self, run_id: Any, status: str) -> None:
        self.run_id = run_id
        self.status = status
        super().__init__(f"run_id={str(run_id)!r} is {status}: a terminal run accepts no more work")


class RunPaused(RunStateError):
    """The run is paused (``outbox runs pause``): it takes no steps until it is resumed."""

    def __init__(self, run_id: Any, reason: str | None = None) -> None:
        self.run_id = run_id
        self.reason = reason
        why = f" ({reason})" if reason else ""
        super().__init__(f"run_id={str(run_id)!r} is paused{why}: resume it first")


class ForkRefused(RunStateError):
    """A fork from ``from_step`` would run again steps whose effects may have taken effect.

    ``effects`` lists them (``effect_id``, ``step_id``, ``kind``, ``status``,
    ``idempotency_key``, ``lost_attempt``): ``unknown``, ``in_flight`` or
    ``dispatched`` effects of ``from_step`` or a later step, or ones not started
    again since an attempt was lost (``lost_attempt``: its call may have reached
    the sink). The fork would intend them again under new keys, which the sink
    has never seen: it could apply them twice. Settle them first (resolve the
    unknown ones; let the others be delivered, or cancel the original, which
    leaves one a lost attempt may have done ``unknown``), or fork with
    ``allow_unsettled=True``.
    """

    def __init__(self, run_id: Any, from_step: str, effects: list[dict[str, Any]]) -> None:
        self.run_id = run_id
        self.from_step = from_step
        self.effects = effects
        listed = "; ".join(
            f"{e['effect_id']} ({e['kind']}, step {e['step_id']!r}) is {e['status']}"
            + (" again after a lost attempt" if e.get("lost_attempt") else "")
            for e in effects[:20]
        )
        more = f"; and {len(effects) - 20} more" if len(effects) > 20 else ""
        super().__init__(
            f"from_step={from_step!r}: run {run_id} has {len(effects)} effect(s) at or after "
            f"this step that may already have taken effect: {listed}{more}. The fork would "
            "intend them again under new keys, so a sink could apply them twice: settle them "
            "first (outbox effects resolve the unknown ones; let the others be delivered, or "
            "cancel the original), or fork anyway with allow_unsettled=True "
            "(outbox runs fork --allow-unsettled)"
        )


class LeaseLost(RunStateError):
    """The caller's lease on a run or effect was taken over; its writes are refused (fencing)."""


class StepAlreadyRecorded(RunStateError):
    """The SQL API refused a step that another transaction (or an earlier attempt) recorded.

    Raised for SQLSTATE ``OB006`` (docs/sql-api.md). The caller's transaction is
    aborted; roll it back and read the recorded result (``outbox_step``).
    """

    def __init__(self, run_id: Any, step_id: str) -> None:
        self.run_id = run_id
        self.step_id = step_id
        super().__init__(
            f"step_id={step_id!r} of run {run_id} is already recorded: roll back and replay it"
        )


class BudgetExceeded(OutboxError):
    """A step would spend beyond the run's budget; nothing of the step was committed."""

    def __init__(
        self, run_id: Any, requested: float, remaining: float, *, what: str | None = None
    ) -> None:
        self.run_id = run_id
        self.requested = requested
        self.remaining = remaining
        # ``what`` says what was refused when its cost is not known (a model request
        # not made): "needs 0" would read as a bug.
        needs = f"step needs {requested:g} but only" if what is None else f"{what}:"
        super().__init__(f"run_id={str(run_id)!r}: {needs} {remaining:g} remains")


class WaitTimeout(OutboxError):
    """A wait ran out. Recorded at the step, so every replay raises it again."""


class SignalTimeout(WaitTimeout):
    """A wait for a signal timed out."""

    def __init__(self, step_id: str, name: str) -> None:
        self.step_id = step_id
        self.name = name
        super().__init__(f"step_id={step_id!r}: signal {name!r} did not arrive in time")


class EffectTimeout(WaitTimeout):
    """An awaited effect did not finish in time."""

    def __init__(self, step_id: str, effect_id: Any) -> None:
        self.step_id = step_id
        self.effect_id = effect_id
        super().__init__(f"step_id={step_id!r}: effect {effect_id} did not finish in time")


class EffectFailed(OutboxError):
    """An effect the caller awaited ended in a failed (or cancelled) state."""

    def __init__(self, effect_id: Any, status: str, error: str | None) -> None:
        self.effect_id = effect_id
        self.status = status
        self.error = error
        super().__init__(f"effect_id={str(effect_id)!r} ended {status}: {error or 'no reason'}")


class EffectRejected(EffectFailed):
    """An effect held for approval was rejected: by a person (``by``, ``note``) or its deadline.

    It never reached the sink. A run awaiting it sees this (recorded, so every
    replay raises it again); ``except EffectFailed`` catches it too.
    """

    def __init__(self, effect_id: Any, note: str | None, by: str | None = None) -> None:
        self.effect_id = effect_id
        self.status = "rejected"
        self.error = note
        self.note = note
        self.by = by
        who = f" by {by}" if by else ""
        Exception.__init__(
            self, f"effect_id={str(effect_id)!r} was rejected{who}: {note or 'no reason'}"
        )


class ApprovalRefused(OutboxError):
    """An approval or rejection that changed nothing: the effect is as it was.

    ``reason`` says why: the digest names another payload (an approval of one
    payload never releases another), the effect is not awaiting approval (it was
    decided already: an approval is used once), or its deadline passed (its
    ``on_timeout`` was applied instead). The refusal is kept in the attempt log.
    """

    def __init__(self, effect_id: Any, reason: str) -> None:
        self.effect_id = effect_id
        self.reason = reason
        super().__init__(f"effect_id={str(effect_id)!r}: approval refused: {reason}")


class SchemaError(OutboxError):
    """The database schema does not match this code."""


class SchemaOutdated(SchemaError):
    """Migrations are pending; run ``outbox migrate``."""


class SchemaTooNew(SchemaError):
    """The database was migrated by a newer agent-outbox; refuse rather than corrupt it."""


class MigrationError(SchemaError):
    """A migration failed (named, with the server's reason), or a shipped one was changed."""


class DatabaseError(OutboxError):
    """PostgreSQL refused or failed an operation; the driver's error is ``__cause__``.

    ``sqlstate`` is PostgreSQL's error code when the server gave one.
    ``transient`` says the same statement may well succeed later (a lost
    connection, a deadlock, a server shutting down); otherwise it failed on
    what it was given or on what the role may do, and would fail again.
    ``connection_lost`` says a connection the server had accepted was cut
    before it answered (a server restarting mid-statement gives no SQLSTATE):
    the server was there, unlike a connection that was never made.
    """

    def __init__(
        self,
        message: str,
        *,
        sqlstate: str | None = None,
        transient: bool = False,
        connection_lost: bool = False,
    ):
        super().__init__(message)
        self.sqlstate = sqlstate
        self.transient = transient
        self.connection_lost = connection_lost


class EmbeddedServerError(DatabaseError):
    """The embedded PostgreSQL server could not be initialised, started or stopped."""


class StoredValueAltered(DatabaseError):
    """A value stored by reference (``outbox_blobs``) does not hash to the sha256 that names it.

    Its text was changed after it was written (by hand, or by a broken restore);
    it is refused rather than read. ``sha256`` names the value.
    """

    def __init__(self, sha256: str):
        super().__init__(
            f"stored value sha256={sha256} does not match its text in outbox_blobs "
            "(altered after it was written): refused"
        )
        self.sha256 = sha256


class DeliveryError(OutboxError):
    """Raised by a deliverer to say how an attempt ended; the daemon reads it, callers do not."""


class RetryableError(DeliveryError):
    """Raise from a deliverer for a transient failure (optionally with ``retry_after`` seconds).

    ``rate_limited`` slows every effect of this kind in this daemon, not just this one.
    """

    def __init__(
        self, reason: str, *, retry_after: float | None = None, rate_limited: bool = False
    ) -> None:
        super().__init__(reason)
        self.retry_after = check_seconds("retry_after", retry_after)
        self.rate_limited = rate_limited


class PermanentError(DeliveryError):
    """Raise from a deliverer when the effect can never succeed as it stands."""
