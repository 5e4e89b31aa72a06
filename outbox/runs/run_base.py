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
from typing import Any

from outbox.errors import (
    LeaseLost,
    OutboxError,
    RunNotFound,
    RunPaused,
    RunTerminal,
    ValidationError,
)
from outbox.faults import crash_point
from outbox.governance.intent_rules import MAX_DELAY_SECONDS, check_identifier
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
from outbox.payloads import Encoded, encode_value
from outbox.runs.context import RunContext
from outbox.runs.steps import StepWrites, committed_values, step_checkpoint
from outbox.runs.waits import Pending, WaitSpec, check_wait, recorded_error
from outbox.storage import Connection, writes
from outbox.storage.run_tx import RunTx
from outbox.storage.writes import StepTaken, StepWritten
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
        #: From ``start_run``: True when that call started the run, False when it
        #: returned one started before under the same id or business key.
        self.started = False

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

    def _encode_result(self, value: Any) -> Encoded:
        return encode_value(value, field="result", max_bytes=self._ctx.settings.max_payload_bytes)

    def _close_step(
        self,
        conn: Connection,
        tx: StepWrites,
        step_id: str,
        kind: str,
        result: Encoded,
        notified: float | None,
        own: bool = True,
    ) -> StepWritten:
        """Write the step's checkpoint in its open transaction (sync; one call of the function).

        Raises the run's refusal (ended, paused, lease lost, over budget),
        :class:`AlreadyRecorded` when another handle recorded the step first, or
        :class:`IdempotencyConflict`; the caller's transaction then rolls back whole.
        ``own`` is False when the step joined a caller's transaction. When the
        transaction is ours and nothing was sent on it yet (the step's function
        wrote no rows of its own), the call commits by itself.
        """
        # The client's throttle decides the wake-up (a NOTIFY in this commit, or none).
        step = step_checkpoint(tx, kind, result, lease=self._lease, wake=notified is not None)
        # takes_keys first: it may ask the database, which is then no longer untouched
        alone = own and not writes.takes_keys(conn, step) and writes.untouched(conn)
        if alone:
            # The call below is the commit: a crash "before commit" is before it.
            crash_point("before_step_commit", step_id, run=self.id)
        written = writes.commit_step(conn, step, alone=alone)
        if not alone:
            crash_point("before_step_commit", step_id, run=self.id)
        return written

    def _recorded(
        self,
        step_id: str,
        kind: str,
        tx: StepWrites,
        result: Encoded,
        written: StepWritten,
    ) -> Any:
        """The step committed: remember it and return its result.

        In a worker, a pause that waited for this step raises :class:`Paused` here.
        """
        self._record = self._record.model_copy(update=committed_values(tx))
        value = result.value()
        self._steps[step_id] = StepRecord(
            run_id=self.id,
            step_id=step_id,
            seq=written.step_seq,
            kind=kind,
            result=value,
            completed_at=datetime.now(UTC),
        )
        self.active_step = None
        crash_point("after_step", step_id, run=self.id)
        if written.paused and self._lease is not None:
            raise Paused(self.id, step_id)
        return value

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

    def _finish_values(self, result: Any, error: Any) -> dict[str, Encoded | None]:
        """A run's end, encoded (result or error; the other is None)."""
        limit = self._ctx.settings.max_payload_bytes
        return {
            name: None if value is None else encode_value(value, field=name, max_bytes=limit)
            for name, value in (("result", result), ("error", error))
        }

    def _finish_on(
        self, conn: Connection, status: RunStatus, values: dict[str, Encoded | None]
    ) -> None:
        """End the run in ``conn``'s transaction (sync; the async twin runs it through run_sync)."""
        writes.finish_run(
            conn,
            self.id,
            status=status.value,
            result_json=None if values["result"] is None else values["result"].json,
            error_json=None if values["error"] is None else values["error"].json,
            lease=self._lease,
        )

    def _finished(self, status: RunStatus, values: dict[str, Encoded | None]) -> None:
        self._record = self._record.model_copy(
            update={
                "status": status,
                **{name: None if v is None else v.value() for name, v in values.items()},
            }
        )

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

    def _refused(self, exc: OutboxError) -> None:
        """Keep the handle's status in step with a refusal of the run (it wrote nothing)."""
        if isinstance(exc, RunTerminal):
            self._record = self._record.model_copy(update={"status": RunStatus(exc.status)})
        elif isinstance(exc, RunPaused):
            self._record = self._record.model_copy(update={"status": RunStatus.PAUSED})
