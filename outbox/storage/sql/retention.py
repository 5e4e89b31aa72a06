"""The retention SQL of ``outbox gc``: pick finished rows in batches, lock them, delete them.

A run's history is deleted table by table, children first, each ``DELETE``
returning the rows it removed, so that every one of them can be archived: a
cascade from ``outbox_runs`` would delete steps, effects, attempts, signals and
ledger rows without returning them. The runs and their effects are locked
(``FOR UPDATE``) before anything is deleted: a row referencing them cannot be
inserted meanwhile (it would need a key-share lock on them), and an effect an
operator puts back to ``pending`` meanwhile keeps its run out of the batch.

``sharded`` (Citus): each statement names the one shard it works on
(``on_shard``), so it runs on the node holding it and may lock rows there. A
run's rows, its blobs and their references all live on the run's shard.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from sqlalchemy import (
    ARRAY,
    Integer,
    Table,
    Text,
    any_,
    bindparam,
    delete,
    exists,
    func,
    or_,
    select,
    tuple_,
)
from sqlalchemy.dialects.postgresql import INTERVAL, UUID

from outbox.models import OPEN_EFFECT_STATUSES, TERMINAL_RUN_STATUSES
from outbox.storage.schema import (
    budget_ledger,
    consumed_keys,
    effect_attempts,
    effects,
    run_keys,
    runs,
    signals,
    steps,
    webhook_replays,
)
from outbox.storage.sql.common import AnySelect, in_statuses, on_shard

__all__ = [
    "RUN_CHILDREN",
    "delete_attempts",
    "delete_by_ids",
    "delete_keys",
    "delete_run_children",
    "doomed_keys",
    "doomed_runless_effects",
    "doomed_runs",
    "effects_of_runs",
    "keys_of",
    "lock_effects_of_runs",
]

#: Tables whose rows belong to a run (``run_id``), deleted before the run itself.
RUN_CHILDREN: tuple[Table, ...] = (steps, signals, budget_ledger)

_UUIDS = ARRAY(UUID(as_uuid=True))


def _horizon() -> Any:
    return func.now() - bindparam("horizon", type_=INTERVAL)


def _ids(name: str = "ids") -> Any:
    return bindparam(name, type_=_UUIDS)


def _changed_since_horizon() -> Any:
    # An effect's last change: every writer sets updated_at (an operator's resolve,
    # retry or note included); completed_at too, in case one did not.
    return or_(effects.c.updated_at >= _horizon(), effects.c.completed_at >= _horizon())


@cache
def doomed_runs(sharded: bool = False) -> AnySelect:
    """Up to ``batch`` runs that ended before ``horizon``, locked, whose effects are done too.

    A run is old only when each of its effects is finished and was last changed
    before ``horizon`` as well: an effect an operator resolved a minute ago keeps
    a run that ended a year ago (and its attempt log) for the horizon's length.
    Parameters: ``horizon`` (interval), ``batch``. Rows another transaction
    holds are skipped (the next ``gc`` takes them).
    """
    still_open = exists().where(
        effects.c.run_id == runs.c.id,
        *on_shard(effects, sharded),
        or_(in_statuses(effects.c.status, OPEN_EFFECT_STATUSES), _changed_since_horizon()),
    )
    return (
        select(runs.c.id)
        .where(
            *on_shard(runs, sharded),
            in_statuses(runs.c.status, TERMINAL_RUN_STATUSES),
            runs.c.updated_at < _horizon(),
            ~still_open,
        )
        .order_by(runs.c.updated_at)
        .limit(bindparam("batch", type_=Integer))
        .with_for_update(skip_locked=True)
    )


@cache
def lock_effects_of_runs(sharded: bool = False) -> AnySelect:
    """Lock the effects of the runs ``ids`` (skipping locked ones): (id, run_id, status)."""
    return (
        select(effects.c.id, effects.c.run_id, effects.c.status)
        .where(*on_shard(effects, sharded), effects.c.run_id == any_(_ids()))
        .with_for_update(skip_locked=True)
    )


@cache
def effects_of_runs(sharded: bool = False) -> AnySelect:
    """How many effects each of the runs ``ids`` has, locked or not: (run_id, count)."""
    return (
        select(effects.c.run_id, func.count())
        .where(*on_shard(effects, sharded), effects.c.run_id == any_(_ids()))
        .group_by(effects.c.run_id)
    )


@cache
def doomed_runless_effects(sharded: bool = False) -> AnySelect:
    """Up to ``batch`` run-less effects finished before ``horizon``, locked (skipping locked)."""
    return (
        select(effects.c.id)
        .where(
            *on_shard(effects, sharded),
            effects.c.completed_at < _horizon(),
            effects.c.updated_at < _horizon(),
            effects.c.run_id.is_(None),
            ~in_statuses(effects.c.status, OPEN_EFFECT_STATUSES),
        )
        .order_by(effects.c.completed_at)
        .limit(bindparam("batch", type_=Integer))
        .with_for_update(skip_locked=True)
    )


def _returning(statement: Any, table: Table, rows: bool) -> Any:
    # Every column only when the rows are archived: reading payloads back costs.
    return statement.returning(*table.c) if rows else statement


@cache
def delete_attempts(*, rows: bool, sharded: bool = False) -> Any:
    """Delete the attempt log of the effects ``ids`` (``rows``: returning every row)."""
    statement = delete(effect_attempts).where(
        *on_shard(effect_attempts, sharded), effect_attempts.c.effect_id == any_(_ids())
    )
    return _returning(statement, effect_attempts, rows)


@cache
def delete_run_children(table: Table, *, rows: bool, sharded: bool = False) -> Any:
    """Delete the rows of ``table`` that belong to the runs ``ids`` (``rows``: returning them)."""
    statement = delete(table).where(*on_shard(table, sharded), table.c.run_id == any_(_ids()))
    return _returning(statement, table, rows)


@cache
def delete_by_ids(table: Table, *, rows: bool, sharded: bool = False) -> Any:
    """Delete rows of ``table`` (runs or effects) by primary key ``ids`` (``rows``: returning them).

    For runs, a run that still has an effect is left alone, so the cascade of
    ``outbox_effects.run_id`` can never delete an effect that was not archived.
    """
    statement = delete(table).where(*on_shard(table, sharded), table.c.id == any_(_ids()))
    if table is runs:
        statement = statement.where(
            ~exists().where(*on_shard(effects, sharded), effects.c.run_id == runs.c.id)
        )
    return _returning(statement, table, rows)


@cache
def doomed_keys(table: Table, *, rows: bool) -> Any:
    """Delete up to ``batch`` consumed keys or webhook replay marks older than ``horizon``.

    Not locked first (``FOR UPDATE`` would need the UPDATE privilege, which
    ``outbox_operator`` has no use for here): nobody updates these rows, and of
    two ``gc`` runs picking the same rows only one deletes (and archives) each.
    """
    if table is consumed_keys:
        key = (consumed_keys.c.consumer_group, consumed_keys.c.idempotency_key)
        picked = (
            select(*key)
            .where(consumed_keys.c.consumed_at < _horizon())
            .limit(bindparam("batch", type_=Integer))
        )
        return delete(consumed_keys).where(tuple_(*key).in_(picked)).returning(*consumed_keys.c)
    if table is webhook_replays:
        picked = (
            select(webhook_replays.c.signature)
            .where(webhook_replays.c.seen_at < _horizon())
            .limit(bindparam("batch", type_=Integer))
        )
        return _returning(
            delete(webhook_replays).where(webhook_replays.c.signature.in_(picked)),
            webhook_replays,
            rows,
        )
    raise ValueError(f"no retention rule for {table.name}")


@cache
def keys_of(table: Table, sharded: bool = False) -> AnySelect:
    """The callers' keys of the runs or effects ``ids``: (namespace, key), one row each with one."""
    key = table.c.key if table is runs else table.c.idempotency_key
    return select(table.c.namespace, key).where(
        *on_shard(table, sharded), table.c.id == any_(_ids()), key.is_not(None)
    )


@cache
def delete_keys(table: Table, *, rows: bool, sharded: bool = False) -> Any:
    """Delete the registrations in ``table`` (run or effect keys) that name one of ``ids``.

    ``namespaces`` and ``keys`` are the owners' (:func:`keys_of`): they lead the
    primary key, so each registration is found by its index, not by its owner.
    Once gone, a key names nothing: a later start or intent with it is new.
    ``sharded`` (Citus): the registrations on the shard ``on_shard`` (a key's own
    row is on the key's shard, an effect key's copy on its owner's).
    """
    owner = table.c.run_id if table is run_keys else table.c.effect_id
    statement = delete(table).where(
        *on_shard(table, sharded),
        table.c.namespace == any_(bindparam("namespaces", type_=ARRAY(Text))),
        table.c.key == any_(bindparam("keys", type_=ARRAY(Text))),
        owner == any_(_ids()),
    )
    return _returning(statement, table, rows)
