"""Upkeep and reporting statements: state counts, tallies, replay marks, consumed keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Any

from sqlalchemy import (
    ARRAY,
    Float,
    Text,
    any_,
    bindparam,
    delete,
    func,
    select,
    true,
    tuple_,
    union_all,
)
from sqlalchemy.dialects.postgresql import UUID
from sqlalchemy.dialects.postgresql import insert as pg_insert

from outbox.models import OPEN_EFFECT_STATUSES, EffectStatus
from outbox.storage.schema import consumed_keys, effect_attempts, effects, runs, webhook_replays
from outbox.storage.sql.common import SECONDS, AnySelect, const

__all__ = [
    "StateCounts",
    "attempts_by_outcome",
    "effects_by_status",
    "forget_replays",
    "in_flight_like",
    "mark_consumed",
    "mark_replay",
    "oldest_pending_age",
    "open_effect_counts",
    "run_counts",
    "succeeded_by_worker",
]


@dataclass(frozen=True)
class StateCounts:
    """What the metrics gauges show: runs by status, open effects by (status, kind)."""

    runs: dict[str, int] = field(default_factory=dict)
    effects: dict[tuple[str, str], int] = field(default_factory=dict)
    oldest_pending_seconds: float = 0.0


def run_counts() -> AnySelect:
    """Runs per status."""
    return select(runs.c.status, func.count()).group_by(runs.c.status)


def open_effect_counts() -> Any:
    """Unfinished effects per (status, kind); finished ones never enter the count.

    One branch per open status, each with its status as a literal, so each is
    read through that status's partial index (claimable, leased, dispatched,
    needs-operator) and never scans the finished rows.
    """
    return union_all(
        *(
            select(const(status.value).label("status"), effects.c.kind, func.count())
            .where(effects.c.status == const(status.value))
            .group_by(effects.c.kind)
            for status in OPEN_EFFECT_STATUSES
        )
    )


#: The claim index's leading columns: a lane is one (kind, priority, fairness key).
_LANE = ("kind", "priority", "fairness_key")


@cache
def oldest_pending_age(sharded: bool = False) -> AnySelect:
    """Seconds the oldest due pending effect has waited (0 when none is due): an index probe.

    Waited since it became due: since it was intended, or since its retry's
    time came. Read from the claim index (``outbox_effects_lanes``) alone,
    two probes per lane: a loose scan lists the lanes holding pending effects,
    and each lane's first entry is its longest-due one. A scan of every pending
    row took 0.3 s at a million, and the gauges are counted every few seconds.
    On Citus (``sharded``), which plans no recursive statement across shards,
    each shard's oldest is read and the least of them kept.
    """
    pending = const(EffectStatus.PENDING)
    if sharded:
        oldest = func.min(effects.c.available_at)
        return select(func.coalesce(func.extract("epoch", func.now() - oldest), 0)).where(
            effects.c.status == pending, effects.c.available_at <= func.now()
        )
    t = effects
    first = (
        select(*(t.c[c] for c in _LANE))
        .where(t.c.status == pending)
        .order_by(*(t.c[c] for c in _LANE))
        .limit(1)
    )
    lanes = first.cte("lanes", recursive=True)
    nl = effects.alias("nl")
    after = (
        select(*(nl.c[c] for c in _LANE))
        .where(
            nl.c.status == pending,
            tuple_(*(nl.c[c] for c in _LANE)) > tuple_(*(lanes.c[c] for c in _LANE)),
        )
        .order_by(*(nl.c[c] for c in _LANE))
        .limit(1)
        .lateral("nxt")
    )
    lanes = lanes.union_all(
        select(*(after.c[c] for c in _LANE)).select_from(lanes.join(after, true()))
    )
    head = effects.alias("head")
    due = (
        select(head.c.available_at)
        .where(
            head.c.status == pending,
            *(head.c[c] == lanes.c[c] for c in _LANE),
        )
        .order_by(head.c.available_at)
        .limit(1)
        .scalar_subquery()
    )
    heads = select(due.label("due")).select_from(lanes).subquery("heads")
    age = func.extract("epoch", func.now() - func.min(heads.c.due))
    return select(func.coalesce(age, 0)).where(heads.c.due <= func.now())


def _of_runs() -> Any:
    return effects.c.run_id == any_(bindparam("ids", type_=ARRAY(UUID(as_uuid=True))))


def effects_by_status() -> AnySelect:
    """Effects of the runs ``:ids`` per status."""
    return select(effects.c.status, func.count()).where(_of_runs()).group_by(effects.c.status)


def attempts_by_outcome() -> AnySelect:
    """Attempt-log rows of the effects of the runs ``:ids`` per outcome."""
    return (
        select(effect_attempts.c.outcome, func.count())
        .join(effects, effects.c.id == effect_attempts.c.effect_id)
        .where(_of_runs())
        .group_by(effect_attempts.c.outcome)
    )


def succeeded_by_worker() -> AnySelect:
    """Successful attempts on the effects of the runs ``:ids`` per worker (lease owner)."""
    return (
        select(effect_attempts.c.worker, func.count())
        .join(effects, effects.c.id == effect_attempts.c.effect_id)
        .where(_of_runs(), effect_attempts.c.outcome == "succeeded")
        .group_by(effect_attempts.c.worker)
    )


def in_flight_like() -> AnySelect:
    """How many effects are in flight under lease owners matching ``:pattern`` (SQL LIKE)."""
    return (
        select(func.count())
        .select_from(effects)
        .where(
            effects.c.status == const(EffectStatus.IN_FLIGHT),
            effects.c.lease_owner.like(bindparam("pattern", type_=Text)),
        )
    )


@cache
def mark_replay() -> Any:
    """Remember a webhook signature digest ``:digest``; returns it only the first time."""
    return (
        pg_insert(webhook_replays)
        .values(signature=bindparam("digest", type_=Text))
        .on_conflict_do_nothing()
        .returning(webhook_replays.c.signature)
    )


@cache
def forget_replays() -> Any:
    """Forget signatures older than ``:seconds`` (they fail the freshness check anyway)."""
    return delete(webhook_replays).where(
        webhook_replays.c.seen_at < func.now() - bindparam("seconds", type_=Float) * SECONDS
    )


@cache
def mark_consumed() -> Any:
    """A consumer group processed ``:key``; returns it only the first time."""
    return (
        pg_insert(consumed_keys)
        .values(
            consumer_group=bindparam("group", type_=Text),
            idempotency_key=bindparam("key", type_=Text),
        )
        .on_conflict_do_nothing()
        .returning(consumed_keys.c.idempotency_key)
    )
