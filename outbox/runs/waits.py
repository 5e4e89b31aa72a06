"""Waiting is not working (G8): timers, signals and awaited effects as recorded steps.

A wait is a step. The first time a run meets it, the step is recorded as
``waiting`` with its deadline in database time, so every replay sees the same
deadline. Each check runs in one short transaction that first locks the run
row (signals and cancellation lock it too, so a signal can never slip between
the check and the suspension), then either completes the step (the time came,
the signal arrived, the effect finished, or the deadline passed: then the
timeout is recorded and raised on every replay), or reports what is still
missing. A worker then parks the run as ``waiting`` in the same transaction:
no process, connection, lock or lease is held until a timer, a signal or the
effect wakes it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from sqlalchemy import Connection

from outbox.errors import EffectFailed, EffectTimeout, OutboxError, SignalTimeout, WaitTimeout
from outbox.models import StepRecord
from outbox.storage.sql import runs as run_sql

__all__ = ["EFFECT_RECHECK_SECONDS", "Pending", "WaitSpec", "check_wait", "recorded_error"]

# Parked on an effect, a run is woken by the effect's completion. Completions
# that do not go through a deliverer (an operator's resolve, the reconciler
# giving up) do not wake it, so a slow timer re-checks as well.
EFFECT_RECHECK_SECONDS = 30.0


@dataclass(frozen=True)
class WaitSpec:
    """What a wait step waits for."""

    kind: str  # sleep | signal | effect
    seconds: float | None = None
    until: datetime | None = None
    signal: str | None = None
    effect_id: UUID | None = None

    def detail_json(self) -> str:
        """What the waiting step records besides its deadline."""
        return json.dumps(
            {
                "wait": self.kind,
                "signal": self.signal,
                "effect": None if self.effect_id is None else str(self.effect_id),
            }
        )


@dataclass(frozen=True)
class Pending:
    """The wait is not over: seconds until its deadline (None: none)."""

    seconds_left: float | None


def recorded_error(step_id: str, error: Any) -> OutboxError:
    """Rebuild the exception a completed wait step recorded (raised on every replay)."""
    kind = error.get("type") if isinstance(error, dict) else None
    if kind == "SignalTimeout":
        return SignalTimeout(step_id, error["signal"])
    if kind == "EffectTimeout":
        return EffectTimeout(step_id, error["effect"])
    if kind == "EffectFailed":
        return EffectFailed(error["effect"], error["status"], error.get("reason"))
    return WaitTimeout(f"step_id={step_id!r}: {error!r}")


def _complete(
    conn: Connection,
    run_id: UUID,
    step_id: str,
    kind: str,
    *,
    result: Any = None,
    error: Any = None,
) -> StepRecord:
    row = conn.execute(
        run_sql.complete_wait_step(),
        {
            "w_run": run_id,
            "w_step": step_id,
            "wait_result": None if result is None else json.dumps(result),
            "wait_error": None if error is None else json.dumps(error),
        },
    ).one()
    return StepRecord(
        run_id=run_id,
        step_id=step_id,
        seq=row.seq,
        kind=kind,
        result=result,
        error=error,
        completed_at=row.completed_at,
    )


def check_wait(
    conn: Connection, run_id: UUID, step_id: str, spec: WaitSpec, *, park: bool
) -> StepRecord | Pending:
    """Record the wait if new, then complete it or report it pending (the run row is locked).

    With ``park``, a pending wait also parks the run as ``waiting`` (the caller
    is a worker that holds the run's lease, checked before this call).
    """
    conn.execute(
        run_sql.insert_wait_step(),
        {
            "w_run": run_id,
            "w_step": step_id,
            "kind": spec.kind,
            "seconds": spec.seconds,
            "until": None if spec.until is None else spec.until.isoformat(),
            "detail": spec.detail_json(),
        },
    )
    step = conn.execute(run_sql.wait_step(), {"w_run": run_id, "w_step": step_id}).one()
    if step.status == "completed":  # recorded meanwhile by another handle of this run
        return StepRecord(
            run_id=run_id,
            step_id=step_id,
            seq=step.seq,
            kind=spec.kind,
            result=step.result,
            error=step.error,
            completed_at=step.completed_at,
        )
    if spec.kind == "sleep":
        if step.due:
            return _complete(conn, run_id, step_id, spec.kind)
    elif spec.kind == "signal":
        payload = conn.execute(
            run_sql.consume_signal(), {"w_run": run_id, "w_step": step_id, "s_name": spec.signal}
        ).first()
        if payload is not None:
            return _complete(conn, run_id, step_id, spec.kind, result=payload[0])
        if step.due:
            return _complete(
                conn,
                run_id,
                step_id,
                spec.kind,
                error={"type": "SignalTimeout", "signal": spec.signal},
            )
    elif spec.kind == "effect":
        effect = conn.execute(
            run_sql.await_effect(), {"awaited_effect": spec.effect_id, "awaiting_run": run_id}
        ).first()
        if effect is None:
            return _complete(
                conn,
                run_id,
                step_id,
                spec.kind,
                error={
                    "type": "EffectFailed",
                    "effect": str(spec.effect_id),
                    "status": "missing",
                    "reason": "no such effect",
                },
            )
        if effect.status == "succeeded":
            return _complete(conn, run_id, step_id, spec.kind, result=effect.result)
        if effect.status in ("failed", "cancelled", "compensated"):
            return _complete(
                conn,
                run_id,
                step_id,
                spec.kind,
                error={
                    "type": "EffectFailed",
                    "effect": str(spec.effect_id),
                    "status": effect.status,
                    "reason": effect.last_error,
                },
            )
        if step.due:
            return _complete(
                conn,
                run_id,
                step_id,
                spec.kind,
                error={"type": "EffectTimeout", "effect": str(spec.effect_id)},
            )
    seconds_left = None if step.seconds_left is None else max(0.0, float(step.seconds_left))
    if park:
        wake_in = seconds_left
        if spec.kind == "effect":
            wake_in = min(seconds_left or EFFECT_RECHECK_SECONDS, EFFECT_RECHECK_SECONDS)
        conn.execute(
            run_sql.suspend_run(),
            {
                "run_id": run_id,
                "wake_in": wake_in,
                "signal_name": spec.signal,
                "effect_id": spec.effect_id,
            },
        )
    return Pending(seconds_left)
