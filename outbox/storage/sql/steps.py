"""The client library's reads of runs, steps and effects, as SQLAlchemy Core statements.

Nothing here touches a connection; :mod:`outbox.storage.store` executes these.
The writes (a run's start, a step, intents, a run's end) are the functions of
``outbox/storage/functions``, called by :mod:`outbox.storage.writes`; the queue
statements shared by runs and effects live in :mod:`outbox.storage.sql.queue`.
"""

from __future__ import annotations

from sqlalchemy import (
    SmallInteger,
    Text,
    bindparam,
    func,
    select,
    tuple_,
)
from sqlalchemy.dialects.postgresql import ARRAY as postgresql_array
from sqlalchemy.dialects.postgresql import UUID

from outbox.models import TERMINAL_EFFECT_STATUSES
from outbox.storage.schema import effects, runs, steps
from outbox.storage.side_tables import effect_keys
from outbox.storage.sql.common import (
    AnySelect,
    in_statuses,
    shard_of,
)

__all__ = [
    "effect_key_owner",
    "effect_on_shard",
    "finished_effects",
    "list_effects",
    "list_runs",
    "run_with_steps",
]


def effect_key_owner() -> AnySelect:
    """The effect and run (if any) holding a caller's ``:key`` in ``:namespace``."""
    namespace, key = bindparam("namespace", type_=Text), bindparam("key", type_=Text)
    return select(effect_keys.c.effect_id, effect_keys.c.run_id).where(
        effect_keys.c.namespace == namespace,
        effect_keys.c.key == key,
        effect_keys.c.shard == func.outbox_key_shard(namespace, key, type_=SmallInteger),
        effect_keys.c.mirror.is_(False),
    )


def effect_on_shard() -> AnySelect:
    """The effect ``:id`` on shard ``:home`` (its run's, or its own when it has none)."""
    return select(effects).where(
        effects.c.id == bindparam("id", type_=UUID(as_uuid=True)),
        effects.c.shard == bindparam("home", type_=SmallInteger),
    )


def run_with_steps(*, one_step: bool = False) -> tuple[AnySelect, AnySelect]:
    """The run ``:run_id`` and its recorded steps in order (``one_step``: only ``:step_id``)."""
    run_id = bindparam("run_id", type_=UUID(as_uuid=True))
    steps_q = select(steps).where(steps.c.run_id == run_id, steps.c.shard == shard_of(run_id))
    if one_step:
        steps_q = steps_q.where(steps.c.step_id == bindparam("step_id"))
    return (
        select(runs).where(runs.c.id == run_id, runs.c.shard == shard_of(run_id)),
        steps_q.order_by(steps.c.seq),
    )


def list_runs(
    *,
    status: str | None = None,
    agent: str | None = None,
    limit: int = 100,
    before: object = None,
) -> AnySelect:
    """Most recent runs first, optionally filtered; ``before`` (a run id): the page after it."""
    query = select(runs).order_by(runs.c.created_at.desc(), runs.c.id.desc()).limit(limit)
    if before is not None:
        since = select(runs.c.created_at).where(runs.c.id == before).scalar_subquery()
        query = query.where(tuple_(runs.c.created_at, runs.c.id) < tuple_(since, before))
    if status is not None:
        query = query.where(runs.c.status == status)
    if agent is not None:
        query = query.where(runs.c.agent == agent)
    return query


def list_effects(
    *,
    run_id: object = None,
    step_id: str | None = None,
    status: str | None = None,
    kind: str | None = None,
    limit: int = 100,
    newest_first: bool = False,
    before: object = None,
) -> AnySelect:
    """Effects in intent order, optionally filtered by run (and step), status or kind.

    ``newest_first`` reverses the order; ``before`` (an effect id) starts the
    page after that effect, in the same order.
    """
    order = effects.c.seq.desc() if newest_first else effects.c.seq
    query = select(effects).order_by(order).limit(limit)
    if before is not None:
        anchor = select(effects.c.seq).where(effects.c.id == before).scalar_subquery()
        query = query.where(effects.c.seq < anchor if newest_first else effects.c.seq > anchor)
    if run_id is not None:
        # a run's effects live on its shard: on Citus this read goes to one node
        query = query.where(effects.c.run_id == run_id, effects.c.shard == shard_of(run_id))
    if step_id is not None:
        query = query.where(effects.c.step_id == step_id)
    if status is not None:
        query = query.where(effects.c.status == status)
    if kind is not None:
        query = query.where(effects.c.kind == kind)
    return query


def finished_effects() -> AnySelect:
    """Of the effects ``:ids``, those that can no longer change by delivery (one index probe each).

    Awaiting effects (``outbox serve``'s long poll) asks this for every awaited
    id at once, so a hundred waiters cost one query per poll, not a hundred.
    """
    ids = bindparam("ids", type_=postgresql_array(UUID(as_uuid=True)))
    return select(effects).where(
        effects.c.id == func.any(ids),
        in_statuses(effects.c.status, TERMINAL_EFFECT_STATUSES),
    )
