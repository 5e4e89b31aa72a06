"""Frozen pydantic models for every record that crosses a boundary, and their status enums.

Records are values: change one with ``record.model_copy(update=...)``. Their JSON
Schemas are exported to ``schemas/`` (``outbox schemas export``).
"""

from __future__ import annotations

import re
from datetime import datetime
from decimal import Decimal
from enum import StrEnum
from typing import Any, NamedTuple
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field, field_validator

from outbox.intent_rules import (
    KIND_PATTERN,
    MAX_AMOUNT,
    MAX_ATTEMPTS,
    MAX_DELAY_SECONDS,
    MAX_FAIRNESS_KEY_LENGTH,
    MAX_KEY_LENGTH,
    MAX_KIND_LENGTH,
    MAX_PRIORITY,
    MAX_SCHEMA_VERSION,
    identifier_violation,
)

__all__ = [
    "ACTIVE_RUN_STATUSES",
    "LIVE_RUN_STATUSES",
    "NOT_STARTED_EFFECT_STATUSES",
    "OPEN_EFFECT_STATUSES",
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
    "RunRecord",
    "RunStart",
    "RunStatus",
    "StepRecord",
    "StepStatus",
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
    #: published to Kafka by the relay, waiting for a stream deliverer (stream mode)
    DISPATCHED = "dispatched"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    UNKNOWN = "unknown"
    CANCELLED = "cancelled"
    COMPENSATED = "compensated"
    #: not yet attempted, held while its run is paused (``pending`` again at resume)
    PAUSED = "paused"


#: An effect in one of these can no longer change by delivery.
TERMINAL_EFFECT_STATUSES: tuple[EffectStatus, ...] = (
    EffectStatus.SUCCEEDED,
    EffectStatus.FAILED,
    EffectStatus.CANCELLED,
    EffectStatus.COMPENSATED,
)
#: Effects still on their way: not yet attempted, being attempted, handed to
#: Kafka, waiting for an operator, or held by a paused run.
OPEN_EFFECT_STATUSES: tuple[EffectStatus, ...] = (
    EffectStatus.PENDING,
    EffectStatus.IN_FLIGHT,
    EffectStatus.DISPATCHED,
    EffectStatus.UNKNOWN,
    EffectStatus.PAUSED,
)
#: Open effects that no deliverer has started: a cancelled run cancels them,
#: a paused run holds them (as ``paused``).
NOT_STARTED_EFFECT_STATUSES: tuple[EffectStatus, ...] = (
    EffectStatus.PENDING,
    EffectStatus.DISPATCHED,
    EffectStatus.PAUSED,
)


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
    #: given back unstarted (shutdown, a schema version this deliverer does not know)
    RELEASED = "released"
    #: published to Kafka by a relay (stream mode)
    DISPATCHED = "dispatched"
    #: settled by asking the sink (``Deliverer.lookup``)
    LOOKED_UP = "looked_up"


class Lease(NamedTuple):
    """Who holds a claimed row, and the attempt number that fences its writes (G4)."""

    owner: str
    attempt: int


_FROZEN = ConfigDict(frozen=True, extra="forbid")


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore", from_attributes=True)


_KIND = re.compile(KIND_PATTERN)


def _no_bool(value: Any) -> Any:
    # bool is an int to Python: budget=True would be a budget of 1.
    if isinstance(value, bool):
        raise ValueError("must be a number, not a bool")
    return value


def _plain_text(value: str | None) -> str | None:
    if value is not None:
        found = identifier_violation(value, "")
        if found is not None:
            raise ValueError(found.reason)
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

    _budget_is_a_number = field_validator("budget", mode="before")(_no_bool)
    _names_are_text = field_validator("agent", "version", "key", "fairness_key")(_plain_text)


class Compensation(BaseModel):
    """The effect that undoes a succeeded effect when its run is cancelled."""

    model_config = _FROZEN

    kind: str = Field(min_length=1, max_length=200)
    payload: Any


class EffectIntent(BaseModel):
    """What ``tx.intend`` accepts for one effect (the rules: ``outbox.intent_rules``)."""

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

    _numbers_are_numbers = field_validator("delay_seconds", "cost", mode="before")(_no_bool)
    _keys_are_text = field_validator("key", "ordering_key", "fairness_key")(_plain_text)

    @field_validator("compensate")
    @classmethod
    def _compensation_kind(cls, value: Compensation | None) -> Compensation | None:
        # Checked here, not on Compensation: records stored before this rule must stay readable.
        if value is not None and _KIND.match(value.kind) is None:
            raise ValueError(f"kind {value.kind!r} must match {KIND_PATTERN}")
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
