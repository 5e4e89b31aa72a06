"""Signals, and how a run stops: cancellation, then compensation in reverse order.

Every function takes a SQLAlchemy ``Connection`` inside a transaction and
locks the run row first, so signals, waits and cancellation of one run never
interleave. Sync callers pass ``engine.begin()``; the async daemon passes the
same functions to ``AsyncConnection.run_sync``.

Stopping: ``cancel`` marks the run ``cancelling`` and cancels its effects that
have not started; in-flight ones finish. Once none is in flight (and none is
``unknown``: an operator must say whether it happened), every succeeded effect
that declared ``compensate=(kind, payload)`` gets its compensating effect
intended, newest first, one at a time (a shared ordering key), with a key
derived from the original's. The run ends ``compensated`` when they all
succeed, ``compensation_failed`` when one fails, ``cancelled`` when there was
nothing to undo.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, text

from outbox.errors import RunNotFound, RunTerminal
from outbox.ids import uuid7
from outbox.keys import compensation_key
from outbox.models import NOT_STARTED_EFFECT_STATUSES, TERMINAL_EFFECT_STATUSES, RunStatus
from outbox.payloads import content_hash, encode
from outbox.storage.sql import runs as run_sql
from outbox.storage.sql import steps as sql
from outbox.storage.store import effects_json

__all__ = [
    "SignalReceipt",
    "advance_stopping_run",
    "advance_stopping_runs",
    "cancel_run",
    "send_signal",
]

log = logging.getLogger(__name__)

_LIVE = (RunStatus.RUNNABLE, RunStatus.RUNNING, RunStatus.WAITING)


@dataclass(frozen=True)
class SignalReceipt:
    """What happened to a signal: stored (or a duplicate of one stored), and did it wake the run."""

    signal_id: uuid.UUID | None
    duplicate: bool
    woke_run: bool


def _locked_status(conn: Connection, run_id: uuid.UUID) -> RunStatus:
    row = conn.execute(run_sql.lock_run(), {"run_id": run_id}).first()
    if row is None:
        raise RunNotFound(run_id)
    return RunStatus(row.status)


def send_signal(
    conn: Connection, run_id: uuid.UUID, name: str, payload_json: str, dedup_key: str
) -> SignalReceipt:
    """Store a signal for a live run and wake it if it waits for this name."""
    status = _locked_status(conn, run_id)
    if status not in _LIVE:
        raise RunTerminal(run_id, status.value)
    signal_id = uuid7()
    inserted = conn.execute(
        run_sql.insert_signal(),
        {
            "signal_id": signal_id,
            "w_run": run_id,
            "s_name": name,
            "payload": payload_json,
            "dedup_key": dedup_key,
        },
    ).first()
    if inserted is None:
        return SignalReceipt(None, duplicate=True, woke_run=False)
    woke = conn.execute(run_sql.wake_signalled_run(), {"run_id": run_id, "name": name}).first()
    # Plain scripts blocked in wait_signal listen here.
    conn.execute(
        text("SELECT pg_notify(:channel, :run)"),
        {"channel": run_sql.SIGNALS_CHANNEL, "run": str(run_id)},
    )
    return SignalReceipt(signal_id, duplicate=False, woke_run=woke is not None)


def cancel_run(conn: Connection, run_id: uuid.UUID, reason: str) -> RunStatus:
    """Mark the run ``cancelling`` and cancel its effects that have not started."""
    status = _locked_status(conn, run_id)
    if status in (RunStatus.CANCELLING, RunStatus.COMPENSATING):
        return status  # already stopping: cancelling twice changes nothing
    if status not in _LIVE:
        raise RunTerminal(run_id, status.value)
    conn.execute(
        run_sql.mark_run(), {"run_id": run_id, "new_status": "cancelling", "reason": reason}
    )
    cancelled = conn.execute(
        run_sql.cancel_pending_effects(),
        {"stopping_run": run_id, "reason": f"run cancelled: {reason}"},
    ).all()
    log.info(
        "run %s cancelling (%d pending effects cancelled)",
        run_id,
        len(cancelled),
        extra={"run_id": str(run_id)},
    )
    return RunStatus.CANCELLING


def advance_stopping_run(conn: Connection, run_id: uuid.UUID) -> RunStatus:
    """Move a cancelling or compensating run on as far as its effects allow."""
    status = _locked_status(conn, run_id)
    if status not in (RunStatus.CANCELLING, RunStatus.COMPENSATING):
        return status
    rows = conn.execute(run_sql.run_effects_for_stopping(), {"stopping_run": run_id}).all()
    originals = [r for r in rows if r.compensates is None]
    compensations = [r for r in rows if r.compensates is not None]

    def finish(new_status: RunStatus) -> RunStatus:
        conn.execute(
            run_sql.mark_run(), {"run_id": run_id, "new_status": new_status.value, "reason": None}
        )
        log.info("run %s %s", run_id, new_status.value, extra={"run_id": str(run_id)})
        return new_status

    if status == RunStatus.CANCELLING:
        # An attempt that was in flight at the cancel and asked for a retry is
        # pending again, and a relay may have handed one to Kafka meanwhile: neither
        # will be delivered now.
        if any(r.status in NOT_STARTED_EFFECT_STATUSES for r in originals):
            conn.execute(
                run_sql.cancel_pending_effects(),
                {"stopping_run": run_id, "reason": "run cancelled"},
            )
            rows = conn.execute(run_sql.run_effects_for_stopping(), {"stopping_run": run_id}).all()
            originals = [r for r in rows if r.compensates is None]
        if any(r.status in ("in_flight", "unknown") for r in originals):
            return status  # in-flight calls finish first; unknown ones wait for an operator
        to_undo = [
            r for r in reversed(originals) if r.status == "succeeded" and r.compensate is not None
        ]
        if not to_undo:
            return finish(RunStatus.CANCELLED)
        _intend_compensations(conn, run_id, to_undo)
        conn.execute(
            run_sql.mark_run(), {"run_id": run_id, "new_status": "compensating", "reason": None}
        )
        return RunStatus.COMPENSATING

    if any(r.status not in TERMINAL_EFFECT_STATUSES for r in compensations):
        return status
    if all(r.status == "succeeded" for r in compensations):
        conn.execute(run_sql.mark_compensated(), {"ids": [r.compensates for r in compensations]})
        return finish(RunStatus.COMPENSATED)
    return finish(RunStatus.COMPENSATION_FAILED)


def _intend_compensations(conn: Connection, run_id: uuid.UUID, to_undo: list[Any]) -> None:
    intents = []
    for index, original in enumerate(to_undo):
        compensate = original.compensate
        payload_json = encode(compensate["payload"], field="compensate.payload")
        intents.append(
            {
                "id": str(uuid7()),
                "step_index": index,
                "kind": compensate["kind"],
                "payload": payload_json,
                "payload_hash": content_hash(payload_json),
                "schema_version": 1,
                "idempotency_key": compensation_key(original.idempotency_key),
                # one at a time, newest original first
                "ordering_key": f"compensate:{run_id}",
                "max_attempts": None,
                "compensate": None,
                "compensates": str(original.id),
                "cost": None,
                "delay_seconds": 0.0,
            }
        )
    conn.execute(
        sql.intend_for_stopping_run(),
        {"run_id": run_id, "step_id": "compensate", "effects": effects_json(intents)},
    )
    log.info(
        "run %s: %d compensating effects intended",
        run_id,
        len(intents),
        extra={"run_id": str(run_id)},
    )


def advance_stopping_runs(conn: Connection, max_rows: int = 100) -> dict[str, int]:
    """One sweep over stopping runs; returns how many ended in each state."""
    ids = [r.id for r in conn.execute(run_sql.stopping_runs(), {"max_rows": max_rows})]
    moved: dict[str, int] = {}
    for run_id in ids:
        nested = conn.begin_nested()
        try:
            status = advance_stopping_run(conn, run_id)
            nested.commit()
        except Exception:
            nested.rollback()
            log.exception("advancing stopping run %s failed", run_id)
            continue
        moved[status.value] = moved.get(status.value, 0) + 1
    return moved
