"""An operator's changes to one effect: resolve an ``unknown`` one, retry a ``failed`` one.

Each is a compare-and-set on the effect's status, logged in the attempt log
with who and why in the same statement (on Citus: after it, on the shard).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from sqlalchemy import Integer, SmallInteger, Text, and_, bindparam, exists, func, null
from sqlalchemy.dialects.postgresql import UUID

from outbox.models import STOPPING_RUN_STATUSES
from outbox.storage.schema import effects, runs
from outbox.storage.sql.attempt_log import log_changes
from outbox.storage.sql.common import const, in_statuses, json_param

__all__ = ["resolve_unknown", "retry_failed"]


def _operator_change(
    from_status: str, values: dict[str, Any], outcome: str, sharded: bool, *, reopen: bool
) -> Any:
    # Named with its shard (looked up first; its run's too): Citus would lock every
    # shard's rows by id alone, and logs after it there. Claims do not look at
    # runs: an original reopened while its run stops would go out.
    run = (runs.c.id == effects.c.run_id, runs.c.shard == bindparam("effect_shard"))
    stops = exists().where(*run, in_statuses(runs.c.status, STOPPING_RUN_STATUSES))
    stopping = and_(effects.c.compensates.is_(None), stops)
    changed = (
        effects.update()
        .where(
            effects.c.id == bindparam("effect_id", type_=UUID(as_uuid=True)),
            effects.c.shard == bindparam("effect_shard", type_=SmallInteger),
            effects.c.status == const(from_status),
            *([~stopping] if reopen else []),
        )
        .values(**values, lease_owner=null(), lease_expires_at=null(), updated_at=func.now())
        .returning(effects.c.id, effects.c.attempt, effects.c.attempt_started_at, effects.c.shard)
        .cte("changed")
    )
    return log_changes(
        changed,
        worker=bindparam("operator", type_=Text),
        outcome=const(outcome),
        detail=json_param("detail"),
        sharded=sharded,
    )


@cache
def resolve_unknown(sharded: bool = False, *, reopen: bool) -> Any:
    """An operator closes an ``unknown`` effect as ``new_status``; logged with who and why.

    Parameters: ``effect_id``, ``effect_shard``, ``new_status``, ``operator``,
    ``detail`` (JSON). ``reopen``: ``new_status`` is ``pending``, so the effect
    is not completed (a statement each: Citus refuses ``now()`` inside CASE in
    an UPDATE), and not while its run is stopping (nothing changes).
    """
    return _operator_change(
        "unknown",
        {
            "status": bindparam("new_status", type_=Text),
            "available_at": func.now(),
            "completed_at": null() if reopen else func.now(),
        },
        "resolved",
        sharded,
        reopen=reopen,
    )


@cache
def retry_failed(sharded: bool = False) -> Any:
    """Put a ``failed`` effect back to ``pending`` with ``extra_attempts`` more tries.

    Parameters: ``effect_id``, ``effect_shard``, ``extra_attempts``, ``operator``,
    ``detail`` (JSON). Not while its run is stopping (nothing changes).
    """
    return _operator_change(
        "failed",
        {
            "status": const("pending"),
            "available_at": func.now(),
            "completed_at": null(),
            "max_attempts": effects.c.attempt + bindparam("extra_attempts", type_=Integer),
        },
        "retried",
        sharded,
        reopen=True,
    )
