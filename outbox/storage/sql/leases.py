"""The heartbeat: an owner pushes out the leases it still holds, a claim at a time.

An id is matched with its attempt (the fencing token), so a lease that was
taken over is not extended: its id is missing from the result.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

from sqlalchemy import Float, Integer, SmallInteger, Text, bindparam, column, func
from sqlalchemy.dialects.postgresql import UUID

from outbox.storage.sql.common import SECONDS, const, json_param, not_by_index
from outbox.storage.sql.queue import QueueSpec

__all__ = ["extend_leases", "extend_params", "held_rows"]


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
    # a sharded spec's leases are extended a shard at a time (``part_shard``)
    on_shard = [t.c.shard == bindparam("part_shard", type_=SmallInteger)] if spec.sharded else []
    return (
        t.update()
        .where(
            t.c.id == held.c.id,
            t.c.attempt == held.c.attempt,
            t.c.lease_owner == bindparam("owner", type_=Text),
            # by id: every in-flight effect's lease, for a batch, when the
            # statistics thought few were in flight
            not_by_index(t.c.status) == const(spec.claimed),
            *on_shard,
        )
        .values(lease_expires_at=func.now() + bindparam("lease_seconds", type_=Float) * SECONDS)
        .returning(t.c.id)
    )
