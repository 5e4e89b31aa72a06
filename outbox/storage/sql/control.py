"""SQL of run control: pause and resume a run, park a paused run, fork a run from a step.

Pure builders, executed by :class:`~outbox.storage.run_tx.RunTx` (the caller
holds the run row's lock, so these never race a wait, a signal or a cancel).

A pause sets ``paused_at`` on the run. A run nobody holds (runnable, waiting)
becomes ``paused`` at once; a run a worker holds stays ``running`` until the
step in flight is recorded, then its worker parks it (:func:`park_paused`).
Its effects that no deliverer started become ``paused``, and every way back to
``pending`` (a retry, the reconciler, an operator) keeps them ``paused`` (the
``outbox_effects_hold_paused`` trigger), so claims need no change: they take
``pending`` rows only, by the same partial index.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from sqlalchemy import (
    Integer,
    Numeric,
    Text,
    and_,
    bindparam,
    case,
    cast,
    exists,
    func,
    insert,
    literal_column,
    null,
    select,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, UUID

from outbox.models import NOT_STARTED_EFFECT_STATUSES, EffectStatus
from outbox.storage.schema import budget_ledger, effects, runs, steps
from outbox.storage.sql.attempt_log import lost_without_answer
from outbox.storage.sql.common import (
    EFFECTS_CHANNEL,
    AnySelect,
    const,
    in_statuses,
    shard_of,
)

__all__ = [
    "fork_chain",
    "fork_cut",
    "fork_ledger",
    "fork_run",
    "fork_steps",
    "fork_unsettled",
    "hold_effects",
    "lock_unstarted_effects",
    "park_paused",
    "pause_run",
    "release_effects",
    "resume_run",
]

_RUN_ID = bindparam("run_id", type_=UUID(as_uuid=True))
# Statements on outbox_effects, outbox_steps and the ledger cannot bind "run_id" (a column).
_OF_RUN = bindparam("of_run", type_=UUID(as_uuid=True))
_ORIGINAL = bindparam("original", type_=UUID(as_uuid=True))
_FORK = bindparam("fork", type_=UUID(as_uuid=True))


def lock_unstarted_effects() -> AnySelect:
    """Lock the run's effects no deliverer started, before the run itself.

    A completion holds its effect while it wakes the run that awaits it: the
    effect's row, then the run's. Pause, resume and cancel change those effects
    under the run's lock, so they take the effects first too, in the same order,
    rather than wait for a completing effect while holding the run it must wake.
    """
    return (
        select(effects.c.id)
        .where(
            effects.c.run_id == _OF_RUN,
            effects.c.shard == shard_of(_OF_RUN),
            in_statuses(effects.c.status, NOT_STARTED_EFFECT_STATUSES),
        )
        # one order for every taker, so two never hold parts of the set each
        .order_by(effects.c.id)
        .with_for_update(of=effects)
    )


@cache
def pause_run(*, park: bool, first: bool) -> Any:
    """Mark the locked run paused (``reason``); ``park``: it is not held, so ``paused`` now.

    ``first``: it was not paused before, so the pause starts now. The caller knows
    both from the row it locked; choosing the statement here rather than with
    CASE keeps ``now()`` out of conditional expressions, which Citus refuses in
    an UPDATE.
    """
    values: dict[str, Any] = {
        "pause_reason": bindparam("reason", type_=Text),
        "updated_at": func.now(),
    }
    if first:
        values["paused_at"] = func.now()
    if park:
        values["status"] = const("paused")
    return (
        runs.update()
        .where(runs.c.id == _RUN_ID, runs.c.shard == shard_of(_RUN_ID))
        .values(values)
        .returning(runs.c.status)
    )


@cache
def hold_effects() -> Any:
    """The run's effects no deliverer started become ``paused`` (their place in line is kept)."""
    return (
        effects.update()
        .where(
            effects.c.run_id == _OF_RUN,
            effects.c.shard == shard_of(_OF_RUN),
            in_statuses(effects.c.status, (EffectStatus.PENDING, EffectStatus.DISPATCHED)),
        )
        .values(status=const("paused"), lease_expires_at=null(), updated_at=func.now())
        .returning(effects.c.id)
    )


@cache
def resume_run(*, parked: bool) -> Any:
    """Lift the locked run's pause: a ``parked`` run becomes runnable now (workers are told).

    A run that waited when it was paused re-checks its wait when it runs: a
    deadline that passed meanwhile is acted on then, a signal sent meanwhile is
    consumed then. A run still held by a worker (the pause was waiting for its
    step) just carries on. (One statement per case, as in :func:`pause_run`.)
    """
    values: dict[str, Any] = {"paused_at": null(), "pause_reason": null(), "updated_at": func.now()}
    if parked:
        values |= {
            "status": const("runnable"),
            "available_at": func.now(),
            "wake_at": null(),
            "wait_signal": null(),
            "wait_effect": null(),
        }
    return (
        runs.update()
        .where(runs.c.id == _RUN_ID, runs.c.shard == shard_of(_RUN_ID))
        .values(values)
        .returning(runs.c.status)
    )


@cache
def release_effects() -> Any:
    """The run's paused effects are ``pending`` again, in their old place; deliverers are told."""
    released = (
        effects.update()
        .where(
            effects.c.run_id == _OF_RUN,
            effects.c.shard == shard_of(_OF_RUN),
            effects.c.status == const("paused"),
        )
        .values(status=const("pending"), updated_at=func.now())
        .returning(effects.c.id)
        .cte("released")
    )
    return select(
        select(func.count()).select_from(released).scalar_subquery().label("released"),
        func.pg_notify(EFFECTS_CHANNEL, "").label("notified"),
    )


@cache
def park_paused() -> Any:
    """A worker lets go of its run after the step a pause waited for (fenced).

    ``paused`` if the pause still stands, ``runnable`` if it was lifted meanwhile.
    """
    still = runs.c.paused_at.isnot(None)
    return (
        runs.update()
        .where(
            runs.c.id == _RUN_ID,
            runs.c.shard == shard_of(_RUN_ID),
            runs.c.status == const("running"),
            runs.c.lease_owner == bindparam("fence_owner", type_=Text),
            runs.c.attempt == bindparam("fence_attempt", type_=Integer),
        )
        .values(
            status=case((still, const("paused")), else_=const("runnable")),
            available_at=func.now(),
            lease_owner=null(),
            lease_expires_at=null(),
            updated_at=func.now(),
        )
        .returning(runs.c.status)
    )


def fork_cut() -> AnySelect:
    """The original's completed steps in order (``of_run``): a fork copies those before its step."""
    return (
        select(steps.c.step_id, steps.c.seq)
        .where(
            steps.c.run_id == _OF_RUN,
            steps.c.shard == shard_of(_OF_RUN),
            steps.c.status == const("completed"),
        )
        .order_by(steps.c.seq)
    )


def _copied() -> list[Any]:
    """The original's completed steps before the cut (``cut`` NULL: all of them)."""
    cut = bindparam("cut", type_=Integer)
    return [
        steps.c.run_id == _ORIGINAL,
        steps.c.shard == shard_of(_ORIGINAL),
        steps.c.status == const("completed"),
        (cut.is_(None)) | (steps.c.seq < cut),
    ]


def _copied_debits() -> list[Any]:
    """The original's debits of the copied steps (joined on the shard too: Citus)."""
    return [
        budget_ledger.c.run_id == _ORIGINAL,
        budget_ledger.c.shard == shard_of(_ORIGINAL),
        budget_ledger.c.entry == const("spend"),
        exists().where(
            *_copied(),
            steps.c.shard == budget_ledger.c.shard,
            steps.c.step_id == budget_ledger.c.step_id,
        ),
    ]


def _last_set(column: Any) -> Any:
    """What the last copied step that set ``column`` (state or plan) set it to."""
    return (
        select(column)
        .where(*_copied(), column.isnot(None))
        .order_by(steps.c.seq.desc())
        .limit(literal_column("1", Integer))
        .scalar_subquery()
    )


#: Effects that may already have taken effect (a deliverer was in the call, or Kafka
#: has the record): a fork that runs their step again would intend them twice. So
#: may one not started again since an attempt was lost (``lost_without_answer``).
UNSETTLED_EFFECT_STATUSES = (
    EffectStatus.UNKNOWN,
    EffectStatus.IN_FLIGHT,
    EffectStatus.DISPATCHED,
)


@cache
def fork_unsettled() -> AnySelect:
    """The original's unsettled effects at or after the cut, in order.

    Parameters: ``of_run``, ``cut`` (the seq of the step the fork restarts at;
    NULL: after every completed step) and ``from_step`` (the step a failed run
    failed at). Rows: (effect_id, step_id, kind, status, idempotency_key,
    lost_attempt: not started again since an attempt was lost).
    """
    cut = bindparam("cut", type_=Integer)
    rerun = select(steps.c.step_id).where(
        steps.c.run_id == _OF_RUN,
        steps.c.shard == shard_of(_OF_RUN),
        cut.isnot(None),
        steps.c.seq >= cut,
    )
    unsettled = in_statuses(effects.c.status, UNSETTLED_EFFECT_STATUSES)
    # pending (say) again after a lost attempt that may have reached the sink
    lost = and_(in_statuses(effects.c.status, NOT_STARTED_EFFECT_STATUSES), lost_without_answer())
    return (
        select(
            effects.c.id.label("effect_id"),
            effects.c.step_id,
            effects.c.kind,
            effects.c.status,
            effects.c.idempotency_key,
            ~unsettled.self_group().label("lost_attempt"),
        )
        .where(
            effects.c.run_id == _OF_RUN,
            effects.c.shard == shard_of(_OF_RUN),
            unsettled | lost,
            (effects.c.step_id.in_(rerun))
            | (effects.c.step_id == bindparam("from_step", type_=Text)),
        )
        .order_by(effects.c.seq)
    )


@cache
def fork_run() -> Any:
    """The row of the fork of ``original`` as ``fork``: same agent, inputs, budget, priority.

    Parameters: ``original``, ``fork``, ``cut`` (the seq of the step it restarts
    at; NULL: after every completed step), ``from_step``, ``version`` (NULL: the
    original's). Its state and plan are those the last copied step set (else
    the defaults), it has spent what the copied steps spent, and it starts
    runnable. No row when the original does not exist.

    The fork's rows are read, then inserted as values (``fork_insert``): on Citus
    an ``INSERT ... SELECT`` from another shard is a ``COPY``, which PostgreSQL
    refuses into a table with row-level security (``outbox roles``).
    """
    spent = (
        select(func.coalesce(func.sum(budget_ledger.c.amount), 0))
        .where(*_copied_debits())
        .scalar_subquery()
    )
    current = (
        select(steps.c.step_id)
        .where(*_copied())
        .order_by(steps.c.seq.desc())
        .limit(literal_column("1", Integer))
        .scalar_subquery()
    )
    return select(
        _FORK.label("id"),
        runs.c.agent,
        func.coalesce(bindparam("version", type_=Text), runs.c.agent_version).label(
            "agent_version"
        ),
        _as_text(runs.c.inputs),
        runs.c.inputs_hash,
        const("runnable").label("status"),
        _as_text(func.coalesce(_last_set(steps.c.state), text("'{}'::jsonb")), "state"),
        _as_text(func.coalesce(_last_set(steps.c.plan), text("'[]'::jsonb")), "plan"),
        current.label("current_step"),
        runs.c.budget,
        cast(spent, Numeric).label("spent"),
        runs.c.priority,
        runs.c.fairness_key,
        runs.c.id.label("forked_from"),
        bindparam("from_step", type_=Text).label("forked_at_step"),
        # a dry run's fork is a dry run too: its new effects never reach a sink
        runs.c.dry_run,
        shard_of(_FORK).label("shard"),
        runs.c.namespace,
        select(func.count())
        .select_from(steps)
        .where(*_copied())
        .scalar_subquery()
        .label("step_count"),
    ).where(runs.c.id == _ORIGINAL, runs.c.shard == shard_of(_ORIGINAL))


@cache
def fork_steps() -> Any:
    """The original's steps before the cut as the fork's, in order, results as recorded."""
    return (
        select(
            _FORK.label("run_id"),
            shard_of(_FORK).label("shard"),
            # numbered by the fork, as the original ordered them
            func.row_number().over(order_by=steps.c.seq).label("seq"),
            steps.c.step_id,
            steps.c.kind,
            _as_text(steps.c.result),
            _as_text(steps.c.error),
            steps.c.completed_at,
            steps.c.status,
            _as_text(steps.c.state),
            _as_text(steps.c.plan),
        )
        .where(*_copied())
        .order_by(steps.c.seq)
    )


def _as_text(value: Any, name: str | None = None) -> Any:
    """A JSON value read as PostgreSQL's text of it, to be written back exactly.

    (Through Python a number would become a float: 0.1000000000000000055 would
    replay as 0.1.)
    """
    return cast(value, Text).label(name or value.name)


@cache
def fork_insert(table: str) -> Any:
    """Insert the rows ``fork_run``, ``fork_steps`` or ``fork_ledger`` read, as values."""
    target = {"runs": runs, "steps": steps, "budget_ledger": budget_ledger}[table]
    read = {"runs": fork_run, "steps": fork_steps, "budget_ledger": fork_ledger}[table]()
    values: dict[str, Any] = {}
    for name in [c.key for c in read.selected_columns]:
        column = target.c[name]
        if isinstance(column.type, JSONB):
            values[name] = cast(bindparam(name, type_=Text), JSONB)
        else:
            values[name] = bindparam(name, type_=column.type)
    return insert(target).values(values)


@cache
def fork_chain() -> Any:
    """Chain the fork's copied steps from the fork's own genesis, and set its ``step_head``.

    A copied step's hash cannot be copied: each link covers the run's id. So
    the links are computed again (``outbox_chain_fork``, SECURITY DEFINER: no role
    writes the chain's columns by hand), in the order the steps were copied,
    for the steps the original had chained (``chained``, read by
    ``fork_chained``), and ``outbox audit verify`` of a fork checks its replayed
    history too. Parameters: ``fork_shard``, ``fork``, ``chained``.
    """
    return text(
        "SELECT outbox_chain_fork(CAST(:fork_shard AS smallint), CAST(:fork AS uuid),"
        " CAST(:chained AS text[]))"
    )


@cache
def fork_chained() -> Any:
    """The step ids of the original's copied steps that its hash chain links."""
    return select(steps.c.step_id).where(*_copied(), steps.c.hash.isnot(None))


@cache
def fork_ledger() -> Any:
    """The copied steps' debits, as the fork's (a replayed step does not spend again)."""
    return select(
        _FORK.label("run_id"),
        shard_of(_FORK).label("shard"),
        budget_ledger.c.step_id,
        budget_ledger.c.reason,
        budget_ledger.c.entry,
        budget_ledger.c.amount,
    ).where(*_copied_debits())
