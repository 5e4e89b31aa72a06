"""The claim / lease / fence mechanism, written once for both queues.

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
    Float,
    Integer,
    Table,
    Text,
    bindparam,
    column,
    exists,
    func,
    or_,
    select,
)
from sqlalchemy.dialects.postgresql import UUID
from sqlalchemy.sql.expression import ColumnElement

from outbox.models import OPEN_EFFECT_STATUSES, EffectStatus, RunStatus
from outbox.storage.schema import effects, runs
from outbox.storage.sql.common import SECONDS, AnySelect, const, in_statuses, json_param

__all__ = [
    "EFFECT_QUEUE",
    "RUN_QUEUE",
    "QueueSpec",
    "claim",
    "claim_params",
    "extend_leases",
    "extend_params",
    "held_rows",
]


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
    ready=EffectStatus.PENDING,
    claimed=EffectStatus.IN_FLIGHT,
    partition=("kind",),
    order=("available_at", "seq"),
    records_attempt_start=True,
    per_key_ordering=True,
)
RUN_QUEUE = QueueSpec(
    table=runs,
    ready=RunStatus.RUNNABLE,
    claimed=RunStatus.RUNNING,
    partition=("agent", "agent_version"),
    order=("available_at", "created_at"),
)


def _ordering_free(t: Table) -> ColumnElement[bool]:
    """No earlier effect with the same ordering key is still undecided."""
    prior = t.alias("prior")
    blocked = exists().where(
        prior.c.ordering_key == t.c.ordering_key,
        prior.c.seq < t.c.seq,
        in_statuses(prior.c.status, OPEN_EFFECT_STATUSES),  # an open effect holds back its key,
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
        "lease_expires_at": func.now() + bindparam("lease_seconds", type_=Float) * SECONDS,
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


def held_rows() -> Any:
    """The ``:held`` parameter (JSON ``[{id, attempt}]``) as a row set."""
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
    held = held_rows()
    return (
        t.update()
        .where(
            t.c.id == held.c.id,
            t.c.attempt == held.c.attempt,
            t.c.lease_owner == bindparam("owner", type_=Text),
            t.c.status == const(spec.claimed),
        )
        .values(lease_expires_at=func.now() + bindparam("lease_seconds", type_=Float) * SECONDS)
        .returning(t.c.id)
    )
