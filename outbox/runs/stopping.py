"""How a run stops: cancellation, then compensation in reverse order.

Every function takes a :class:`~outbox.storage.run_tx.RunTx` inside a
transaction and locks the run row before it changes anything, so signals, waits
and cancellation of one run never interleave. Before the run row it locks the
run's effects that have not started (``RunTx.lock_with_effects``): a completion
holds its effect while it wakes the run, so the two take those rows in one
order. Sync callers use ``Store.run_tx()``; the async daemon passes the same
functions to ``AsyncStore.run_sync``.

Stopping: ``cancel`` marks the run ``cancelling`` and cancels its effects that
have not started, each with an attempt-log row saying who and why (as an
operator's resolve or retry writes one); in-flight ones finish. One that is
pending again because an earlier attempt was lost (its lease ran out with no
answer, and the reconciler put it back for redelivery) may have happened: it
becomes ``unknown`` instead. Once none is in flight (and none is
``unknown``: an operator must say whether it happened), every succeeded effect
that declared ``compensate=(kind, payload)`` gets its compensating effect
intended, newest first, one at a time (a shared ordering key), with a key
derived from the original's. The run ends ``compensated`` when they all
succeed, ``compensation_failed`` when one fails, ``cancelled`` when there was
nothing to undo.
"""

from __future__ import annotations

import getpass
import logging
import uuid
from typing import Any

from outbox.errors import RunTerminal
from outbox.models import (
    LIVE_RUN_STATUSES,
    NOT_STARTED_EFFECT_STATUSES,
    STOPPING_RUN_STATUSES,
    TERMINAL_EFFECT_STATUSES,
    EffectStatus,
    RunStatus,
)
from outbox.storage.run_tx import RunTx
from outbox.storage.sql.stopping import StoppingMark
from outbox.validation import name_field

__all__ = [
    "STOPPING_WORKER",
    "StoppingSweep",
    "advance_stopping_run",
    "cancel_run",
    "canceller",
]

log = logging.getLogger(__name__)

#: Who the attempt log names for an effect a stopping run's sweep cancels.
STOPPING_WORKER = "run-stopping"
# The sweep does not know who cancelled the run (the cancel's own rows do).
_LATE_NOTE = "run cancelled: it was pending again after the cancel (a retry, say)"


def canceller(by: str | None, via: str) -> tuple[str, str]:
    """Who cancels and through what (``api``, ``cli``, ``console``), validated.

    ``by`` defaults to the user this process runs as, as the operator CLI
    commands' ``--by`` does.
    """
    if by is None:
        try:
            by = getpass.getuser()
        except (OSError, KeyError):  # no login name nor passwd entry (a bare container)
            by = "unknown user"
    return name_field(by, "by"), name_field(via, "via")


def cancel_run(tx: RunTx, run_id: uuid.UUID, reason: str, *, by: str, via: str) -> RunStatus:
    """Mark the run ``cancelling`` and cancel its effects that have not started.

    Each effect cancelled gets an attempt-log row (outcome ``cancelled``) with
    ``by`` as who and ``{"note": reason, "by": by, "via": via}`` as detail.
    """
    status = tx.lock_with_effects(run_id).status
    if status in STOPPING_RUN_STATUSES:
        return status  # already stopping: cancelling twice changes nothing
    if status not in LIVE_RUN_STATUSES:
        raise RunTerminal(run_id, status.value)
    tx.mark(run_id, RunStatus.CANCELLING, reason)
    cancelled, unknown = tx.cancel_pending_effects(
        run_id,
        f"run cancelled: {reason}",
        by=by,
        detail={"note": reason, "by": by, "via": via},
    )
    log.info(
        "run %s cancelling by %s via %s (%d pending effects cancelled, %d in doubt left "
        "unknown for an operator): %s",
        run_id,
        by,
        via,
        cancelled,
        unknown,
        reason,
        extra={"run_id": str(run_id)},
    )
    return RunStatus.CANCELLING


def advance_stopping_run(tx: RunTx, run_id: uuid.UUID) -> RunStatus:
    """Move a cancelling or compensating run on as far as its effects allow."""
    status = tx.lock_with_effects(run_id).status
    if status not in STOPPING_RUN_STATUSES:
        return status
    rows = tx.effects_for_stopping(run_id)
    originals = [r for r in rows if r.compensates is None]
    compensations = [r for r in rows if r.compensates is not None]

    def finish(new_status: RunStatus) -> RunStatus:
        tx.mark(run_id, new_status)
        log.info("run %s %s", run_id, new_status.value, extra={"run_id": str(run_id)})
        return new_status

    if status == RunStatus.CANCELLING:
        # An attempt that was in flight at the cancel and asked for a retry is
        # pending again, and a relay may have handed one to Kafka meanwhile: neither
        # will be delivered now.
        if any(r.status in NOT_STARTED_EFFECT_STATUSES for r in originals):
            originals = _stop_late(tx, run_id)
        # in-flight calls finish first; unknown ones wait for an operator; one that an
        # answer made pending since the cancel above (held by the trigger, which
        # waited for the cancel's commit) is the next pass's to cancel
        waiting = (EffectStatus.IN_FLIGHT, EffectStatus.UNKNOWN, *NOT_STARTED_EFFECT_STATUSES)
        if any(r.status in waiting for r in originals):
            return status
        to_undo = [
            r
            for r in reversed(originals)
            if r.status == EffectStatus.SUCCEEDED and r.compensate is not None
        ]
        if not to_undo:
            return finish(RunStatus.CANCELLED)
        _intend_compensations(tx, run_id, to_undo)
        tx.mark(run_id, RunStatus.COMPENSATING)
        return RunStatus.COMPENSATING

    if any(r.status in NOT_STARTED_EFFECT_STATUSES for r in originals):
        # An original pending again since the run moved on (a put-back that raced the
        # cancelling pass, before it waited for such ones): cancelled, or unknown.
        originals = _stop_late(tx, run_id)
    if any(r.status not in TERMINAL_EFFECT_STATUSES for r in originals):
        return status  # an unknown one waits for an operator, as when cancelling
    undone = {r.compensates for r in compensations}
    late = [
        r
        for r in reversed(originals)
        if r.status == EffectStatus.SUCCEEDED and r.compensate is not None and r.id not in undone
    ]
    if late:  # resolved as done since the compensations were intended: undone too
        _intend_compensations(tx, run_id, late)
        return status
    if any(r.status not in TERMINAL_EFFECT_STATUSES for r in compensations):
        return status
    if all(r.status == EffectStatus.SUCCEEDED for r in compensations):
        tx.mark_compensated(run_id, [r.compensates for r in compensations])
        return finish(RunStatus.COMPENSATED)
    return finish(RunStatus.COMPENSATION_FAILED)


def _stop_late(tx: RunTx, run_id: uuid.UUID) -> list[Any]:
    """Stop originals not started since the cancel; the run's originals as they are now."""
    tx.cancel_pending_effects(
        run_id,
        "run cancelled",
        by=STOPPING_WORKER,
        detail={"note": _LATE_NOTE, "by": STOPPING_WORKER, "via": "stopping"},
    )
    return [r for r in tx.effects_for_stopping(run_id) if r.compensates is None]


def _intend_compensations(tx: RunTx, run_id: uuid.UUID, to_undo: list[Any]) -> None:
    new = tx.intend_compensations(run_id, [original.id for original in to_undo])
    log.info(
        "run %s: %d compensating effects intended",
        run_id,
        new,
        extra={"run_id": str(run_id)},
    )


class StoppingSweep:
    """Moves stopping runs on a page of ``max_rows`` at a time, each pass after the last.

    Pages go by shard, then oldest change, then id. A run that cannot move on
    (an effect still in flight, or ``unknown`` until an operator says) keeps its
    last change, so a first page of them would be every pass, and a run behind
    them would never end: each pass goes on after the last run of the one
    before, and a page that is not full starts the round again. A daemon keeps
    one; concurrent passes may visit a run twice, never skip one for good.
    """

    def __init__(self, max_rows: int = 100) -> None:
        self.max_rows = max_rows
        self._after: StoppingMark | None = None

    def __call__(self, tx: RunTx) -> dict[str, int]:
        """One pass; returns how many runs it left in each state."""
        page = tx.stopping_runs(self.max_rows, self._after)
        self._after = page[-1] if len(page) >= self.max_rows else None
        moved: dict[str, int] = {}
        for run in page:
            nested = tx.savepoint()
            try:
                status = advance_stopping_run(tx, run.id)
                nested.commit()
            except Exception:
                nested.rollback()
                log.exception("advancing stopping run %s failed", run.id)
                continue
            moved[status.value] = moved.get(status.value, 0) + 1
        return moved
