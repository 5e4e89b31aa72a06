"""What the operator console reads: pages of runs and effects, one run, one effect, the overview.

Every list is a keyset page (``WHERE (sort key) < :after ORDER BY sort key DESC
LIMIT n``) served by an index, so a page costs the same on the first page and
the thousandth, whatever the table size. None of these statements is on the
intent, claim or completion path, and none takes a lock.

Runs are listed newest first by ``(created_at, id)`` (index
``outbox_runs_created``); effects by ``id``, a UUIDv7 (time-ordered: the
primary key serves newest-first); the unknown and failed queues by ``seq``
(``outbox_effects_needs_operator``).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any
from uuid import UUID

from sqlalchemy import (
    DateTime,
    Float,
    Integer,
    Text,
    and_,
    bindparam,
    func,
    literal_column,
    select,
    tuple_,
)
from sqlalchemy.dialects.postgresql import UUID as PG_UUID
from sqlalchemy.dialects.postgresql import insert as pg_insert

from outbox.models import EffectStatus
from outbox.storage.schema import (
    budget_ledger,
    effect_attempts,
    effects,
    runs,
    signals,
    steps,
    webhook_replays,
)
from outbox.storage.sql.common import SECONDS, AnySelect, const

__all__ = [
    "RUN_LIST_COLUMNS",
    "compensations_of",
    "delivery_by_minute",
    "effect_page",
    "effects_of_run",
    "ledger_of_run",
    "operator_queue",
    "revoke_session",
    "run_by_key",
    "runs_page",
    "session_revoked",
    "signals_of_run",
    "steps_of_run",
]

#: A run row in a list: no inputs, state or plan (they can be large).
RUN_LIST_COLUMNS = (
    runs.c.id,
    runs.c.agent,
    runs.c.agent_version,
    runs.c.status,
    runs.c.current_step,
    runs.c.created_at,
    runs.c.updated_at,
    runs.c.budget,
    runs.c.spent,
    runs.c.reserved,
    runs.c.wake_at,
    runs.c.wait_signal,
    runs.c.cancel_reason,
)

#: An effect row in a list: no payload, result or compensation.
EFFECT_LIST_COLUMNS = (
    effects.c.id,
    effects.c.seq,
    effects.c.run_id,
    effects.c.step_id,
    effects.c.kind,
    effects.c.idempotency_key,
    effects.c.ordering_key,
    effects.c.status,
    effects.c.attempt,
    effects.c.last_error,
    effects.c.lease_owner,
    effects.c.lease_expires_at,
    effects.c.created_at,
    effects.c.completed_at,
)


def runs_page(
    *,
    agent: str | None = None,
    version: str | None = None,
    status: str | None = None,
    newer_than_s: float | None = None,
    older_than_s: float | None = None,
    after: tuple[datetime, UUID] | None = None,
    limit: int = 50,
) -> tuple[AnySelect, dict[str, Any]]:
    """One page of runs, newest first, after the keyset cursor ``after``."""
    query = select(*RUN_LIST_COLUMNS).order_by(runs.c.created_at.desc(), runs.c.id.desc())
    params: dict[str, Any] = {"lim": limit}
    if agent:
        query = query.where(runs.c.agent == bindparam("agent", type_=Text))
        params["agent"] = agent
    if version:
        query = query.where(runs.c.agent_version == bindparam("version", type_=Text))
        params["version"] = version
    if status:
        query = query.where(runs.c.status == bindparam("status", type_=Text))
        params["status"] = status
    if newer_than_s is not None:
        query = query.where(
            runs.c.created_at > func.now() - bindparam("newer", type_=Float) * SECONDS
        )
        params["newer"] = newer_than_s
    if older_than_s is not None:
        query = query.where(
            runs.c.created_at < func.now() - bindparam("older", type_=Float) * SECONDS
        )
        params["older"] = older_than_s
    if after is not None:
        query = query.where(
            tuple_(runs.c.created_at, runs.c.id)
            < tuple_(
                bindparam("after_at", type_=DateTime(timezone=True)),
                bindparam("after_id", type_=PG_UUID(as_uuid=True)),
            )
        )
        params["after_at"], params["after_id"] = after
    return query.limit(bindparam("lim", type_=Integer)), params


def run_by_key() -> AnySelect:
    """The run (and effect) holding idempotency key ``:key``."""
    return select(effects.c.run_id, effects.c.id).where(
        effects.c.idempotency_key == bindparam("key", type_=Text)
    )


def steps_of_run() -> AnySelect:
    """The steps of run ``:run_id`` in the order they were recorded (at most ``:lim``)."""
    return (
        select(steps)
        .where(steps.c.run_id == bindparam("run_id", type_=PG_UUID(as_uuid=True)))
        .order_by(steps.c.seq)
        .limit(bindparam("lim", type_=Integer))
    )


def signals_of_run() -> AnySelect:
    """The signals sent to run ``:run_id``, oldest first (at most ``:lim``)."""
    return (
        select(signals)
        .where(signals.c.run_id == bindparam("run_id", type_=PG_UUID(as_uuid=True)))
        .order_by(signals.c.created_at)
        .limit(bindparam("lim", type_=Integer))
    )


def ledger_of_run() -> AnySelect:
    """The budget ledger of run ``:run_id``, oldest first (at most ``:lim``)."""
    return (
        select(budget_ledger)
        .where(budget_ledger.c.run_id == bindparam("run_id", type_=PG_UUID(as_uuid=True)))
        .order_by(budget_ledger.c.id)
        .limit(bindparam("lim", type_=Integer))
    )


def released_of_run() -> AnySelect:
    """What run ``:run_id``'s budget got back: the sum of its ``release`` entries (by its index)."""
    return select(func.coalesce(func.sum(budget_ledger.c.amount), 0)).where(
        budget_ledger.c.run_id == bindparam("run_id", type_=PG_UUID(as_uuid=True)),
        budget_ledger.c.entry == const("release"),
    )


def effects_of_run() -> AnySelect:
    """The effects of run ``:run_id`` in intent order (at most ``:lim``)."""
    return (
        select(*EFFECT_LIST_COLUMNS)
        .where(effects.c.run_id == bindparam("run_id", type_=PG_UUID(as_uuid=True)))
        .order_by(effects.c.seq)
        .limit(bindparam("lim", type_=Integer))
    )


def effect_page(
    *,
    status: str | None = None,
    kind: str | None = None,
    after: UUID | None = None,
    limit: int = 50,
) -> tuple[AnySelect, dict[str, Any]]:
    """One page of effects, newest first (UUIDv7 order), after the cursor ``after``."""
    query = select(*EFFECT_LIST_COLUMNS).order_by(effects.c.id.desc())
    params: dict[str, Any] = {"lim": limit}
    if status:
        # A literal, so the planner can pick the partial index of that status.
        query = query.where(effects.c.status == const(EffectStatus(status).value))
    if kind:
        query = query.where(effects.c.kind == bindparam("kind", type_=Text))
        params["kind"] = kind
    if after is not None:
        query = query.where(effects.c.id < bindparam("after", type_=PG_UUID(as_uuid=True)))
        params["after"] = after
    return query.limit(bindparam("lim", type_=Integer)), params


def operator_queue(
    status: str, *, after: int | None, limit: int
) -> tuple[AnySelect, dict[str, Any]]:
    """``unknown`` or ``failed`` effects, oldest first, with their last attempt's record."""
    last = (
        select(effect_attempts.c.outcome, effect_attempts.c.detail, effect_attempts.c.worker)
        # by shard too: on Citus a join between distributed tables must name it
        .where(
            effect_attempts.c.effect_id == effects.c.id,
            effect_attempts.c.shard == effects.c.shard,
        )
        .order_by(effect_attempts.c.id.desc())
        .limit(1)
        .lateral("last")
    )
    query = (
        select(
            *EFFECT_LIST_COLUMNS,
            effects.c.attempt_started_at,
            last.c.outcome.label("last_outcome"),
            last.c.detail.label("last_detail"),
            last.c.worker.label("last_worker"),
        )
        .select_from(effects.outerjoin(last, literal_column("true")))
        .where(effects.c.status == const(EffectStatus(status).value))
        .order_by(effects.c.seq)
    )
    params: dict[str, Any] = {"lim": limit}
    if after is not None:
        query = query.where(effects.c.seq > bindparam("after", type_=Integer))
        params["after"] = after
    return query.limit(bindparam("lim", type_=Integer)), params


def compensations_of() -> AnySelect:
    """Effects that undo effect ``:effect_id`` (index ``outbox_effects_compensates``)."""
    return select(effects.c.id, effects.c.kind, effects.c.status).where(
        effects.c.compensates == bindparam("effect_id", type_=PG_UUID(as_uuid=True))
    )


def delivery_by_minute() -> AnySelect:
    """Succeeded effects per minute over the last ``:seconds``, and their latency.

    Latency is intent to completion. Read by ``outbox_effects_finished``
    (completed_at), so only the window's rows are visited.
    """
    minute = func.date_trunc("minute", effects.c.completed_at).label("minute")
    latency = func.extract("epoch", effects.c.completed_at - effects.c.created_at)
    return (
        select(
            minute,
            func.count().label("delivered"),
            func.percentile_cont(0.5).within_group(latency).label("p50"),
            func.percentile_cont(0.95).within_group(latency).label("p95"),
        )
        .where(
            and_(
                effects.c.completed_at.is_not(None),
                effects.c.completed_at > func.now() - bindparam("seconds", type_=Float) * SECONDS,
                effects.c.status == const(EffectStatus.SUCCEEDED),
            )
        )
        .group_by(minute)
        .order_by(minute)
    )


# -- signed-out console sessions ----------------------------------------------------------
#
# A console session is a signed cookie; signing out must make a copy of it
# worthless on every server process. Its MAC is a signature like a webhook's,
# so a spent one goes where spent webhook signatures go: ``outbox_webhook_replays``,
# under a prefix of its own, with ``seen_at`` set to the session's expiry. Both
# forgetting rules (the signal endpoint's, and gc's) delete rows whose
# ``seen_at`` is in the past, so the mark lives as long as the cookie could.


def revoke_session() -> Any:
    """Mark session digest ``:digest`` spent until ``:until`` (idempotent)."""
    return (
        pg_insert(webhook_replays)
        .values(
            signature=bindparam("digest", type_=Text),
            seen_at=bindparam("until", type_=DateTime(timezone=True)),
        )
        .on_conflict_do_nothing()
    )


def session_revoked() -> Any:
    """One row when session digest ``:digest`` was signed out."""
    return select(literal_column("1")).where(
        webhook_replays.c.signature == bindparam("digest", type_=Text)
    )
