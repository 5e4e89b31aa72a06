"""SQL of durable runs: waits, signals, suspension, step retries, upgrades, sweeps.

Pure functions returning SQLAlchemy Core statements, executed by
:mod:`outbox.run_store`. Writes about a run held by a worker are fenced by
(lease owner, attempt) like every other claimed row (see :mod:`outbox.storage.sql.queue`).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from sqlalchemy import (
    DateTime,
    Float,
    Integer,
    SmallInteger,
    Text,
    bindparam,
    case,
    cast,
    exists,
    func,
    null,
    select,
    text,
)
from sqlalchemy.dialects.postgresql import UUID
from sqlalchemy.dialects.postgresql import insert as pg_insert

from outbox.models import (
    LIVE_RUN_STATUSES,
)
from outbox.storage.schema import effects, runs, signals, steps
from outbox.storage.sql.common import (
    SECONDS,
    AnySelect,
    const,
    in_statuses,
    json_param,
    shard_of,
    woken_run,
)

__all__ = [
    "await_effect",
    "complete_wait_step",
    "consume_signal",
    "insert_signal",
    "insert_wait_step",
    "lock_run",
    "mark_run",
    "record_step_failure",
    "rescue_expired_runs",
    "run_versions",
    "suspend_run",
    "upgrade_run",
    "wait_step",
    "wake_due_timers",
    "wake_signalled_run",
]

_RUN_ID = bindparam("run_id", type_=UUID(as_uuid=True))
# Statements that write outbox_steps or outbox_signals bind these instead of
# run_id/step_id/name, which are columns there.
_W_RUN = bindparam("w_run", type_=UUID(as_uuid=True))
_W_STEP = bindparam("w_step", type_=Text)
_S_NAME = bindparam("s_name", type_=Text)
#: A pause waits for the worker holding the run: it takes effect when the worker lets go.
_PAUSE_ASKED = runs.c.paused_at.isnot(None)


def lock_run() -> AnySelect:
    """Lock the run row (waits, signals and cancellation take it first, so they serialise)."""
    return (
        select(runs)
        .where(runs.c.id == _RUN_ID, runs.c.shard == shard_of(_RUN_ID))
        .with_for_update()
    )


@cache
def insert_wait_step() -> Any:
    """Record a wait the first time it is met, with its deadline in database time.

    Parameters: ``w_run``, ``w_step``, ``kind``, ``seconds`` (from now; NULL:
    no deadline), ``until`` (absolute; wins over ``seconds``), ``detail`` (JSON).
    """
    deadline = func.coalesce(
        cast(bindparam("until", type_=Text), DateTime(timezone=True)),
        func.now() + bindparam("seconds", type_=Float) * SECONDS,
    )
    # the run numbers its steps: the next number, taken only for a wait not met before
    numbered = (
        runs.update()
        .where(
            runs.c.id == _W_RUN,
            runs.c.shard == shard_of(_W_RUN),
            ~exists().where(
                steps.c.run_id == _W_RUN,
                steps.c.step_id == _W_STEP,
                steps.c.shard == shard_of(_W_RUN),
            ),
        )
        .values(step_count=runs.c.step_count + 1)
        .returning(runs.c.step_count)
        .cte("numbered")
    )
    return (
        pg_insert(steps)
        .from_select(
            ["run_id", "shard", "seq", "step_id", "kind", "status", "result"],
            select(
                _W_RUN,
                shard_of(_W_RUN),
                numbered.c.step_count,
                _W_STEP,
                bindparam("kind", type_=Text),
                const("waiting"),
                json_param("detail").op("||")(func.jsonb_build_object("deadline", deadline)),
            ),
        )
        .on_conflict_do_nothing(constraint="outbox_steps_pkey")
    )


def wait_step() -> AnySelect:
    """The wait's row, whether its deadline passed, and seconds left (database time)."""
    deadline = cast(steps.c.result["deadline"].astext, DateTime(timezone=True))
    return select(
        steps.c.status,
        steps.c.result,
        steps.c.error,
        steps.c.seq,
        steps.c.completed_at,
        (deadline <= func.now()).label("due"),
        func.extract("epoch", deadline - func.now()).label("seconds_left"),
        deadline.label("deadline"),
    ).where(steps.c.run_id == _W_RUN, steps.c.step_id == _W_STEP, steps.c.shard == shard_of(_W_RUN))


@cache
def complete_wait_step() -> Any:
    """A wait is over: record its result or error; the run's current step moves on.

    ``outbox_complete_wait`` (SECURITY DEFINER) writes the run's chain head and the
    step's link, which no role may write by hand. Returns ``step_seq, completed_at``.
    """
    return text(
        "SELECT step_seq, completed_at FROM outbox_complete_wait("
        "CAST(:w_shard AS smallint), CAST(:w_run AS uuid), CAST(:w_step AS text), "
        "CAST(:wait_result AS jsonb), CAST(:wait_error AS jsonb))"
    )


@cache
def consume_signal() -> Any:
    """The wait ``w_step`` takes the run's oldest unconsumed signal ``s_name`` and completes.

    ``outbox_take_signal`` (SECURITY DEFINER): only a waiting step of the run the
    signal was sent to consumes it, and records its payload in the same call.
    Returns ``taken, payload, step_seq, completed_at``.
    """
    return text(
        "SELECT taken, payload, step_seq, completed_at FROM outbox_take_signal("
        "CAST(:w_shard AS smallint), CAST(:w_run AS uuid), CAST(:w_step AS text), "
        "CAST(:s_name AS text))"
    )


@cache
def await_effect() -> Any:
    """Mark the effect as awaited by the run and read its outcome (locks the effect row).

    Locking the row orders this against the effect's completion: either the
    completion committed first and its outcome is returned here, or it runs
    after and finds ``awaited_by`` to wake the run (see ``queue.complete_effects``).
    The effect is named with its shard (``effect_shard``): on Citus, that shard alone.

    No row comes back while another transaction holds the effect's row: a
    completion holds it and takes the run's lock next, which the caller holds.
    """
    effect_id = bindparam("effect_id", type_=UUID(as_uuid=True))
    named = (effects.c.id == effect_id, effects.c.shard == bindparam("effect_shard"))
    free = select(effects.c.id).where(*named).with_for_update(skip_locked=True)
    return (
        effects.update()
        .where(*named, effects.c.id == free.scalar_subquery())
        .values(awaited_by=bindparam("awaiting_run", type_=UUID(as_uuid=True)))
        .returning(effects.c.status, effects.c.result, effects.c.last_error)
    )


@cache
def suspend_run() -> Any:
    """Park a locked run as ``waiting``; it holds no lease, process or connection meanwhile.

    Parameters: ``run_id``, ``wake_in`` (seconds; NULL: no timer), ``signal_name``,
    ``effect_id``. The caller holds the run row's lock and has just checked
    that what it waits for is not there.
    """
    return (
        runs.update()
        .where(runs.c.id == _RUN_ID, runs.c.shard == shard_of(_RUN_ID))
        .values(
            # a pause that waited for the step in flight takes effect here
            status=case((_PAUSE_ASKED, const("paused")), else_=const("waiting")),
            available_at=func.now(),
            wake_at=func.now() + bindparam("wake_in", type_=Float) * SECONDS,
            wait_signal=bindparam("signal_name", type_=Text),
            wait_effect=bindparam("effect_id", type_=UUID(as_uuid=True)),
            lease_owner=null(),
            lease_expires_at=null(),
            updated_at=func.now(),
        )
        .returning(runs.c.status)
    )


@cache
def insert_signal() -> Any:
    """Store a signal once per (run, dedup key); returns its id when it is new."""
    return (
        pg_insert(signals)
        .values(
            id=bindparam("signal_id", type_=UUID(as_uuid=True)),
            run_id=_W_RUN,
            shard=shard_of(_W_RUN),
            name=_S_NAME,
            payload=json_param("payload"),
            dedup_key=bindparam("dedup_key", type_=Text),
        )
        .on_conflict_do_nothing(constraint="outbox_signals_dedup")
        .returning(signals.c.id)
    )


@cache
def wake_signalled_run() -> Any:
    """Make the run runnable if it waits for this signal; notify workers."""
    return (
        runs.update()
        .where(
            runs.c.id == _RUN_ID,
            runs.c.shard == shard_of(_RUN_ID),
            runs.c.status == const("waiting"),
            runs.c.wait_signal == bindparam("name", type_=Text),
        )
        .values(woken_run("wait_signal"))
        .returning(runs.c.id)
    )


@cache
def wake_due_timers(sharded: bool = False) -> Any:
    """Waiting runs whose time came become runnable (by index; at most ``max_rows``).

    ``sharded`` (Citus): of one shard, ``on_shard``.
    """
    on_shard = [runs.c.shard == bindparam("on_shard", type_=SmallInteger)] if sharded else []
    due = (
        select(runs.c.id, runs.c.shard)
        .where(runs.c.status == const("waiting"), runs.c.wake_at <= func.now(), *on_shard)
        .order_by(runs.c.wake_at)
        .limit(bindparam("max_rows", type_=Integer))
        .with_for_update(skip_locked=True)
        .cte("due")
    )
    return (
        runs.update()
        .where(runs.c.id == due.c.id, runs.c.shard == due.c.shard, *on_shard)
        .values(
            status=const("runnable"),
            available_at=func.now(),
            wake_at=null(),
            wait_signal=null(),
            wait_effect=null(),
            updated_at=func.now(),
        )
        .returning(runs.c.id)
    )


@cache
def rescue_expired_runs(sharded: bool = False) -> Any:
    """Runs whose worker died (lease expired) become runnable again (paused, if pausing).

    ``sharded`` (Citus): of shard ``on_shard``; found first (Citus refuses now() in an UPDATE).
    """
    on_shard = [runs.c.shard == bindparam("on_shard", type_=SmallInteger)] if sharded else []
    due = (
        select(runs.c.id, runs.c.shard)
        .where(runs.c.status == const("running"), runs.c.lease_expires_at < func.now(), *on_shard)
        .with_for_update(skip_locked=True)
        .cte("expired")
    )
    return (
        runs.update()
        .where(runs.c.id == due.c.id, runs.c.shard == due.c.shard, *on_shard)
        .values(
            status=case((_PAUSE_ASKED, const("paused")), else_=const("runnable")),
            lease_owner=null(),
            lease_expires_at=null(),
            available_at=func.now(),
            updated_at=func.now(),
        )
        .returning(runs.c.id, runs.c.attempt)
    )


def _fenced() -> list[Any]:
    return [
        runs.c.id == _RUN_ID,
        runs.c.shard == shard_of(_RUN_ID),
        runs.c.status == const("running"),
        runs.c.lease_owner == bindparam("fence_owner", type_=Text),
        runs.c.attempt == bindparam("fence_attempt", type_=Integer),
    ]


@cache
def record_step_failure() -> Any:
    """Count a failure of ``step_key`` in the checkpoint; retry later or fail the run.

    Parameters: ``run_id``, fence, ``step_key``, ``max_retries``, ``delay``, ``failure`` (JSON).
    """
    key = bindparam("step_key", type_=Text)
    count = func.coalesce(cast(runs.c.step_retries[key].astext, Integer), 0) + 1
    exhausted = count > bindparam("max_retries", type_=Integer)
    return (
        runs.update()
        .where(*_fenced())
        .values(
            step_retries=runs.c.step_retries.op("||")(func.jsonb_build_object(key, count)),
            status=case(
                (exhausted, const("failed")),
                (_PAUSE_ASKED, const("paused")),
                else_=const("runnable"),
            ),
            error=case((exhausted, json_param("failure")), else_=runs.c.error),
            available_at=func.now() + bindparam("delay", type_=Float) * SECONDS,
            lease_owner=null(),
            lease_expires_at=null(),
            updated_at=func.now(),
        )
        .returning(runs.c.status, count.label("failures"))
    )


@cache
def upgrade_run() -> Any:
    """Move a claimed run from ``from_version`` to ``to_version`` with upgraded state, recorded."""
    entry = func.jsonb_build_object(
        "from",
        bindparam("from_version", type_=Text),
        "to",
        bindparam("to_version", type_=Text),
        "at",
        func.now(),
        "worker",
        bindparam("fence_owner", type_=Text),
    )
    return (
        runs.update()
        .where(*_fenced(), runs.c.agent_version == bindparam("from_version", type_=Text))
        .values(
            agent_version=bindparam("to_version", type_=Text),
            state=json_param("upgraded_state"),
            upgrades=runs.c.upgrades + func.jsonb_build_array(entry),
            updated_at=func.now(),
        )
        .returning(*runs.c)
    )


def run_versions() -> AnySelect:
    """Unfinished runs per agent, version and status (when can a version be retired?)."""
    live = in_statuses(runs.c.status, LIVE_RUN_STATUSES)
    return (
        select(runs.c.agent, runs.c.agent_version, runs.c.status, func.count().label("runs"))
        .where(live)
        .group_by(runs.c.agent, runs.c.agent_version, runs.c.status)
        .order_by(runs.c.agent, runs.c.agent_version, runs.c.status)
    )


@cache
def mark_run() -> Any:
    """Set a locked run's status (and reason); clears its lease, waits and pause."""
    return (
        runs.update()
        .where(runs.c.id == _RUN_ID, runs.c.shard == shard_of(_RUN_ID))
        .values(
            status=bindparam("new_status", type_=Text),
            cancel_reason=func.coalesce(bindparam("reason", type_=Text), runs.c.cancel_reason),
            lease_owner=null(),
            lease_expires_at=null(),
            wake_at=null(),
            wait_signal=null(),
            wait_effect=null(),
            paused_at=null(),
            pause_reason=null(),
            updated_at=func.now(),
        )
        .returning(runs.c.status)
    )
