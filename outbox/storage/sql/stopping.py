"""SQL of stopping runs: a cancel's effects, the sweep that moves stopping runs on.

Pure builders, executed by :class:`~outbox.storage.run_tx.RunTx`, which holds
the run row's lock (taken after the run's unstarted effects:
:func:`~outbox.storage.sql.control.lock_unstarted_effects`).
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from functools import cache
from typing import Any, NamedTuple

from sqlalchemy import (
    ARRAY,
    DateTime,
    Integer,
    SmallInteger,
    Text,
    any_,
    bindparam,
    case,
    func,
    null,
    select,
    tuple_,
)
from sqlalchemy.dialects.postgresql import UUID

from outbox.models import NOT_STARTED_EFFECT_STATUSES, STOPPING_RUN_STATUSES, AttemptOutcome
from outbox.storage.schema import effects, runs
from outbox.storage.sql.attempt_log import log_changes, lost_without_answer
from outbox.storage.sql.common import AnySelect, const, in_statuses, json_param, shard_of

__all__ = [
    "StoppingMark",
    "cancel_pending_effects",
    "doubt_pending_effects",
    "mark_compensated",
    "run_effects_for_stopping",
    "run_holds",
    "stopping_runs",
]

# Statements on outbox_effects cannot bind "run_id": it is a column there, and
# SQLAlchemy reserves column names for the SET clause.
_OF_RUN = bindparam("stopping_run", type_=UUID(as_uuid=True))


def _of_stopping_run() -> tuple[Any, ...]:
    return (effects.c.run_id == _OF_RUN, effects.c.shard == shard_of(_OF_RUN))


def _stop_unstarted(sharded: bool, outcome: AttemptOutcome, *where: Any, **values: Any) -> Any:
    changed = (
        effects.update()
        .where(
            *_of_stopping_run(),
            in_statuses(effects.c.status, NOT_STARTED_EFFECT_STATUSES),
            effects.c.compensates.is_(None),
            *where,
        )
        .values(updated_at=func.now(), last_error=bindparam("reason", type_=Text), **values)
        .returning(effects.c.id, effects.c.attempt, effects.c.attempt_started_at, effects.c.shard)
        .cte("changed")
    )
    by, detail = bindparam("by", type_=Text), json_param("detail")
    return log_changes(changed, worker=by, outcome=const(outcome), detail=detail, sharded=sharded)


@cache
def doubt_pending_effects(sharded: bool = False) -> Any:
    """A stopping run's unstarted effects that may have happened become ``unknown``.

    Such an effect's earlier attempt was lost and put back for redelivery (its
    sink dedups the key), so it is pending again, yet the lost call may have
    taken effect. Cancelling it would record that it never happened, and a
    compensation would skip it; as ``unknown`` it waits for an operator to say
    (G3), and the run's stop waits with it. Parameters as
    :func:`cancel_pending_effects`; run it first. Returns one row per effect.
    """
    # A dispatched one carries the relay's newer attempt, which says nothing of the
    # lost one: that attempt is spent, or the relay's give-back (``released``, a
    # truth about an attempt that made no call) would turn it back to pending.
    dispatched = effects.c.status == const("dispatched")
    return _stop_unstarted(
        sharded,
        AttemptOutcome.UNKNOWN,
        lost_without_answer(),
        status=const("unknown"),
        attempt=case((dispatched, effects.c.attempt + 1), else_=effects.c.attempt),
        lease_owner=null(),
        lease_expires_at=null(),
    )


@cache
def cancel_pending_effects(sharded: bool = False) -> Any:
    """A stopping run's effects that have not started are cancelled (they never will be).

    Each one gets an attempt-log row (outcome ``cancelled``) naming who
    cancelled and why, as an operator's resolve or retry does. Parameters:
    ``stopping_run``, ``reason`` (the effects' ``last_error``), ``by`` (who),
    ``detail`` (JSON). Returns one row per effect cancelled.
    """
    return _stop_unstarted(
        sharded, AttemptOutcome.CANCELLED, status=const("cancelled"), completed_at=func.now()
    )


class StoppingMark(NamedTuple):
    """Where a sweep of stopping runs stopped: its order is (shard, last change, id)."""

    id: uuid.UUID
    shard: int
    updated_at: datetime


def stopping_runs(sharded: bool = False) -> AnySelect:
    """Runs being cancelled or compensated, oldest change first (by index), as marks.

    Only those after ``:after_at`` and ``:after_id`` (a :class:`StoppingMark`; by
    default, all). ``sharded`` (Citus): of shard ``:on_shard`` only.
    """
    after = tuple_(
        bindparam("after_at", datetime.min.replace(tzinfo=UTC), type_=DateTime(timezone=True)),
        bindparam("after_id", uuid.UUID(int=0), type_=UUID(as_uuid=True)),
    )
    return (
        select(runs.c.id, runs.c.shard, runs.c.updated_at)
        .where(
            in_statuses(runs.c.status, STOPPING_RUN_STATUSES),
            *([runs.c.shard == bindparam("on_shard", type_=SmallInteger)] if sharded else []),
            tuple_(runs.c.updated_at, runs.c.id) > after,
        )
        .order_by(runs.c.updated_at, runs.c.id)
        .limit(bindparam("max_rows", type_=Integer))
    )


def run_effects_for_stopping() -> AnySelect:
    """Every effect of one run, in intent order, with what compensation needs."""
    return (
        select(
            effects.c.id,
            effects.c.status,
            effects.c.compensate,
            effects.c.compensates,
            effects.c.idempotency_key,
            effects.c.seq,
            effects.c.kind,
            effects.c.priority,
            effects.c.fairness_key,
        )
        .where(*_of_stopping_run())
        .order_by(effects.c.seq)
    )


@cache
def mark_compensated() -> Any:
    """A stopping run's succeeded effects whose compensation succeeded become ``compensated``."""
    return (
        effects.update()
        .where(
            *_of_stopping_run(),
            effects.c.id == any_(bindparam("ids", type_=ARRAY(UUID(as_uuid=True)))),
            effects.c.status == const("succeeded"),
        )
        .values(status=const("compensated"), updated_at=func.now())
    )


@cache
def run_holds() -> AnySelect:
    """Whether the run ``:held_run`` holds its effect ``:held_effect`` back now.

    The condition the hold trigger (``outbox_effects_hold_paused``) applies to
    an effect moving back to pending: its run paused, or being stopped and the
    effect not a compensation (those are what a stop sends). Read plainly, on
    the run's shard.
    """
    run = bindparam("held_run", type_=UUID(as_uuid=True))
    effect = bindparam("held_effect", type_=UUID(as_uuid=True))
    return (
        select(
            runs.c.paused_at.isnot(None)
            | (in_statuses(runs.c.status, STOPPING_RUN_STATUSES) & effects.c.compensates.is_(None))
        )
        .select_from(runs.join(effects, effects.c.run_id == runs.c.id))
        .where(
            runs.c.id == run,
            runs.c.shard == shard_of(run),
            effects.c.id == effect,
            effects.c.shard == shard_of(run),
        )
    )
