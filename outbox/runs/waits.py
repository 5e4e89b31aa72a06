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

import asyncio
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from outbox.errors import (
    EffectFailed,
    EffectRejected,
    EffectTimeout,
    OutboxError,
    SignalTimeout,
    WaitTimeout,
)
from outbox.models import EffectStatus, StepRecord, StepStatus
from outbox.storage.notify import wait_for_notify, wait_for_notify_async
from outbox.storage.run_tx import RunTx
from outbox.storage.sql.common import SIGNALS_CHANNEL

__all__ = [
    "EFFECT_RECHECK_SECONDS",
    "Pending",
    "WaitSpec",
    "block_until",
    "check_wait",
    "recorded_error",
    "wait_until",
]

# Parked on an effect, a run is woken by the effect's completion. Completions
# that do not go through a deliverer (an operator's resolve, the reconciler
# giving up) do not wake it, so a slow timer re-checks as well.
EFFECT_RECHECK_SECONDS = 30.0
#: A plain script blocked in a wait re-checks at least this often.
BLOCKING_RECHECK_SECONDS = 5.0
#: Outside a worker, an awaited effect is polled this often.
EFFECT_POLL_SECONDS = 0.2

_ENDED_BADLY = (
    EffectStatus.FAILED,
    EffectStatus.CANCELLED,
    EffectStatus.COMPENSATED,
    EffectStatus.REJECTED,
)


@dataclass(frozen=True)
class WaitSpec:
    """What a wait step waits for."""

    kind: str  # sleep | signal | effect
    seconds: float | None = None
    until: datetime | None = None
    signal: str | None = None
    effect_id: UUID | None = None

    def detail(self) -> dict[str, Any]:
        """What the waiting step records besides its deadline."""
        return {
            "wait": self.kind,
            "signal": self.signal,
            "effect": None if self.effect_id is None else str(self.effect_id),
        }


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
        if error.get("status") == EffectStatus.REJECTED:
            return EffectRejected(error["effect"], error.get("reason"))
        return EffectFailed(error["effect"], error["status"], error.get("reason"))
    return WaitTimeout(f"step_id={step_id!r}: {error!r}")


def _complete(
    tx: RunTx, run_id: UUID, step_id: str, kind: str, *, result: Any = None, error: Any = None
) -> StepRecord:
    seq, completed_at = tx.complete_wait(run_id, step_id, result=result, error=error)
    return StepRecord(
        run_id=run_id,
        step_id=step_id,
        seq=seq,
        kind=kind,
        result=result,
        error=error,
        completed_at=completed_at,
    )


def _effect_failed(effect_id: UUID | None, status: str, reason: str | None) -> dict[str, Any]:
    return {"type": "EffectFailed", "effect": str(effect_id), "status": status, "reason": reason}


def check_wait(
    tx: RunTx, run_id: UUID, step_id: str, spec: WaitSpec, *, park: bool
) -> StepRecord | Pending:
    """Record the wait if new, then complete it or report it pending (the run row is locked).

    With ``park``, a pending wait also parks the run as ``waiting`` (the caller
    is a worker that holds the run's lease, checked before this call).
    """
    step = tx.record_wait(
        run_id,
        step_id,
        kind=spec.kind,
        seconds=spec.seconds,
        until=spec.until,
        detail=spec.detail(),
    )
    if step.status == StepStatus.COMPLETED:  # recorded meanwhile by another handle of this run
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
            return _complete(tx, run_id, step_id, spec.kind)
    elif spec.kind == "signal":
        assert spec.signal is not None
        # the signal is consumed and the step completed with its payload in one call
        # (outbox_take_signal): no signal is ever marked consumed without a run getting it
        taken = tx.take_signal(run_id, step_id, spec.signal)
        if taken is not None:
            return StepRecord(
                run_id=run_id,
                step_id=step_id,
                seq=taken.seq,
                kind=spec.kind,
                # the step records the payload as stored (a large one by reference)
                result=tx.resolved(taken.payload),
                error=None,
                completed_at=taken.completed_at,
            )
        if step.due:
            error = {"type": "SignalTimeout", "signal": spec.signal}
            return _complete(tx, run_id, step_id, spec.kind, error=error)
    elif spec.kind == "effect":
        assert spec.effect_id is not None
        effect = tx.await_effect(run_id, spec.effect_id)
        if effect is None:
            error = _effect_failed(spec.effect_id, "missing", "no such effect")
            return _complete(tx, run_id, step_id, spec.kind, error=error)
        if effect.status == EffectStatus.SUCCEEDED:
            return _complete(tx, run_id, step_id, spec.kind, result=effect.result)
        if effect.status in _ENDED_BADLY:
            error = _effect_failed(spec.effect_id, effect.status, effect.last_error)
            return _complete(tx, run_id, step_id, spec.kind, error=error)
        if step.due:
            error = {"type": "EffectTimeout", "effect": str(spec.effect_id)}
            return _complete(tx, run_id, step_id, spec.kind, error=error)
    if park:
        wake_in = step.seconds_left
        if spec.kind == "effect":
            wake_in = min(step.seconds_left or EFFECT_RECHECK_SECONDS, EFFECT_RECHECK_SECONDS)
        tx.suspend(run_id, wake_in=wake_in, signal=spec.signal, effect_id=spec.effect_id)
    return Pending(step.seconds_left)


def _horizon(seconds_left: float | None) -> float:
    horizon = BLOCKING_RECHECK_SECONDS
    if seconds_left is not None:
        horizon = min(max(seconds_left, 0.0), horizon)
    return horizon


def block_until(dsn: str, spec: WaitSpec, seconds_left: float | None, run_id: UUID) -> None:
    """Outside a worker a wait blocks: sleep, LISTEN for this run's signals, or poll an effect."""
    horizon = _horizon(seconds_left)
    if spec.kind == "signal":
        wait_for_notify(dsn, SIGNALS_CHANNEL, horizon, payload=str(run_id))
    elif spec.kind == "effect":
        time.sleep(min(horizon, EFFECT_POLL_SECONDS))
    else:
        time.sleep(horizon)


async def wait_until(dsn: str, spec: WaitSpec, seconds_left: float | None, run_id: UUID) -> None:
    """Async twin of :func:`block_until`: the event loop keeps running other runs meanwhile."""
    horizon = _horizon(seconds_left)
    if spec.kind == "signal":
        await wait_for_notify_async(dsn, SIGNALS_CHANNEL, horizon, payload=str(run_id))
    elif spec.kind == "effect":
        await asyncio.sleep(min(horizon, EFFECT_POLL_SECONDS))
    else:
        await asyncio.sleep(horizon)
