"""What ``Run`` and ``AsyncRun`` share: every rule of a run but the waiting.

The twins differ only in how they wait for the database: ``Run`` calls,
``AsyncRun`` awaits. Everything that decides (step ids, replay, the one-statement
checkpoint and why a run refused it, fencing, what a wait means, how a run
ends) lives here once, as plain methods or as sync code over a connection
that the async twin runs through ``AsyncConnection.run_sync``.
"""

from __future__ import annotations

import math
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from outbox.blobs import Blob, Stored, store_value
from outbox.errors import (
    BudgetExceeded,
    IdempotencyConflict,
    LeaseLost,
    OutboxError,
    RunNotFound,
    RunPaused,
    RunTerminal,
    ValidationError,
)
from outbox.faults import crash_point
from outbox.intent_rules import MAX_DELAY_SECONDS, check_identifier
from outbox.models import (
    LIVE_RUN_STATUSES,
    TERMINAL_RUN_STATUSES,
    Effect,
    Lease,
    RunRecord,
    RunStatus,
    StepRecord,
    StepStatus,
)
from outbox.payloads import decode
from outbox.runs.context import RunContext
from outbox.runs.intents import StepWrites
from outbox.runs.waits import Pending, WaitSpec, check_wait, recorded_error
from outbox.storage import Connection
from outbox.storage.run_tx import RunTx
from outbox.storage.store import StepOutcome, StepTaken
from outbox.tracing import step_span
from outbox.validation import as_uuid, name_field

__all__ = ["AlreadyRecorded", "Paused", "RunBase", "Suspended"]


#: Internal: the step was recorded by someone else; roll ours back and replay.
#: The storage layer raises it when the checkpoint's insert meets the step's row.
AlreadyRecorded = StepTaken


class Suspended(BaseException):
    """Raised out of a worker's handler when its run was parked as ``waiting``.

    A ``BaseException`` so that a handler's ``except Exception`` cannot swallow
    it. The worker catches it; the run resumes when its wait is over.
    """

    def __init__(self, run_id: uuid.UUID, step_id: str) -> None:
        super().__init__(f"run {run_id} waits at step {step_id!r}")
        self.run_id = run_id
        self.step_id = step_id


class Paused(Suspended):
    """Raised out of a worker's handler after the step a pause waited for was recorded.

    The worker parks the run as ``paused`` (``outbox runs resume`` goes on from the
    next step). A ``Suspended``, so code that lets a wait through lets it through too.
    """

    def __init__(self, run_id: uuid.UUID, step_id: str) -> None:
        BaseException.__init__(self, f"run {run_id} is paused after step {step_id!r}")
        self.run_id = run_id
        self.step_id = step_id


def _seconds(value: timedelta | float | None, field: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except OverflowError:  # an int too large for a float
            seconds = math.inf
    else:
        raise ValidationError(field, value, "must be a timedelta or a number of seconds")
    if not 0 <= seconds <= MAX_DELAY_SECONDS:  # NaN fails both comparisons
        raise ValidationError(
            field, value, f"must be a duration from 0 to {MAX_DELAY_SECONDS} seconds (ten years)"
        )
    return seconds


class RunBase:
    """A handle on one run: its recorded steps, state and plan (the twins add the calls)."""

    def __init__(
        self,
        ctx: RunContext,
        record: RunRecord,
        steps: list[StepRecord],
        *,
        lease: Lease | None = None,
    ) -> None:
        self._ctx = ctx
        self._record = record
        self._steps = {s.step_id: s for s in steps}
        self._lease = lease
        #: The step being attempted now (a worker counts a failure against it).
        self.active_step: str | None = None
        #: True when the last step (``call``, ``transaction`` or a wait) returned what
        #: was recorded before, by this handle or another process, instead of
        #: recording it now (an HTTP replay answers 200 rather than 201 with it).
        self.last_replayed = False

    # -- what it is -------------------------------------------------------------

    @property
    def id(self) -> uuid.UUID:
        """The run's id."""
        return self._record.id

    @property
    def context(self) -> RunContext:
        """The store, settings and wake-ups this handle writes through."""
        return self._ctx

    @property
    def record(self) -> RunRecord:
        """The run as last read or written by this handle."""
        return self._record

    @property
    def dry_run(self) -> bool:
        """True for a dry run: its effects go to a recording deliverer, never to a sink."""
        return self._record.dry_run

    @property
    def agent(self) -> str:
        """The agent that runs it."""
        return self._record.agent

    @property
    def version(self) -> str:
        """The agent version it is pinned to."""
        return self._record.agent_version

    @property
    def inputs(self) -> Any:
        """The inputs it started with (never change)."""
        return self._record.inputs

    @property
    def status(self) -> RunStatus:
        """Its status as last seen by this handle."""
        return self._record.status

    @property
    def state(self) -> Any:
        """The state recorded by the last step that set one."""
        return self._record.state

    @property
    def plan(self) -> Any:
        """The plan recorded by the last step that set one."""
        return self._record.plan

    @property
    def current_step(self) -> str | None:
        """The last step recorded."""
        return self._record.current_step

    @property
    def completed_steps(self) -> list[str]:
        """Step ids completed so far, in order (a wait still under way is not among them)."""
        done = [s for s in self._steps.values() if s.status == StepStatus.COMPLETED]
        return [s.step_id for s in sorted(done, key=lambda s: s.seq)]

    def step(self, step_id: str) -> StepRecord | None:
        """The record of one completed step, if any."""
        return self._steps.get(step_id)

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.id} {self.agent}@{self.version} {self.status.value}"
            f" steps={len(self._steps)}>"
        )

    def _reload(self, loaded: tuple[RunRecord, list[StepRecord]] | None) -> None:
        if loaded is None:
            raise RunNotFound(self.id)
        self._record, steps = loaded
        self._steps = {s.step_id: s for s in steps}

    # -- steps ------------------------------------------------------------------

    def _recorded_or_start(self, step_id: Any) -> tuple[str, StepRecord | None]:
        """Check the step id; return its record if it is known, else mark it active."""
        step_id = self._check_step_id(step_id)
        self.last_replayed = step_id in self._steps
        if self.last_replayed:
            return step_id, self._steps[step_id]
        self._check_live()
        self.active_step = step_id
        return step_id, None

    def _span(self, step_id: str, kind: str) -> Any:
        """The step's span, in the run's trace (see :mod:`outbox.tracing`)."""
        return step_span(
            traceparent=self._record.trace_parent, run_id=str(self.id), step_id=step_id, kind=kind
        )

    def _encode_result(self, value: Any) -> Stored:
        return store_value(value, field="result", limits=self._ctx.settings.value_limits)

    def _close_step(
        self,
        conn: Connection,
        tx: StepWrites,
        step_id: str,
        kind: str,
        result: Stored | None,
        notified: float | None,
        own: bool = True,
    ) -> StepOutcome:
        """Write the step's one-statement checkpoint in its open transaction and judge it (sync).

        Raises the run's refusal (ended, paused, lease lost, over budget),
        :class:`AlreadyRecorded` when another handle recorded the step first, or
        :class:`IdempotencyConflict`; the caller's transaction then rolls back whole.
        ``own`` is False when the step joined a caller's transaction. When the
        transaction is ours and nothing was sent on it yet (the step's function
        wrote no rows of its own), the statement commits by itself.
        """
        store = self._ctx.store
        blobs: list[Blob | None] = [None if result is None else result.blob, *tx._blobs()]
        alone = own and not any(blobs) and store.untouched(conn)
        if alone:
            # The statement below is the commit: a crash "before commit" is before it.
            crash_point("before_step_commit", step_id, run=self.id)
        outcome = store.commit_step(
            conn,
            {
                "run_id": self.id,
                "step_id": step_id,
                "kind": kind,
                "step_result": None if result is None else result.json,
                "new_state": tx._state_json,
                "new_plan": tx._plan_json,
                "effects": tx._intents.as_json(),
                "debit": tx._debit,
                "reserve": tx._reserve,
                "ledger": tx._ledger_json(),
                **self._fence_params(),
            },
            fenced=self._lease is not None,
            notify=notified is not None,
            blobs=blobs,
            alone=alone,
        )
        if not alone:
            crash_point("before_step_commit", step_id, run=self.id)
        if not outcome.run_ok:
            raise self._refusal(conn, tx._debit + tx._reserve)
        if outcome.step_seq is None:
            raise AlreadyRecorded
        if outcome.inserted != tx._intents.pending:
            raise IdempotencyConflict(
                tx._intents.taken_key(), "intended concurrently by another transaction"
            )
        return outcome

    def _recorded(
        self,
        step_id: str,
        kind: str,
        tx: StepWrites,
        stored: Stored | None,
        outcome: StepOutcome,
    ) -> Any:
        """The step committed: remember it and return its result.

        In a worker, a pause that waited for this step raises :class:`Paused` here.
        """
        record = self._record
        self._record = record.model_copy(
            update={
                "current_step": step_id,
                **({"state": decode(tx._state.value_json)} if tx._state is not None else {}),
                **({"plan": decode(tx._plan.value_json)} if tx._plan is not None else {}),
                # as the statement moved them: run.record.remaining_budget stays true
                **({"spent": record.spent + tx._debit} if tx._debit else {}),
                **({"reserved": record.reserved + tx._reserve} if tx._reserve else {}),
            }
        )
        result = None if stored is None else decode(stored.value_json)
        self._steps[step_id] = StepRecord(
            run_id=self.id,
            step_id=step_id,
            seq=outcome.step_seq or 0,
            kind=kind,
            result=result,
            completed_at=datetime.now(UTC),
        )
        self.active_step = None
        crash_point("after_step", step_id, run=self.id)
        if outcome.paused and self._lease is not None:
            raise Paused(self.id, step_id)
        return result

    def _adopt(self, step_id: str, recorded: StepRecord | None) -> Any:
        """Another process recorded this step first; ours was rolled back whole."""
        assert recorded is not None
        self._steps[step_id] = recorded
        self.active_step = None
        self.last_replayed = True
        return self._replay(recorded)

    # -- waiting (G8) -------------------------------------------------------------

    @staticmethod
    def _sleep_spec(duration: timedelta | float) -> WaitSpec:
        return WaitSpec("sleep", seconds=_seconds(duration, "duration"))

    @staticmethod
    def _sleep_until_spec(when: datetime) -> WaitSpec:
        if not isinstance(when, datetime) or when.tzinfo is None:
            raise ValidationError("when", when, "must be a timezone-aware datetime")
        return WaitSpec("sleep", until=when)

    @staticmethod
    def _signal_spec(name: str, timeout: timedelta | float | None) -> WaitSpec:
        name_field(name, "name")
        return WaitSpec("signal", seconds=_seconds(timeout, "timeout"), signal=name)

    @staticmethod
    def _effect_spec(
        effect: Effect | uuid.UUID | str,
        timeout: timedelta | float | None,
        step_id: str | None,
    ) -> tuple[str, WaitSpec]:
        effect_id = effect.id if isinstance(effect, Effect) else as_uuid(effect, "effect")
        spec = WaitSpec("effect", seconds=_seconds(timeout, "timeout"), effect_id=effect_id)
        return step_id or f"await:{effect_id}", spec

    def _wait_recorded(self, step_id: Any) -> tuple[str, StepRecord | None]:
        step_id = self._check_step_id(step_id)
        recorded = self._steps.get(step_id)
        self.last_replayed = recorded is not None and recorded.status == StepStatus.COMPLETED
        if recorded is not None and recorded.status == StepStatus.COMPLETED:
            return step_id, recorded
        self._check_live()
        self.active_step = step_id
        return step_id, None

    def _check_wait(self, tx: RunTx, step_id: str, spec: WaitSpec) -> StepRecord | Pending:
        """One check of a wait, in one run-locked transaction (sync; both twins run it)."""
        self._lock_for_write(tx)
        return check_wait(tx, self.id, step_id, spec, park=self._lease is not None)

    def _wait_done(self, step_id: str, outcome: StepRecord | Pending) -> tuple[bool, Any]:
        """(True, result) when the wait is over; raises :class:`Suspended` in a worker."""
        if isinstance(outcome, StepRecord):
            self._steps[step_id] = outcome
            self._record = self._record.model_copy(update={"current_step": step_id})
            self.active_step = None
            return True, self._replay(outcome)
        if self._lease is not None:
            self._record = self._record.model_copy(update={"status": RunStatus.WAITING})
            crash_point("parked", step_id, run=self.id)
            raise Suspended(self.id, step_id)
        return False, None

    def _lock_for_write(self, tx: RunTx) -> None:
        """Lock the run row and check that this handle may still write to it."""
        locked = tx.lock(self.id)
        if locked.status == RunStatus.PAUSED:
            self._record = self._record.model_copy(update={"status": locked.status})
            raise RunPaused(self.id)
        if locked.status not in LIVE_RUN_STATUSES:
            self._record = self._record.model_copy(update={"status": locked.status})
            raise RunTerminal(self.id, locked.status.value)
        if self._lease is not None and (
            locked.status != RunStatus.RUNNING or locked.lease != self._lease
        ):
            raise LeaseLost(
                f"run_id={str(self.id)!r}: lease attempt {self._lease.attempt} was lost"
            )

    # -- its end ----------------------------------------------------------------

    def _finish_params(self, status: RunStatus, result: Any, error: Any) -> dict[str, Any]:
        limits = self._ctx.settings.value_limits
        stored = {
            name: None if value is None else store_value(value, field=name, limits=limits)
            for name, value in (("result", result), ("error", error))
        }
        return {
            "status": status.value,
            **{name: None if s is None else s.json for name, s in stored.items()},
            "fence": self._lease,
            "blobs": [s.blob for s in stored.values() if s is not None],
            "values": stored,
        }

    @staticmethod
    def _finish_args(params: dict[str, Any]) -> dict[str, Any]:
        """What ``Store.finish_run`` takes of :meth:`_finish_params`."""
        return {k: v for k, v in params.items() if k != "values"}

    def _finished(self, status: RunStatus, params: dict[str, Any]) -> None:
        values = params["values"]
        self._record = self._record.model_copy(
            update={
                "status": status,
                **{name: None if s is None else decode(s.value_json) for name, s in values.items()},
            }
        )

    def _not_finished(self) -> OutboxError:
        """Why a finish changed nothing (the handle was refreshed first)."""
        if self._lease is not None and self.status not in TERMINAL_RUN_STATUSES:
            return LeaseLost(f"run_id={str(self.id)!r}: lease was taken over")
        return RunTerminal(self.id, self.status.value)

    # -- internals --------------------------------------------------------------

    def _check_step_id(self, step_id: Any) -> str:
        limit = self._ctx.settings.max_step_id_length
        if not isinstance(step_id, str):
            raise ValidationError("step_id", step_id, "must be a string")
        if not step_id.strip():
            raise ValidationError("step_id", step_id, "must not be empty")
        if len(step_id) > limit:
            raise ValidationError("step_id", step_id, f"is {len(step_id)} characters, over {limit}")
        return check_identifier(step_id, "step_id")

    def _check_live(self) -> None:
        if self.status in TERMINAL_RUN_STATUSES:
            raise RunTerminal(self.id, self.status.value)

    def _replay(self, step: StepRecord) -> Any:
        if step.error is not None:
            raise recorded_error(step.step_id, step.error)
        return step.result

    def _fence_params(self) -> dict[str, Any]:
        if self._lease is None:
            return {}
        return {"fence_owner": self._lease.owner, "fence_attempt": self._lease.attempt}

    def _refusal(self, conn: Connection, debit: Decimal) -> OutboxError:
        """Explain why the run refused a step (it wrote nothing)."""
        current = self._ctx.store.run_record(conn, self.id)
        if current is None:
            return RunNotFound(self.id)
        self._record = current
        if current.status == RunStatus.PAUSED:
            return RunPaused(self.id, current.pause_reason)
        if current.status not in LIVE_RUN_STATUSES:
            return RunTerminal(self.id, current.status.value)
        if self._lease is not None and (current.lease_owner, current.attempt) != self._lease:
            return LeaseLost(
                f"run_id={str(self.id)!r}: lease attempt {self._lease.attempt} "
                f"of {self._lease.owner!r} "
                f"was taken over (now attempt {current.attempt} of {current.lease_owner!r})"
            )
        budget = current.budget or Decimal(0)
        remaining = budget - current.spent - current.reserved
        return BudgetExceeded(self.id, float(debit), float(remaining))
