"""A handle on one run: replay of recorded steps, atomic steps, waits, and its end."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, TypeVar

from outbox.errors import (
    BudgetExceeded,
    IdempotencyConflict,
    LeaseLost,
    OutboxError,
    RunNotFound,
    RunTerminal,
    ValidationError,
)
from outbox.faults import crash_point
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
from outbox.payloads import decode, encode
from outbox.runs.context import RunContext
from outbox.runs.intents import StepTransaction
from outbox.runs.waits import WaitSpec, block_until, check_wait, recorded_error
from outbox.storage import Connection
from outbox.storage.run_tx import RunTx
from outbox.tracing import step_span
from outbox.validation import as_uuid

__all__ = ["Run", "Suspended"]

T = TypeVar("T")


class _AlreadyRecorded(Exception):
    """Internal: the step was recorded by someone else; roll ours back and replay."""


class Suspended(BaseException):
    """Raised out of a worker's handler when its run was parked as ``waiting``.

    A ``BaseException`` so that a handler's ``except Exception`` cannot swallow
    it. The worker catches it; the run resumes when its wait is over.
    """

    def __init__(self, run_id: uuid.UUID, step_id: str) -> None:
        super().__init__(f"run {run_id} waits at step {step_id!r}")
        self.run_id = run_id
        self.step_id = step_id


def _seconds(value: timedelta | float | None, field: str) -> float | None:
    if value is None:
        return None
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if seconds != seconds or seconds < 0:
        raise ValidationError(field, value, "must be a non-negative duration")
    return seconds


class Run:
    """A handle on one run: its recorded steps, state and plan, and the calls that advance it."""

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

    def effects(self) -> list[Effect]:
        """Every effect this run intended, in intent order, with its delivery state."""
        return self._ctx.store.list_effects(run_id=self.id, limit=1_000_000)

    def refresh(self) -> Run:
        """Re-read the run and its steps from the store."""
        loaded = self._ctx.store.load_run(self.id)
        if loaded is None:
            raise RunNotFound(self.id)
        self._record, steps = loaded
        self._steps = {s.step_id: s for s in steps}
        return self

    def __repr__(self) -> str:
        return (
            f"<Run {self.id} {self.agent}@{self.version} {self.status.value}"
            f" steps={len(self._steps)}>"
        )

    # -- advancing it -----------------------------------------------------------

    def call(self, step_id: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Any:
        """Call ``fn`` once for this run and record its JSON result under ``step_id``.

        ``fn`` runs outside any transaction (it may take minutes). On replay the
        recorded result is returned and ``fn`` is not called. If two processes
        race, the first recorded result wins and both return it. If ``fn``
        raises, nothing is recorded.
        """
        step_id = self._check_step_id(step_id)
        if step_id in self._steps:
            return self._replay(self._steps[step_id])
        self._check_live()
        self.active_step = step_id
        with self._span(step_id, "call"):
            result_json = encode(
                fn(*args, **kwargs), field="result", max_bytes=self._ctx.settings.max_payload_bytes
            )
            return self._commit(step_id, "call", result_json, None, None)

    def transaction(
        self,
        step_id: str,
        fn: Callable[[StepTransaction], Any],
        *,
        connection: Connection | None = None,
    ) -> Any:
        """Run ``fn`` in one transaction and commit its checkpoint, intents and rows together.

        If ``fn`` raises, nothing of the step is written (G1). If the step was
        already recorded, its result is returned and ``fn`` does not run (G5).
        With ``connection``, the step joins the caller's open transaction.
        """
        step_id = self._check_step_id(step_id)
        if step_id in self._steps:
            return self._replay(self._steps[step_id])
        self._check_live()
        self.active_step = step_id
        with self._span(step_id, "transaction"):
            return self._commit(step_id, "transaction", None, fn, connection)

    def complete(self, result: Any = None) -> None:
        """End the run as ``completed`` with an optional JSON result."""
        self._finish(RunStatus.COMPLETED, result=result)

    def fail(self, error: Any) -> None:
        """End the run as ``failed`` with a JSON-able description of why."""
        self._finish(RunStatus.FAILED, error=error)

    # -- waiting (G8) -------------------------------------------------------------

    def sleep(self, step_id: str, duration: timedelta | float) -> None:
        """Wait ``duration`` (a timedelta or seconds) from the first time this step is met.

        In a worker the run is parked (no process, connection or lease held)
        and resumed by its timer; in a plain script this call blocks.
        """
        self._wait(step_id, WaitSpec("sleep", seconds=_seconds(duration, "duration")))

    def sleep_until(self, step_id: str, when: datetime) -> None:
        """Wait until ``when`` (timezone-aware)."""
        if not isinstance(when, datetime) or when.tzinfo is None:
            raise ValidationError("when", when, "must be a timezone-aware datetime")
        self._wait(step_id, WaitSpec("sleep", until=when))

    def wait_signal(
        self, step_id: str, *, name: str, timeout: timedelta | float | None = None
    ) -> Any:
        """Wait for signal ``name`` (``Outbox.signal``) and return its payload.

        A signal sent before the run reaches this step is kept and consumed
        here. If ``timeout`` passes first, :class:`~outbox.SignalTimeout` is
        recorded at this step and raised now and on every replay.
        """
        if not isinstance(name, str) or not name.strip() or len(name) > 200:
            raise ValidationError("name", name, "must be a non-empty string of at most 200")
        spec = WaitSpec("signal", seconds=_seconds(timeout, "timeout"), signal=name)
        return self._wait(step_id, spec)

    def await_effect(
        self,
        effect: Effect | uuid.UUID | str,
        *,
        timeout: timedelta | float | None = None,
        step_id: str | None = None,
    ) -> Any:
        """Wait until ``effect`` succeeded and return its result.

        Raises :class:`~outbox.EffectFailed` if it failed or was cancelled, and
        :class:`~outbox.EffectTimeout` if ``timeout`` passes first (both
        recorded, so replays raise them too). The step id defaults to
        ``await:<effect id>``.
        """
        effect_id = effect.id if isinstance(effect, Effect) else as_uuid(effect, "effect")
        spec = WaitSpec("effect", seconds=_seconds(timeout, "timeout"), effect_id=effect_id)
        return self._wait(step_id or f"await:{effect_id}", spec)

    def _span(self, step_id: str, kind: str) -> Any:
        """The step's span, in the run's trace (see :mod:`outbox.tracing`)."""
        return step_span(
            traceparent=self._record.trace_parent, run_id=str(self.id), step_id=step_id, kind=kind
        )

    def _wait(self, step_id: str, spec: WaitSpec) -> Any:
        step_id = self._check_step_id(step_id)
        recorded = self._steps.get(step_id)
        if recorded is not None and recorded.status == StepStatus.COMPLETED:
            return self._replay(recorded)
        self._check_live()
        self.active_step = step_id
        with self._span(step_id, f"wait.{spec.kind}"):
            return self._wait_loop(step_id, spec)

    def _wait_loop(self, step_id: str, spec: WaitSpec) -> Any:
        store = self._ctx.store
        while True:
            with store.run_tx() as tx:
                self._lock_for_write(tx)
                outcome = check_wait(tx, self.id, step_id, spec, park=self._lease is not None)
            if isinstance(outcome, StepRecord):
                self._steps[step_id] = outcome
                self._record = self._record.model_copy(update={"current_step": step_id})
                self.active_step = None
                return self._replay(outcome)
            if self._lease is not None:
                self._record = self._record.model_copy(update={"status": RunStatus.WAITING})
                raise Suspended(self.id, step_id)
            block_until(self._ctx.dsn, spec, outcome.seconds_left, self.id)

    def _lock_for_write(self, tx: RunTx) -> None:
        """Lock the run row and check that this handle may still write to it."""
        locked = tx.lock(self.id)
        if locked.status not in LIVE_RUN_STATUSES:
            self._record = self._record.model_copy(update={"status": locked.status})
            raise RunTerminal(self.id, locked.status.value)
        if self._lease is not None and (
            locked.status != RunStatus.RUNNING or locked.lease != self._lease
        ):
            raise LeaseLost(
                f"run_id={str(self.id)!r}: lease attempt {self._lease.attempt} was lost"
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
        return step_id

    def _check_live(self) -> None:
        if self.status in TERMINAL_RUN_STATUSES:
            raise RunTerminal(self.id, self.status.value)

    def _replay(self, step: StepRecord) -> Any:
        if step.error is not None:
            raise recorded_error(step.step_id, step.error)
        return step.result

    def _commit(
        self,
        step_id: str,
        kind: str,
        result_json: str | None,
        fn: Callable[[StepTransaction], Any] | None,
        connection: Connection | None,
    ) -> Any:
        store = self._ctx.store
        wakeup = self._ctx.effects_wakeup
        notified: float | None = None
        try:
            with store.begin(connection) as conn:
                tx = StepTransaction(self, conn, step_id)
                if fn is not None:
                    result_json = encode(
                        fn(tx), field="result", max_bytes=self._ctx.settings.max_payload_bytes
                    )
                has_intents = tx._intents.pending > 0
                notified = wakeup.inline() if has_intents else None
                outcome = store.commit_step(
                    conn,
                    {
                        "run_id": self.id,
                        "step_id": step_id,
                        "kind": kind,
                        "step_result": result_json,
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
                )
                crash_point("before_step_commit")
                if not outcome.run_ok:
                    raise self._refusal(conn, tx._debit + tx._reserve)
                if outcome.step_seq is None:
                    raise _AlreadyRecorded
                if outcome.inserted != tx._intents.pending:
                    raise IdempotencyConflict(
                        tx._intents.taken_key(), "intended concurrently by another transaction"
                    )
        except _AlreadyRecorded:
            # Another process recorded this step first; ours was rolled back whole.
            recorded = store.step_record(self.id, step_id)
            assert recorded is not None
            self._steps[step_id] = recorded
            return self._replay(recorded)
        if has_intents and connection is None:
            wakeup.committed(notified)
        self._record = self._record.model_copy(
            update={
                "current_step": step_id,
                **({"state": decode(tx._state_json)} if tx._state_json is not None else {}),
                **({"plan": decode(tx._plan_json)} if tx._plan_json is not None else {}),
            }
        )
        result = decode(result_json)
        self._steps[step_id] = StepRecord(
            run_id=self.id,
            step_id=step_id,
            seq=outcome.step_seq or 0,
            kind=kind,
            result=result,
            completed_at=datetime.now(UTC),
        )
        self.active_step = None
        crash_point("after_step")
        return result

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

    def _finish(self, status: RunStatus, *, result: Any = None, error: Any = None) -> None:
        limit = self._ctx.settings.max_payload_bytes
        result_json = None if result is None else encode(result, field="result", max_bytes=limit)
        error_json = None if error is None else encode(error, field="error", max_bytes=limit)
        done = self._ctx.store.finish_run(
            self.id, status=status.value, result=result_json, error=error_json, fence=self._lease
        )
        if not done:
            self.refresh()
            if self._lease is not None and self.status not in TERMINAL_RUN_STATUSES:
                raise LeaseLost(f"run_id={str(self.id)!r}: lease was taken over")
            raise RunTerminal(self.id, self.status.value)
        self._record = self._record.model_copy(
            update={"status": status, "result": decode(result_json), "error": decode(error_json)}
        )
