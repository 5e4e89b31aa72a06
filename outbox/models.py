"""Frozen pydantic models for every record that crosses a boundary, and their status enums.

Records are values: change one with ``record.model_copy(update=...)``. Their JSON
Schemas are exported to ``schemas/`` (``outbox schemas export``).
"""

from __future__ import annotations

import re
from datetime import datetime
from decimal import Decimal
from enum import StrEnum
from typing import Annotated, Any, NamedTuple
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, field_validator
from pydantic_core import PydanticCustomError

from outbox.governance.gates import ApprovalPolicy
from outbox.governance.intent_rules import (
    KIND_PATTERN,
    MAX_AMOUNT,
    MAX_ATTEMPTS,
    MAX_DELAY_SECONDS,
    MAX_FAIRNESS_KEY_LENGTH,
    MAX_KEY_LENGTH,
    MAX_KIND_LENGTH,
    MAX_PRIORITY,
    MAX_SCHEMA_VERSION,
    RESERVED_KIND_PREFIXES,
    identifier_violation,
)

__all__ = [
    "ACTIVE_RUN_STATUSES",
    "DRY_RUN_KIND_PREFIX",
    "LIVE_RUN_STATUSES",
    "NEEDS_PERSON_EFFECT_STATUSES",
    "NOT_STARTED_EFFECT_STATUSES",
    "OPEN_EFFECT_STATUSES",
    "REDISPATCH",
    "STOPPING_RUN_STATUSES",
    "TERMINAL_EFFECT_STATUSES",
    "TERMINAL_RUN_STATUSES",
    "AttemptOutcome",
    "Compensation",
    "Effect",
    "EffectAttempt",
    "EffectIntent",
    "EffectStatus",
    "Lease",
    "OnConflict",
    "RunMode",
    "RunRecord",
    "RunStart",
    "RunStatus",
    "StepRecord",
    "StepStatus",
    "real_kind",
]


class RunStatus(StrEnum):
    """Where a run is in its life."""

    RUNNABLE = "runnable"
    RUNNING = "running"
    WAITING = "waiting"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    COMPENSATING = "compensating"
    COMPENSATED = "compensated"
    COMPENSATION_FAILED = "compensation_failed"
    #: held by an operator (``outbox runs pause``): not claimed, its effects not delivered
    PAUSED = "paused"


# Named sets of statuses: the SQL (predicates, partial indexes, CHECK
# constraints) is built from these, so each set is written once.

#: A run in one of these accepts steps and effects.
ACTIVE_RUN_STATUSES: tuple[RunStatus, ...] = (
    RunStatus.RUNNABLE,
    RunStatus.RUNNING,
    RunStatus.WAITING,
)
#: A run in one of these has not ended: it accepts signals, can be cancelled,
#: and keeps its agent version in use. A paused run is live but takes no steps.
LIVE_RUN_STATUSES: tuple[RunStatus, ...] = (*ACTIVE_RUN_STATUSES, RunStatus.PAUSED)
#: A run being cancelled: effects finish, then compensation runs.
STOPPING_RUN_STATUSES: tuple[RunStatus, ...] = (RunStatus.CANCELLING, RunStatus.COMPENSATING)
#: A run in one of these has ended for good.
TERMINAL_RUN_STATUSES: tuple[RunStatus, ...] = (
    RunStatus.COMPLETED,
    RunStatus.FAILED,
    RunStatus.CANCELLED,
    RunStatus.COMPENSATED,
    RunStatus.COMPENSATION_FAILED,
)


class EffectStatus(StrEnum):
    """Where an effect is on its way to the outside world."""

    PENDING = "pending"
    IN_FLIGHT = "in_flight"
    #: claimed by a relay for Kafka (published, or about to be), waiting for a
    #: stream deliverer to read its record (stream mode)
    DISPATCHED = "dispatched"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    UNKNOWN = "unknown"
    CANCELLED = "cancelled"
    COMPENSATED = "compensated"
    #: not yet attempted, held while its run is paused (``pending`` again at resume)
    PAUSED = "paused"
    #: held back by an approval gate: never claimed until a person approves its payload
    AWAITING_APPROVAL = "awaiting_approval"
    #: a person (or the gate's deadline) refused it: it never reaches the sink
    REJECTED = "rejected"


#: An effect in one of these can no longer change by delivery.
TERMINAL_EFFECT_STATUSES: tuple[EffectStatus, ...] = (
    EffectStatus.SUCCEEDED,
    EffectStatus.FAILED,
    EffectStatus.CANCELLED,
    EffectStatus.COMPENSATED,
    EffectStatus.REJECTED,
)
#: Effects still on their way: waiting for an approval, not yet attempted, being
#: attempted, handed to Kafka, waiting for an operator, or held by a paused run.
OPEN_EFFECT_STATUSES: tuple[EffectStatus, ...] = (
    EffectStatus.PENDING,
    EffectStatus.IN_FLIGHT,
    EffectStatus.DISPATCHED,
    EffectStatus.UNKNOWN,
    EffectStatus.PAUSED,
    EffectStatus.AWAITING_APPROVAL,
)
#: Open effects that no deliverer has started: a cancelled run cancels them,
#: a paused run holds them (as ``paused``).
NOT_STARTED_EFFECT_STATUSES: tuple[EffectStatus, ...] = (
    EffectStatus.PENDING,
    EffectStatus.DISPATCHED,
    EffectStatus.PAUSED,
    EffectStatus.AWAITING_APPROVAL,
)
#: Effects a person must look at: unknown (did it happen?), failed, or awaiting an approval.
NEEDS_PERSON_EFFECT_STATUSES: tuple[EffectStatus, ...] = (
    EffectStatus.UNKNOWN,
    EffectStatus.FAILED,
    EffectStatus.AWAITING_APPROVAL,
)

#: The kinds of a dry run's effects start with this: no real deliverer serves such a
#: kind (a caller cannot name one), so a dry run's effects can never reach a sink.
DRY_RUN_KIND_PREFIX = "dry-run:"


def real_kind(kind: str) -> str:
    """The kind an effect was intended as (without :data:`DRY_RUN_KIND_PREFIX`)."""
    return kind.removeprefix(DRY_RUN_KIND_PREFIX)


class RunMode(StrEnum):
    """How a run's effects are delivered."""

    #: to the real sinks
    LIVE = "live"
    #: to a recording deliverer that never reaches a sink (``outbox deliver --dry-run``)
    DRY_RUN = "dry_run"


class StepStatus(StrEnum):
    """A recorded step: done, or a wait recorded with its deadline and not yet over."""

    COMPLETED = "completed"
    WAITING = "waiting"


class AttemptOutcome(StrEnum):
    """The word an attempt-log row records for how an attempt (or a change to it) ended."""

    SUCCEEDED = "succeeded"
    RETRY = "retry"
    FAILED = "failed"
    UNKNOWN = "unknown"
    #: a completion for an attempt that was no longer the effect's (fencing, G4)
    STALE = "stale"
    #: the reconciler resolved an attempt whose lease ran out
    EXPIRED = "expired"
    #: an operator closed an ``unknown`` effect
    RESOLVED = "resolved"
    #: an operator put a ``failed`` effect back
    RETRIED = "retried"
    #: its run was cancelled before it started (who and why in ``detail``)
    CANCELLED = "cancelled"
    #: given back unstarted (shutdown, a schema version this deliverer does not know)
    RELEASED = "released"
    #: published to Kafka by a relay (stream mode): written by relays that marked
    #: after publishing; a relay now claims straight into ``dispatched`` and logs
    #: nothing, so only older attempt logs hold it
    DISPATCHED = "dispatched"
    #: settled by asking the sink (``Deliverer.lookup``)
    LOOKED_UP = "looked_up"
    #: a person approved the payload (digest) of an effect held by a gate
    APPROVED = "approved"
    #: a person rejected an effect held by a gate
    REJECTED = "rejected"
    #: an approval that named the wrong digest, or came too late: nothing changed
    APPROVAL_REFUSED = "approval_refused"
    #: the gate's deadline passed: its ``on_timeout`` was applied
    TIMED_OUT = "timed_out"


#: The ``resolution`` of an ``expired`` attempt-log row whose attempt made no call
#: (a relay's dispatch): unlike any other lost attempt's, it leaves no doubt.
REDISPATCH = "re-dispatch"


class Lease(NamedTuple):
    """Who holds a claimed row, and the attempt number that fences its writes (G4)."""

    owner: str
    attempt: int


_FROZEN = ConfigDict(frozen=True, extra="forbid")

#: A link of a hash chain: 32 bytes, written as hex in JSON.
ChainHash = Annotated[
    bytes, PlainSerializer(lambda value: value.hex(), return_type=str, when_used="json")
]


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore", from_attributes=True)


_KIND = re.compile(KIND_PATTERN)


def _no_bool(value: Any) -> Any:
    # bool is an int to Python: budget=True would be a budget of 1.
    if isinstance(value, bool):
        raise ValueError("must be a number, not a bool")
    return value


def _caller_kind(value: str) -> str:
    if value.startswith(RESERVED_KIND_PREFIXES):
        raise ValueError(
            f"kinds starting with {RESERVED_KIND_PREFIXES[0]!r} are reserved for dry runs"
        )
    return value


def _plain_text(value: str | None) -> str | None:
    if value is not None:
        found = identifier_violation(value, "")
        if found is not None:
            # The rule's code as the error's type: boundaries report it (ValidationError.rule).
            raise PydanticCustomError(found.code, "{reason}", {"reason": found.reason})
    return value


class OnConflict(StrEnum):
    """What ``start_run(key=...)`` does when a run with that key exists (same inputs)."""

    #: return the existing run (a second start is a no-op)
    RETURN_EXISTING = "return_existing"
    #: refuse with :class:`~outbox.RunExists`
    REJECT = "reject"


class RunStart(BaseModel):
    """What ``Outbox.start_run`` accepts; validated before anything is written."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    agent: str = Field(min_length=1, max_length=200, strict=True)
    version: str = Field(min_length=1, max_length=100, strict=True)
    inputs: Any = None
    budget: float | None = Field(default=None, ge=0, le=MAX_AMOUNT)
    #: A business key: one run per key (a second start returns it or is refused).
    key: str | None = Field(default=None, min_length=1, max_length=MAX_KEY_LENGTH, strict=True)
    on_conflict: OnConflict = OnConflict.RETURN_EXISTING
    #: Higher is claimed first by workers; the run's effects inherit it.
    priority: int = Field(default=0, ge=-MAX_PRIORITY, le=MAX_PRIORITY, strict=True)
    #: Workers share capacity between fairness keys; the run's effects inherit it.
    fairness_key: str = Field(default="", max_length=MAX_FAIRNESS_KEY_LENGTH, strict=True)
    mode: RunMode = RunMode.LIVE

    _budget_is_a_number = field_validator("budget", mode="before")(_no_bool)
    _names_are_text = field_validator("agent", "version", "key", "fairness_key")(_plain_text)


class Compensation(BaseModel):
    """The effect that undoes a succeeded effect when its run is cancelled."""

    model_config = _FROZEN

    kind: str = Field(min_length=1, max_length=200)
    payload: Any


class EffectIntent(BaseModel):
    """What ``tx.intend`` accepts for one effect (the rules: ``outbox.governance.intent_rules``)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    kind: str = Field(min_length=1, max_length=MAX_KIND_LENGTH, pattern=KIND_PATTERN)
    payload: Any
    key: str | None = Field(default=None, min_length=1, max_length=MAX_KEY_LENGTH, strict=True)
    ordering_key: str | None = Field(
        default=None, min_length=1, max_length=MAX_KEY_LENGTH, strict=True
    )
    max_attempts: int | None = Field(default=None, ge=1, le=MAX_ATTEMPTS, strict=True)
    delay_seconds: float = Field(default=0.0, ge=0, le=MAX_DELAY_SECONDS)
    schema_version: int = Field(default=1, ge=1, le=MAX_SCHEMA_VERSION, strict=True)
    compensate: Compensation | None = None
    cost: float | None = Field(default=None, ge=0, le=MAX_AMOUNT)
    #: None: the run's (0 without a run). Higher is claimed first.
    priority: int | None = Field(default=None, ge=-MAX_PRIORITY, le=MAX_PRIORITY, strict=True)
    #: None: the run's ("" without a run). Claims share capacity between fairness keys.
    fairness_key: str | None = Field(default=None, max_length=MAX_FAIRNESS_KEY_LENGTH, strict=True)
    #: wait for a person's approval of this payload before any delivery
    #: (see ``outbox.governance.gates``)
    approval: ApprovalPolicy | None = None

    _numbers_are_numbers = field_validator("delay_seconds", "cost", mode="before")(_no_bool)
    _keys_are_text = field_validator("key", "ordering_key", "fairness_key")(_plain_text)
    _kind_is_not_reserved = field_validator("kind")(_caller_kind)

    @field_validator("compensate")
    @classmethod
    def _compensation_kind(cls, value: Compensation | None) -> Compensation | None:
        # Checked here, not on Compensation: records stored before this rule must stay readable.
        if value is not None and _KIND.match(value.kind) is None:
            raise ValueError(f"kind {value.kind!r} must match {KIND_PATTERN}")
        if value is not None:
            _caller_kind(value.kind)
        return value


class RunRecord(_Record):
    """A run as stored: who started it, what it was given, where it is."""

    id: UUID
    agent: str
    agent_version: str
    inputs: Any
    inputs_hash: str
    status: RunStatus
    state: Any
    plan: Any
    current_step: str | None
    result: Any = None
    error: Any = None
    budget: Decimal | None = None
    spent: Decimal = Decimal(0)
    reserved: Decimal = Decimal(0)
    attempt: int = 0
    lease_owner: str | None = None
    lease_expires_at: datetime | None = None
    created_at: datetime
    updated_at: datetime
    wake_at: datetime | None = None
    wait_signal: str | None = None
    wait_effect: UUID | None = None
    step_retries: dict[str, int] = Field(default_factory=dict)
    #: Agent-version upgrades this run went through: ``{from, to, at, worker}``.
    upgrades: list[dict[str, Any]] = Field(default_factory=list)
    cancel_reason: str | None = None
    #: The W3C ``traceparent`` of the run's trace (None: started outside any trace).
    trace_parent: str | None = None
    #: The business key it was started with (one run per key), if any.
    key: str | None = None
    priority: int = 0
    fairness_key: str = ""
    #: Set while paused (or while a pause waits for the step in flight to finish).
    paused_at: datetime | None = None
    pause_reason: str | None = None
    #: The run this one was forked from (``outbox runs fork``), and the step it restarted at.
    forked_from: UUID | None = None
    forked_at_step: str | None = None

    @property
    def paused(self) -> bool:
        """True while paused, or while a pause waits for the step in flight to finish."""
        return self.paused_at is not None

    #: a dry run's effects go to a recording deliverer, never to a sink
    dry_run: bool = False

    @property
    def mode(self) -> RunMode:
        """``live`` or ``dry_run``."""
        return RunMode.DRY_RUN if self.dry_run else RunMode.LIVE

    @property
    def remaining_budget(self) -> Decimal | None:
        """Budget not yet spent nor reserved (None: no budget)."""
        if self.budget is None:
            return None
        return self.budget - self.spent - self.reserved


class StepRecord(_Record):
    """A completed step: its recorded result is what a replay returns."""

    run_id: UUID
    step_id: str
    seq: int
    kind: str
    result: Any = None
    error: Any = None
    completed_at: datetime
    #: "waiting": a sleep or wait recorded with its deadline, not yet satisfied.
    status: StepStatus = StepStatus.COMPLETED
    #: this step's link in the run's hash chain (``outbox audit verify``); None while waiting
    hash: ChainHash | None = None


class Effect(_Record):
    """An effect intent and its delivery state."""

    id: UUID
    seq: int | None = None
    run_id: UUID | None = None
    step_id: str | None = None
    step_index: int | None = None
    kind: str
    payload: Any
    payload_hash: str
    schema_version: int = 1
    idempotency_key: str
    ordering_key: str | None = None
    status: EffectStatus
    attempt: int = 0
    max_attempts: int | None = None
    result: Any = None
    last_error: str | None = None
    compensate: Compensation | None = None
    compensates: UUID | None = None
    cost: Decimal | None = None
    available_at: datetime | None = None
    lease_owner: str | None = None
    lease_expires_at: datetime | None = None
    attempt_started_at: datetime | None = None
    created_at: datetime | None = None
    completed_at: datetime | None = None
    priority: int = 0
    fairness_key: str = ""
    #: The W3C ``traceparent`` current when the intent was written (None: no trace).
    trace_parent: str | None = None
    #: the gate that held it for approval (``gate``, ``timeout``, ``on_timeout``, ...), if any
    approval: Any = None
    approval_deadline: datetime | None = None

    @property
    def digest(self) -> str:
        """What an approval must name: the sha256 of the canonical payload (``payload_hash``)."""
        return self.payload_hash

    @property
    def dry_run(self) -> bool:
        """True for an effect of a dry run (its kind carries the dry-run prefix)."""
        return self.kind.startswith(DRY_RUN_KIND_PREFIX)

    @property
    def terminal(self) -> bool:
        """True once the effect can no longer change by delivery."""
        return self.status in TERMINAL_EFFECT_STATUSES


class EffectAttempt(_Record):
    """One line of an effect's attempt log."""

    effect_id: UUID
    attempt: int
    worker: str | None
    started_at: datetime | None
    finished_at: datetime
    outcome: str
    detail: Any = None
    #: this row's link in the effect's hash chain (``outbox audit verify``)
    hash: ChainHash | None = None
