"""Stream mode's SQL on effects: deliverers claim what a relay dispatched.

``dispatched`` is a claim the relay made for Kafka (``DISPATCH_QUEUE``, below);
a deliverer reading the record takes it over (fenced like any claim), and an
attempt nobody took within its ``dispatch_ttl`` goes back to ``pending``,
logged like every other change.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from typing import Any

from sqlalchemy import (
    ARRAY,
    Float,
    Integer,
    Text,
    any_,
    bindparam,
    func,
    null,
    or_,
    select,
)
from sqlalchemy.dialects.postgresql import UUID

from outbox.ids import RELAY_OWNER_PREFIX
from outbox.models import REDISPATCH, EffectStatus
from outbox.storage.schema import effects
from outbox.storage.sql.attempt_log import log_changes
from outbox.storage.sql.common import SECONDS, const, in_statuses, on_shard
from outbox.storage.sql.queue import EFFECT_QUEUE

__all__ = ["DISPATCH_QUEUE", "claim_dispatched", "redispatch_expired"]

#: A relay's claim: the poll claim's order, lanes and per-key rule, but the rows
#: go straight to ``dispatched`` (leased to the relay for the dispatch TTL), so
#: a publish costs one statement in PostgreSQL, not a claim and then a mark.
DISPATCH_QUEUE = replace(EFFECT_QUEUE, claimed=EffectStatus.DISPATCHED)


@cache
def claim_dispatched(sharded: bool = False) -> Any:
    """A stream deliverer claims dispatched effects it read from Kafka (others are skipped).

    Parameters: ``ids`` (array), ``owner``, ``lease_seconds``, and on Citus
    ``on_shard`` (the ids of one shard). An effect that is
    no longer ``dispatched`` (delivered already, or claimed through another copy
    of its record) is not returned: redelivered records are harmless.

    An effect in flight under a relay is taken too: a relay of an earlier
    version claimed into ``in_flight`` and marked the effects ``dispatched``
    only after the broker acknowledged them, so a quick consumer could read a
    record first. The record is the proof that the publish landed; that
    relay's later mark (fenced on its owner) changed nothing.
    """
    e = effects
    # Locked in id order: two deliverers reading copies of the same records wait
    # for each other, never deadlock.
    locked = (
        select(e.c.id)
        .where(
            e.c.id == any_(bindparam("ids", type_=ARRAY(UUID(as_uuid=True)))),
            # Found by id, never through the status indexes: written as "dispatched,
            # or in flight under a relay", the planner read every dispatched effect
            # (both arms match a partial index) and kept the batch's, 30,000 rows
            # for 100 when consumers lagged, since it cannot know how many are
            # dispatched (the statistics were taken while they were pending).
            in_statuses(e.c.status, ("dispatched", "in_flight")),
            or_(
                e.c.status == const("dispatched"),
                e.c.lease_owner.startswith(RELAY_OWNER_PREFIX, autoescape=True),
            ),
            *on_shard(effects, sharded),
        )
        .order_by(e.c.id)
        .with_for_update()
        .cte("locked")
    )
    return (
        e.update()
        .where(e.c.id == locked.c.id, *on_shard(effects, sharded))
        .values(
            status=const("in_flight"),
            lease_owner=bindparam("owner", type_=Text),
            lease_expires_at=func.now() + bindparam("lease_seconds", type_=Float) * SECONDS,
            # The relay's claim already counted this attempt and fenced it; a new
            # number comes with the next dispatch.
            attempt_started_at=func.now(),
            updated_at=func.now(),
        )
        # What a deliverer needs, as a poll claim returns it (never the large columns).
        .returning(*(e.c[name] for name in EFFECT_QUEUE.returning or ()))
    )


@cache
def redispatch_expired(sharded: bool = False) -> Any:
    """Dispatched effects nobody delivered within their TTL go back to ``pending`` (same key)."""
    due = (
        select(effects.c.id)
        .where(
            effects.c.status == const("dispatched"),
            effects.c.lease_expires_at < func.now(),
            *on_shard(effects, sharded),
        )
        .order_by(effects.c.lease_expires_at)
        .limit(bindparam("max_rows", type_=Integer))
        .with_for_update(skip_locked=True)
        .cte("due")
    )
    changed = (
        effects.update()
        .where(effects.c.id == due.c.id, *on_shard(effects, sharded))
        .values(
            status=const("pending"),
            # (a relay's claim named it; a pending effect is nobody's)
            lease_owner=null(),
            lease_expires_at=null(),
            available_at=func.now(),
            last_error=const("dispatched but not delivered in time: re-dispatching"),
            updated_at=func.now(),
        )
        .returning(effects.c.id, effects.c.attempt, effects.c.attempt_started_at, effects.c.shard)
        .cte("changed")
    )
    return log_changes(
        changed,
        worker=bindparam("worker", type_=Text),
        outcome=const("expired"),
        detail=func.jsonb_build_object("resolution", const(REDISPATCH)),
        sharded=sharded,
    )
