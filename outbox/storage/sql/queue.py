"""The claim / lease / fence mechanism, written once for both queues, and the delivery SQL.

Two queues live in PostgreSQL: runnable runs (claimed by agent workers) and
pending effects (claimed by deliverers). Both carry ``status``,
``available_at``, ``lease_owner``, ``lease_expires_at`` and ``attempt``. A
claim takes rows with ``FOR UPDATE SKIP LOCKED`` in one statement, marks them
claimed and increments ``attempt``: the attempt number is the fencing token.
Every later write about that attempt (heartbeat, completion, rescue) is a
compare-and-set on (status, owner, attempt), so a worker whose lease was taken
over changes nothing.

The statements are pure functions returning SQLAlchemy Core; no parameter is
named like a column (SQLAlchemy would add it to an UPDATE's SET).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from typing import Any

from sqlalchemy import (
    ARRAY,
    DateTime,
    Float,
    Integer,
    Table,
    Text,
    all_,
    and_,
    any_,
    bindparam,
    case,
    column,
    exists,
    func,
    null,
    or_,
    select,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, UUID
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.sql.expression import ColumnElement

from outbox.models import OPEN_EFFECT_STATUSES
from outbox.storage.schema import effect_attempts, effects, runs
from outbox.storage.sql.steps import RUNS_CHANNEL, AnySelect, const, json_param

__all__ = [
    "EFFECT_QUEUE",
    "RUN_QUEUE",
    "QueueSpec",
    "claim",
    "claim_dispatched",
    "claim_params",
    "complete_effects",
    "expire_effect",
    "expired_effects",
    "extend_leases",
    "extend_params",
    "mark_dispatched",
    "mark_unknown_kinds",
    "redispatch_expired",
    "resolve_unknown",
    "retry_failed",
    "take_over_effect",
]

_SECONDS = text("interval '1 second'")
TERMINAL_STATUSES = ("succeeded", "failed", "cancelled", "compensated")


@dataclass(frozen=True)
class QueueSpec:
    """What differs between the two queues."""

    table: Table
    ready: str
    claimed: str
    #: Columns a claim is scoped by (one claim per kind, or per agent and version).
    partition: tuple[str, ...]
    order: tuple[str, ...]
    records_attempt_start: bool = False
    per_key_ordering: bool = False


EFFECT_QUEUE = QueueSpec(
    table=effects,
    ready="pending",
    claimed="in_flight",
    partition=("kind",),
    order=("available_at", "seq"),
    records_attempt_start=True,
    per_key_ordering=True,
)
RUN_QUEUE = QueueSpec(
    table=runs,
    ready="runnable",
    claimed="running",
    partition=("agent", "agent_version"),
    order=("available_at", "created_at"),
)


def _in(col: ColumnElement[Any], values: tuple[str, ...]) -> ColumnElement[bool]:
    return col.in_([const(v) for v in values])


def _ordering_free(t: Table) -> ColumnElement[bool]:
    """No earlier effect with the same ordering key is still undecided."""
    prior = t.alias("prior")
    blocked = exists().where(
        prior.c.ordering_key == t.c.ordering_key,
        prior.c.seq < t.c.seq,
        _in(prior.c.status, OPEN_EFFECT_STATUSES),  # an open effect holds back its key,
    )
    return or_(t.c.ordering_key.is_(None), ~blocked)


@cache
def claim(spec: QueueSpec) -> AnySelect:
    """Claim up to ``claim_limit`` ready rows of one partition for ``owner``.

    Parameters: ``part_<column>`` for each partition column, ``claim_limit``,
    ``owner``, ``lease_seconds``. Returns the claimed rows, attempt incremented.
    """
    t = spec.table
    conditions: list[ColumnElement[bool]] = [
        t.c.status == const(spec.ready),
        t.c.available_at <= func.now(),
        *(t.c[name] == bindparam(f"part_{name}", type_=Text) for name in spec.partition),
    ]
    if spec.per_key_ordering:
        conditions.append(_ordering_free(t))
    picked = (
        select(t.c.id)
        .where(*conditions)
        .order_by(*(t.c[name] for name in spec.order))
        .limit(bindparam("claim_limit", type_=Integer))
        .with_for_update(skip_locked=True)
        .cte("picked")
    )
    values: dict[str, Any] = {
        "status": const(spec.claimed),
        "lease_owner": bindparam("owner", type_=Text),
        "lease_expires_at": func.now() + bindparam("lease_seconds", type_=Float) * _SECONDS,
        "attempt": t.c.attempt + 1,
        "updated_at": func.now(),
    }
    if spec.records_attempt_start:
        values["attempt_started_at"] = func.now()
    claimed = (
        t.update().where(t.c.id == picked.c.id).values(**values).returning(*t.c).cte("claimed")
    )
    return select(claimed).order_by(*(claimed.c[name] for name in spec.order))


def claim_params(
    partition: dict[str, str], *, limit: int, owner: str, lease_seconds: float
) -> dict[str, Any]:
    """Parameters of :func:`claim` for one partition."""
    params: dict[str, Any] = {f"part_{k}": v for k, v in partition.items()}
    params.update(claim_limit=limit, owner=owner, lease_seconds=lease_seconds)
    return params


def extend_params(held: Any, *, owner: str, lease_seconds: float) -> dict[str, Any]:
    """Parameters of :func:`extend_leases` for ``(id, attempt)`` pairs."""
    payload = json.dumps([{"id": str(i), "attempt": a} for i, a in held])
    return {"held": payload, "owner": owner, "lease_seconds": lease_seconds}


def _held() -> Any:
    return (
        func.jsonb_to_recordset(json_param("held"))
        .table_valued(column("id", UUID(as_uuid=True)), column("attempt", Integer))
        .render_derived(name="h", with_types=True)
    )


@cache
def extend_leases(spec: QueueSpec) -> Any:
    """Heartbeat: push out the leases ``owner`` still holds; returns the ids still held.

    Parameters: ``owner``, ``lease_seconds``, ``held`` (JSON ``[{id, attempt}]``).
    An id missing from the result was taken over: its lease is lost.
    """
    t = spec.table
    held = _held()
    return (
        t.update()
        .where(
            t.c.id == held.c.id,
            t.c.attempt == held.c.attempt,
            t.c.lease_owner == bindparam("owner", type_=Text),
            t.c.status == const(spec.claimed),
        )
        .values(lease_expires_at=func.now() + bindparam("lease_seconds", type_=Float) * _SECONDS)
        .returning(t.c.id)
    )


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


@cache
def complete_effects() -> Any:
    """Record the outcomes of a batch of attempts, fenced, with their attempt log.

    Parameters: ``owner``, ``done`` (a JSON array of ``{id, attempt, status,
    outcome, result, error, delay, detail, started_at}``) and ``ids`` (the same
    ids). A row changes only while it still holds that attempt: in flight under
    ``owner``, or set aside by the reconciler (``unknown``, or back to ``pending``) without a newer
    attempt having started, in which case this late answer is the truth about
    that attempt. Otherwise the completion is stale: it is logged as ``stale``
    (with what it reported) and changes nothing else (G4).
    Returns ``(effect_id, outcome)`` per logged attempt.
    """
    e = effects
    d = _done()
    ours = e.c.lease_owner == bindparam("owner", type_=Text)
    holds_attempt = and_(
        # The planner cannot estimate a recordset's size; naming the ids keeps it
        # on the primary key instead of a scan of every open effect.
        e.c.id == any_(bindparam("ids", type_=ARRAY(UUID(as_uuid=True)))),
        e.c.id == d.c.id,
        e.c.attempt == d.c.attempt,
        or_(
            and_(e.c.status == const("in_flight"), ours),
            _in(e.c.status, ("unknown", "pending")),
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
                (d.c.status == const("pending"), func.now() + d.c.delay * _SECONDS),
                else_=e.c.available_at,
            ),
            lease_owner=null(),
            lease_expires_at=null(),
            completed_at=case((_in(d.c.status, TERMINAL_STATUSES), func.now()), else_=null()),
            updated_at=func.now(),
        )
        .returning(e.c.id, e.c.status, e.c.awaited_by)
        .cte("updated")
    )
    # A run parked on one of these effects (``run.await_effect``) goes on now. The
    # park wrote ``awaited_by`` on the effect row, so this statement sees it even
    # when the park committed while it waited for that row's lock; the run row is
    # then re-read at its latest version, which is why its state is tested in the
    # SET (a WHERE on status would be judged on the older version).
    terminal = _in(updated.c.status, TERMINAL_STATUSES)
    woke = and_(runs.c.status == const("waiting"), runs.c.wait_effect == updated.c.id)
    woken = (
        runs.update()
        .where(runs.c.id == updated.c.awaited_by, terminal)
        .values(
            status=case((woke, const("runnable")), else_=runs.c.status),
            available_at=case((woke, func.now()), else_=runs.c.available_at),
            wake_at=case((woke, null()), else_=runs.c.wake_at),
            wait_effect=case((woke, null()), else_=runs.c.wait_effect),
        )
        .returning(runs.c.id, func.pg_notify(RUNS_CHANNEL, ""))
        .cte("woken")
    )
    d2 = _done()
    stale = updated.c.id.is_(None)
    logged = select(
        d2.c.id,
        d2.c.attempt,
        bindparam("owner", type_=Text),
        d2.c.started_at,
        case((stale, const("stale")), else_=d2.c.outcome),
        case(
            (stale, func.jsonb_build_object("reported", d2.c.outcome, "detail", d2.c.detail)),
            else_=d2.c.detail,
        ),
    ).select_from(d2.outerjoin(updated, updated.c.id == d2.c.id))
    return (
        pg_insert(effect_attempts)
        .from_select(["effect_id", "attempt", "worker", "started_at", "outcome", "detail"], logged)
        .returning(effect_attempts.c.effect_id, effect_attempts.c.outcome)
        .add_cte(woken)
    )


def expired_effects() -> AnySelect:
    """In-flight effects whose lease ran out (their deliverer died or stalled), oldest first."""
    return (
        select(effects)
        .where(effects.c.status == const("in_flight"), effects.c.lease_expires_at < func.now())
        .order_by(effects.c.lease_expires_at)
        .limit(bindparam("max_rows", type_=Integer))
    )


def _expired_cas() -> list[ColumnElement[bool]]:
    return [
        effects.c.id == bindparam("effect_id", type_=UUID(as_uuid=True)),
        effects.c.attempt == bindparam("expected_attempt", type_=Integer),
        effects.c.status == const("in_flight"),
        effects.c.lease_expires_at < func.now(),
    ]


def _log_changes(changed: Any, *, worker: Any, outcome: Any, detail: Any = None) -> Any:
    """Insert one attempt-log row per row a ``changed`` CTE returned.

    ``changed`` must return ``id``, ``attempt`` and ``attempt_started_at``; when
    it returns nothing (another process won the compare-and-set), nothing is logged.
    """
    return (
        pg_insert(effect_attempts)
        .from_select(
            ["effect_id", "attempt", "worker", "started_at", "outcome", "detail"],
            select(
                changed.c.id,
                changed.c.attempt,
                worker,
                changed.c.attempt_started_at,
                outcome,
                null() if detail is None else detail,
            ),
        )
        .returning(effect_attempts.c.effect_id)
    )


@cache
def expire_effect() -> Any:
    """Resolve one expired attempt as ``new_status`` (pending | unknown | failed), logged.

    Parameters: ``effect_id``, ``expected_attempt``, ``new_status``, ``note``,
    ``resolution``, ``worker``. Changes nothing (and logs nothing) when another
    reconciler or a late completion got there first.
    """
    changed = (
        effects.update()
        .where(*_expired_cas())
        .values(
            status=bindparam("new_status", type_=Text),
            lease_owner=null(),
            lease_expires_at=null(),
            available_at=func.now(),
            last_error=bindparam("note", type_=Text),
            completed_at=case(
                (bindparam("new_status", type_=Text) == const("failed"), func.now()), else_=null()
            ),
            updated_at=func.now(),
        )
        .returning(effects.c.id, effects.c.attempt, effects.c.attempt_started_at)
        .cte("changed")
    )
    return _log_changes(
        changed,
        worker=bindparam("worker", type_=Text),
        outcome=const("expired"),
        detail=func.jsonb_build_object(
            "resolution",
            bindparam("resolution", type_=Text),
            "note",
            bindparam("note", type_=Text),
        ),
    )


@cache
def take_over_effect() -> Any:
    """Lease an expired attempt to the reconciler (same attempt) while it asks the sink."""
    return (
        effects.update()
        .where(*_expired_cas())
        .values(
            lease_owner=bindparam("owner", type_=Text),
            lease_expires_at=func.now() + bindparam("lease_seconds", type_=Float) * _SECONDS,
            updated_at=func.now(),
        )
        .returning(effects.c.id)
    )


def _operator_change(from_status: str, values: dict[str, Any], outcome: str) -> Any:
    changed = (
        effects.update()
        .where(
            effects.c.id == bindparam("effect_id", type_=UUID(as_uuid=True)),
            effects.c.status == const(from_status),
        )
        .values(**values, lease_owner=null(), lease_expires_at=null(), updated_at=func.now())
        .returning(effects.c.id, effects.c.attempt, effects.c.attempt_started_at)
        .cte("changed")
    )
    return _log_changes(
        changed,
        worker=bindparam("operator", type_=Text),
        outcome=const(outcome),
        detail=json_param("detail"),
    )


@cache
def resolve_unknown() -> Any:
    """An operator closes an ``unknown`` effect as ``new_status``; logged with who and why.

    Parameters: ``effect_id``, ``new_status``, ``operator``, ``detail`` (JSON).
    """
    new_status = bindparam("new_status", type_=Text)
    return _operator_change(
        "unknown",
        {
            "status": new_status,
            "available_at": func.now(),
            "completed_at": case((new_status == const("pending"), null()), else_=func.now()),
        },
        "resolved",
    )


@cache
def retry_failed() -> Any:
    """Put a ``failed`` effect back to ``pending`` with ``extra_attempts`` more tries."""
    return _operator_change(
        "failed",
        {
            "status": const("pending"),
            "available_at": func.now(),
            "completed_at": null(),
            "max_attempts": effects.c.attempt + bindparam("extra_attempts", type_=Integer),
        },
        "retried",
    )


# -- stream mode (Kafka) -----------------------------------------------------------------

RELAY_OWNER_PREFIX = "relay:"


@cache
def mark_dispatched() -> Any:
    """The relay published these attempts to Kafka: ``dispatched`` until ``dispatch_ttl`` runs out.

    Parameters: ``owner`` (the relay), ``held`` (JSON ``[{id, attempt}]``),
    ``dispatch_ttl`` (seconds). Fenced like a completion; logged as ``dispatched``.
    """
    held = _held()
    changed = (
        effects.update()
        .where(
            effects.c.id == held.c.id,
            effects.c.attempt == held.c.attempt,
            effects.c.status == const("in_flight"),
            effects.c.lease_owner == bindparam("owner", type_=Text),
        )
        .values(
            status=const("dispatched"),
            lease_owner=null(),
            lease_expires_at=func.now() + bindparam("dispatch_ttl", type_=Float) * _SECONDS,
            updated_at=func.now(),
        )
        .returning(effects.c.id, effects.c.attempt, effects.c.attempt_started_at)
        .cte("changed")
    )
    return _log_changes(changed, worker=bindparam("owner", type_=Text), outcome=const("dispatched"))


@cache
def claim_dispatched() -> Any:
    """A stream deliverer claims dispatched effects it read from Kafka (others are skipped).

    Parameters: ``ids`` (array), ``owner``, ``lease_seconds``. An effect that is
    no longer ``dispatched`` (delivered already, or claimed through another copy
    of its record) is not returned: redelivered records are harmless.

    An effect still held by a relay is taken too: the relay marks effects
    dispatched only after the broker acknowledged them, so a quick consumer
    reads the record first. The record is the proof that the publish landed;
    the relay's later mark (fenced on its owner) then changes nothing.
    """
    e = effects
    return (
        e.update()
        .where(
            e.c.id == any_(bindparam("ids", type_=ARRAY(UUID(as_uuid=True)))),
            or_(
                e.c.status == const("dispatched"),
                and_(
                    e.c.status == const("in_flight"),
                    e.c.lease_owner.startswith(RELAY_OWNER_PREFIX, autoescape=True),
                ),
            ),
        )
        .values(
            status=const("in_flight"),
            lease_owner=bindparam("owner", type_=Text),
            lease_expires_at=func.now() + bindparam("lease_seconds", type_=Float) * _SECONDS,
            # The relay's claim already counted this attempt and fenced it; a new
            # number comes with the next dispatch.
            attempt_started_at=func.now(),
            updated_at=func.now(),
        )
        .returning(*e.c)
    )


@cache
def redispatch_expired() -> Any:
    """Dispatched effects nobody delivered within their TTL go back to ``pending`` (same key)."""
    due = (
        select(effects.c.id)
        .where(effects.c.status == const("dispatched"), effects.c.lease_expires_at < func.now())
        .order_by(effects.c.lease_expires_at)
        .limit(bindparam("max_rows", type_=Integer))
        .with_for_update(skip_locked=True)
        .cte("due")
    )
    changed = (
        effects.update()
        .where(effects.c.id == due.c.id)
        .values(
            status=const("pending"),
            lease_expires_at=null(),
            available_at=func.now(),
            last_error=const("dispatched but not delivered in time: re-dispatching"),
            updated_at=func.now(),
        )
        .returning(effects.c.id, effects.c.attempt, effects.c.attempt_started_at)
        .cte("changed")
    )
    return _log_changes(
        changed,
        worker=bindparam("worker", type_=Text),
        outcome=const("expired"),
        detail=func.jsonb_build_object("resolution", const("re-dispatch")),
    )


@cache
def mark_unknown_kinds() -> Any:
    """Note on pending effects that no deliverer here knows their kind (status unchanged).

    Parameters: ``known`` (array of kinds), ``grace_seconds``, ``max_rows``, ``note_prefix``.
    """
    note = func.concat(bindparam("note_prefix", type_=Text), effects.c.kind)
    target = (
        select(effects.c.id)
        .where(
            effects.c.status == const("pending"),
            effects.c.kind != all_(bindparam("known", type_=ARRAY(Text))),
            effects.c.created_at < func.now() - bindparam("grace_seconds", type_=Float) * _SECONDS,
            effects.c.last_error.is_distinct_from(note),
        )
        .limit(bindparam("max_rows", type_=Integer))
        .cte("target")
    )
    return (
        effects.update()
        .where(effects.c.id == target.c.id)
        .values(last_error=note, updated_at=func.now())
        .returning(effects.c.id)
    )
