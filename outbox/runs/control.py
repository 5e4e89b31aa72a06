"""Run control: pause and resume one run, fork a run from a step.

Every function takes a :class:`~outbox.storage.run_tx.RunTx` inside one
transaction and locks the run row before it changes anything, as waits, signals
and cancellation do, so none of them interleave (pause and resume, which change
the run's unstarted effects, lock those first, as a cancel does). Both clients
call these (the sync one through ``Store.run_tx()``, the async one through
``AsyncRunStore.run_tx``).

**Pause.** A paused run is not claimed by workers and its effects that no
deliverer has started are not claimed by deliverers (they are ``paused``).
Work in flight finishes and is recorded: a worker's step in progress commits,
then the worker parks the run; an effect in flight gets its outcome recorded
(a retry it asks for is held as ``paused`` too). A waiting run keeps its
deadline: the timer does not fire while paused, and at resume the run
re-checks its wait, so a deadline that passed meanwhile is acted on then (the
sleep is over, the wait's timeout is recorded) and a signal sent meanwhile is
consumed then.

**Fork.** ``fork_run`` makes a new run of the same agent (optionally another
version) and inputs whose recorded steps are the original's steps before the
chosen one, results as recorded: its handler replays them without calling
their functions and runs the chosen step and those after it for real. The
intents of the replayed steps belong to the original (their keys were derived
from its id, so nothing they did is done again); the fork's new steps derive
new keys from the fork's id. The original is not changed.
"""

from __future__ import annotations

import logging
import uuid

from outbox.errors import ForkRefused, RunStateError, RunTerminal, ValidationError
from outbox.models import STOPPING_RUN_STATUSES, TERMINAL_RUN_STATUSES, RunStatus
from outbox.storage.run_tx import RunTx

__all__ = ["fork_run", "pause_run", "resume_run"]

log = logging.getLogger(__name__)


def pause_run(tx: RunTx, run_id: uuid.UUID, reason: str) -> RunStatus:
    """Pause a live run; returns ``paused``, or ``running`` while its worker finishes a step."""
    locked = tx.lock_with_effects(run_id)
    if locked.status in TERMINAL_RUN_STATUSES:
        raise RunTerminal(run_id, locked.status.value)
    if locked.status in STOPPING_RUN_STATUSES:
        raise RunStateError(
            f"run_id={str(run_id)!r} is {locked.status.value}: a stopping run is not paused"
        )
    status = tx.pause(
        run_id, reason, park=locked.status != RunStatus.RUNNING, first=not locked.paused
    )
    held = tx.hold_effects(run_id)
    log.info(
        "run %s paused (%s; %d effects held): %s",
        run_id,
        status.value,
        held,
        reason,
        extra={"run_id": str(run_id)},
    )
    return status


def resume_run(tx: RunTx, run_id: uuid.UUID) -> RunStatus:
    """Lift a run's pause: it is runnable again and its held effects pending; returns its status.

    A run that is not paused is left as it is (resuming twice changes nothing).
    """
    locked = tx.lock_with_effects(run_id)
    if locked.status in TERMINAL_RUN_STATUSES:
        raise RunTerminal(run_id, locked.status.value)
    if not locked.paused and locked.status != RunStatus.PAUSED:
        return locked.status
    status = tx.resume(run_id, parked=locked.status == RunStatus.PAUSED)
    released = tx.release_effects(run_id)
    log.info(
        "run %s resumed (%s; %d effects released)",
        run_id,
        status.value,
        released,
        extra={"run_id": str(run_id)},
    )
    return status


def fork_run(
    tx: RunTx,
    original: uuid.UUID,
    from_step: str,
    *,
    fork_id: uuid.UUID,
    version: str | None = None,
    allow_unsettled: bool = False,
) -> uuid.UUID:
    """Write a fork of ``original`` restarting at ``from_step``; returns the fork's id.

    ``from_step`` is a completed step of the original, or the step a failed
    original failed at (then every completed step is replayed). An effect of
    ``from_step`` or a later step that may already have taken effect
    (``unknown``, ``in_flight``, ``dispatched``, or pending again after a lost
    attempt) refuses the fork with
    :class:`ForkRefused`, unless ``allow_unsettled``.
    """
    locked = tx.lock(original)
    done = tx.completed_steps(original)
    cut = next((seq for step_id, seq in done if step_id == from_step), None)
    failed_at = locked.error.get("step") if isinstance(locked.error, dict) else None
    if cut is None and from_step != failed_at:
        known = [step_id for step_id, _ in done][-5:]
        raise ValidationError(
            "from_step",
            from_step,
            f"is not a completed step of run {original} (its last steps: {known})"
            + ("" if failed_at is None else f", nor the step it failed at ({failed_at!r})"),
        )
    if not allow_unsettled:
        unsettled = tx.unsettled_effects(original, cut=cut, from_step=from_step)
        if unsettled:
            raise ForkRefused(original, from_step, unsettled)
    tx.fork(original, fork_id, cut=cut, from_step=from_step, version=version)
    log.info(
        "run %s forked from %s at step %s",
        fork_id,
        original,
        from_step,
        extra={"run_id": str(fork_id), "forked_from": str(original)},
    )
    return fork_id
