"""The delivery SQL on effects: completion, expiry and take-over.

Stream mode's dispatch statements are in :mod:`outbox.storage.sql.dispatch`, the notes
on pending effects no deliverer takes in :mod:`outbox.storage.sql.notes`, an
operator's resolve and retry in :mod:`outbox.storage.sql.operator_changes`.

Every statement is a compare-and-set on (status, lease owner, attempt): a
deliverer whose lease was taken over changes nothing (G4). Each change that
ends or moves an attempt is written to the attempt log in the same statement.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from sqlalchemy import (
    ARRAY,
    DateTime,
    Float,
    Integer,
    SmallInteger,
    Text,
    and_,
    any_,
    bindparam,
    case,
    column,
    func,
    null,
    or_,
    select,
)
from sqlalchemy.dialects.postgresql import JSONB, UUID
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.sql.expression import ColumnElement

from outbox.models import TERMINAL_EFFECT_STATUSES
from outbox.storage.schema import effect_attempts, effects, runs
from outbox.storage.sql.attempt_log import LOGGED_ATTEMPT, labelled, log_changes
from outbox.storage.sql.common import (
    RUNS_CHANNEL,
    SECONDS,
    AnySelect,
    const,
    in_statuses,
    json_param,
    on_shard,
    woken_run,
)

__all__ = [
    "awaiting_run",
    "complete_effects",
    "expire_effect",
    "expired_effects",
    "take_over_effect",
    "unknown_of_kinds",
    "wake_waiters",
]


def _done() -> Any:
    return (
        func.jsonb_to_recordset(json_param("done"))
        .table_valued(
            column("id", UUID(as_uuid=True)),
            column("attempt", Integer),
            column("status", Text),
            column("outcome", Text),
            column("result", JSONB),
            column("error", Text),
            column("delay", Float),
            column("detail", JSONB),
            column("started_at", DateTime(timezone=True)),
        )
        .render_derived(name="d", with_types=True)
    )


def db_now(sharded: bool) -> Any:
    """The database's time: ``now()``, or on Citus the ``now`` parameter.

    Citus refuses ``now()`` inside a ``CASE`` and beside a column in an
    ``UPDATE`` (it must be one value, and a worker's clock is not the
    coordinator's); a sharded statement takes it as a parameter instead.
    """
    return bindparam("now", type_=DateTime(timezone=True)) if sharded else func.now()


def after(now: Any, seconds: Any, sharded: bool) -> Any:
    """``now`` plus ``seconds`` (a column): on Citus in an immutable form (UTC arithmetic)."""
    if not sharded:
        return now + seconds * SECONDS
    return func.timezone("UTC", func.timezone("UTC", now) + seconds * SECONDS)


def _chain_inputs(sharded: bool) -> list[Any]:
    """What the link of an attempt that changes its effect needs, read by that update.

    As the attempt-chain trigger reads them (``functions/chain.sql``), but in the
    statement that holds the effect's row: the effect's genesis, its status and
    result hash once changed, and the newest link of its chain (``prev``). On
    Citus the trigger's reads are each a distributed query on the worker (about
    0.14 ms a row); here they are part of one routed statement.
    """
    e, a = effects, effect_attempts
    shard = bindparam("on_shard", type_=SmallInteger) if sharded else e.c.shard
    newest = (
        select(a.c.hash)
        .where(a.c.effect_id == e.c.id, a.c.shard == shard)
        .order_by(a.c.id.desc())
        .limit(1)
        .scalar_subquery()
    )
    return [
        func.outbox_effect_genesis(
            e.c.id, e.c.run_id, e.c.kind, e.c.idempotency_key, e.c.payload_hash
        ).label("genesis"),
        func.outbox_result_hash(e.c.result).label("result_hash"),
        newest.label("prev"),
    ]


@cache
def complete_effects(sharded: bool = False) -> Any:
    """Record the outcomes of a batch of attempts, fenced, with their attempt log.

    Parameters: ``owner``, ``done`` (a JSON array of ``{id, attempt, status,
    outcome, result, error, delay, detail, started_at}``) and ``ids`` (the same
    ids). A row changes only while it still holds that attempt: in flight (or,
    for a relay, dispatched) under ``owner``, or set aside by the reconciler
    (``unknown``, or back to ``pending``) without a newer attempt having
    started, in which case this late answer is the truth about that attempt (on
    a row already pending it keeps the later of the two due times: a hold stays).
    Otherwise the completion is stale: it is logged as ``stale`` (with what it
    reported) and changes nothing else (G4).
    Returns ``(effect_id, outcome)`` per logged attempt.

    ``sharded`` (Citus): every effect of the batch is on shard ``on_shard``, the
    database's time is the ``now`` parameter, and a run woken is returned
    rather than notified: each selected row names the run its effect's end may
    wake (``wakes``), and the caller sends the NOTIFY from the coordinator when
    there is one. A run of another shard parked on an effect this ends cannot be
    woken by this statement, which stays on one shard: the caller wakes it with
    :func:`wake_waiters`, after the commit.
    """
    e = effects
    d = _done()
    now = db_now(sharded)
    shard = bindparam("on_shard", type_=SmallInteger)
    ours = e.c.lease_owner == bindparam("owner", type_=Text)
    holds_attempt = and_(
        *([e.c.shard == shard] if sharded else []),
        # The planner cannot estimate a recordset's size; naming the ids keeps it
        # on the primary key instead of a scan of every open effect.
        e.c.id == any_(bindparam("ids", type_=ARRAY(UUID(as_uuid=True)))),
        e.c.id == d.c.id,
        e.c.attempt == d.c.attempt,
        or_(
            # ``dispatched`` under ``owner``: a relay gives back what it could not publish
            and_(in_statuses(e.c.status, ("in_flight", "dispatched")), ours),
            in_statuses(e.c.status, ("unknown", "pending")),
        ),
    )
    updated = (
        e.update()
        .where(holds_attempt)
        .values(
            status=d.c.status,
            result=case((d.c.status == const("succeeded"), d.c.result), else_=e.c.result),
            last_error=d.c.error,
            available_at=case(
                # a late answer on one put back pending keeps a later time: the hold
                # of a stopping run's effect (effect_guards.sql), say
                (
                    and_(d.c.status == const("pending"), e.c.status == const("pending")),
                    func.greatest(e.c.available_at, after(now, d.c.delay, sharded)),
                ),
                (d.c.status == const("pending"), after(now, d.c.delay, sharded)),
                else_=e.c.available_at,
            ),
            lease_owner=null(),
            lease_expires_at=null(),
            completed_at=case(
                (in_statuses(d.c.status, TERMINAL_EFFECT_STATUSES), now), else_=null()
            ),
            updated_at=now,
        )
        .returning(
            e.c.id,
            e.c.attempt,
            e.c.status,
            e.c.awaited_by,
            e.c.shard,
            *_chain_inputs(sharded),
        )
        .cte("updated")
    )
    # A run parked on one of these effects (``run.await_effect``) goes on now. The
    # park wrote ``awaited_by`` on the effect row, so this statement sees it even
    # when the park committed while it waited for that row's lock; the run row is
    # then re-read at its latest version, which is why its state is tested in the
    # SET (a WHERE on status would be judged on the older version).
    terminal = in_statuses(updated.c.status, TERMINAL_EFFECT_STATUSES)
    woke = and_(runs.c.status == const("waiting"), runs.c.wait_effect == updated.c.id)
    woken = (
        runs.update()
        .where(
            runs.c.id == updated.c.awaited_by,
            *([runs.c.shard == shard] if sharded else []),
            terminal,
        )
        .values(
            status=case((woke, const("runnable")), else_=runs.c.status),
            available_at=case((woke, now), else_=runs.c.available_at),
            wake_at=case((woke, null()), else_=runs.c.wake_at),
            wait_effect=case((woke, null()), else_=runs.c.wait_effect),
        )
        .returning(runs.c.id, *([] if sharded else [func.pg_notify(RUNS_CHANNEL, "")]))
        .cte("woken")
    )
    d2 = _done()
    stale = updated.c.id.is_(None)
    # a stale completion changed no row: its effect's shard is read
    its_shard = (
        shard
        if sharded
        else select(effects.c.shard).where(effects.c.id == d2.c.id).limit(1).scalar_subquery()
    )
    owner = bindparam("owner", type_=Text)
    # The one row of each effect that changed it carries its link; any other (a stale
    # report, the same outcome twice) is chained by the trigger, after it.
    linked = and_(~stale, func.row_number().over(partition_by=d2.c.id, order_by=stale) == 1)
    logged = (
        select(
            *labelled(
                (
                    d2.c.id,
                    d2.c.attempt,
                    owner,
                    d2.c.started_at,
                    now,
                    case((stale, const("stale")), else_=d2.c.outcome),
                    case(
                        (
                            stale,
                            func.jsonb_build_object(
                                "reported", d2.c.outcome, "detail", d2.c.detail
                            ),
                        ),
                        else_=d2.c.detail,
                    ),
                    func.coalesce(updated.c.shard, its_shard),
                    updated.c.status,
                    updated.c.result_hash,
                    # the link of the attempt that changed the row, chained here from what
                    # the update read under the row's lock
                    case(
                        (
                            linked,
                            func.outbox_attempt_link(
                                func.coalesce(updated.c.prev, updated.c.genesis),
                                d2.c.id,
                                d2.c.attempt,
                                owner,
                                d2.c.started_at,
                                now,
                                d2.c.outcome,
                                d2.c.detail,
                                updated.c.status,
                                updated.c.result_hash,
                            ),
                        ),
                        else_=null(),
                    ),
                )
            )
        )
        .select_from(
            # by attempt too: a batch can carry a retried outcome of an older attempt
            # beside the current one of the same effect, and only the one that changed
            # the row is its outcome; the other is stale
            d2.outerjoin(updated, and_(updated.c.id == d2.c.id, updated.c.attempt == d2.c.attempt))
        )
        # the linked rows first: ids are drawn in this order, and chain order is id order
        .order_by(~linked)
    )
    if sharded:  # the rows are inserted by log_attempts, which says why
        wakes = case((terminal, updated.c.awaited_by), else_=null()).label("wakes")
        return logged.add_columns(wakes).add_cte(woken)
    return (
        pg_insert(effect_attempts)
        .from_select(list(LOGGED_ATTEMPT), logged)
        .returning(effect_attempts.c.effect_id, effect_attempts.c.outcome)
        .add_cte(woken)
    )


@cache
def wake_waiters() -> Any:
    """On Citus: runs of shard ``on_shard`` parked on effects of other shards that ended.

    Parameters ``on_shard``, and ``runs`` and ``awaited`` (two arrays of ids, in
    pairs): each run goes on if it still waits for that effect. The runs a
    completion names (``complete_effects``' ``wakes``); a run that missed it (its
    node did not answer) looks again when its recheck timer ends.
    """
    pairs = (
        func.unnest(
            bindparam("runs", type_=ARRAY(UUID(as_uuid=True))),
            bindparam("awaited", type_=ARRAY(UUID(as_uuid=True))),
        )
        .table_valued("run_id", "effect_id")
        .render_derived(name="waiting")
    )
    return (
        runs.update()
        .where(
            *on_shard(runs, True),
            runs.c.id == pairs.c.run_id,
            runs.c.status == const("waiting"),
            runs.c.wait_effect == pairs.c.effect_id,
        )
        .values(woken_run("wait_effect"))
        .returning(runs.c.id)
    )


@cache
def awaiting_run() -> AnySelect:
    """The run that parked on effect ``effect_id`` (of shard ``effect_shard``), or NULL.

    ``awaited_by`` names the last run that did; :func:`wake_waiters` wakes it only
    while it still waits for that effect.
    """
    return select(effects.c.awaited_by).where(
        effects.c.id == bindparam("effect_id", type_=UUID(as_uuid=True)),
        effects.c.shard == bindparam("effect_shard", type_=SmallInteger),
    )


def expired_effects(sharded: bool = False) -> AnySelect:
    """In-flight effects whose lease ran out (their deliverer died or stalled), oldest first."""
    return (
        select(effects)
        .where(
            effects.c.status == const("in_flight"),
            effects.c.lease_expires_at < func.now(),
            *on_shard(effects, sharded),
        )
        .order_by(effects.c.lease_expires_at)
        .limit(bindparam("max_rows", type_=Integer))
    )


def unknown_of_kinds() -> AnySelect:
    """``unknown`` effects of ``:kinds`` (by the needs-operator index), oldest first."""
    return (
        select(effects)
        .where(
            effects.c.status == const("unknown"),
            effects.c.kind == any_(bindparam("kinds", type_=ARRAY(Text))),
        )
        .order_by(effects.c.seq)
        .limit(bindparam("max_rows", type_=Integer))
    )


def _expired_cas(sharded: bool) -> list[ColumnElement[bool]]:
    return [
        *on_shard(effects, sharded),
        effects.c.id == bindparam("effect_id", type_=UUID(as_uuid=True)),
        effects.c.attempt == bindparam("expected_attempt", type_=Integer),
        effects.c.status == const("in_flight"),
        effects.c.lease_expires_at < func.now(),
    ]


@cache
def expire_effect(sharded: bool = False) -> Any:
    """Resolve one expired attempt as ``new_status`` (pending | unknown | failed), logged.

    Parameters: ``effect_id``, ``expected_attempt``, ``new_status``, ``note``,
    ``resolution``, ``worker``. Changes nothing (and logs nothing) when another
    reconciler or a late completion got there first.
    """
    now = db_now(sharded)
    changed = (
        effects.update()
        .where(*_expired_cas(sharded))
        .values(
            status=bindparam("new_status", type_=Text),
            lease_owner=null(),
            lease_expires_at=null(),
            available_at=now,
            last_error=bindparam("note", type_=Text),
            completed_at=case(
                (bindparam("new_status", type_=Text) == const("failed"), now), else_=null()
            ),
            updated_at=now,
        )
        .returning(effects.c.id, effects.c.attempt, effects.c.attempt_started_at, effects.c.shard)
        .cte("changed")
    )
    return log_changes(
        changed,
        worker=bindparam("worker", type_=Text),
        outcome=const("expired"),
        detail=func.jsonb_build_object(
            "resolution",
            bindparam("resolution", type_=Text),
            "note",
            bindparam("note", type_=Text),
        ),
        sharded=sharded,
    )


@cache
def take_over_effect(sharded: bool = False) -> Any:
    """Lease an expired attempt to the reconciler (same attempt) while it asks the sink."""
    return (
        effects.update()
        .where(*_expired_cas(sharded))
        .values(
            lease_owner=bindparam("owner", type_=Text),
            lease_expires_at=func.now() + bindparam("lease_seconds", type_=Float) * SECONDS,
            updated_at=func.now(),
        )
        .returning(effects.c.id)
    )
