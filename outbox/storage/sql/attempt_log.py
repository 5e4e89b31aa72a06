"""The attempt log: one row per attempt a statement changed, chained by id order.

What the log says of an effect whose attempt was lost is :func:`lost_without_answer`.

:func:`log_changes` logs the rows an ``UPDATE ... RETURNING`` CTE changed, in
the same statement on one server. On Citus the statement selects them instead
and :func:`log_attempts` inserts them after it: Citus would split an
``INSERT ... SELECT`` from a CTE or a recordset into sub-plans, collect their
rows on the coordinator and write them back in a transaction of their own (two
phases), and the id sequence keeps it out of any router plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

from sqlalchemy import JSON, bindparam, exists, null, select
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert

from outbox.models import REDISPATCH, AttemptOutcome
from outbox.storage.schema import effect_attempts, effects
from outbox.storage.sql.common import const, in_statuses

__all__ = [
    "LOGGED_ATTEMPT",
    "labelled",
    "log_attempts",
    "log_changes",
    "log_selected",
    "lost_without_answer",
]


#: The attempt-log columns a completion writes, in the order of its selected rows.
LOGGED_ATTEMPT = (
    "effect_id",
    "attempt",
    "worker",
    "started_at",
    "finished_at",
    "outcome",
    "detail",
    "shard",
    "effect_status",
    "result_hash",
    "hash",
)


def labelled(values: Sequence[Any], columns: Sequence[str] = LOGGED_ATTEMPT) -> list[Any]:
    """``values`` named as the attempt-log ``columns`` they are written to, in order."""
    return [value.label(name) for value, name in zip(values, columns, strict=True)]


@cache
def log_attempts(rows: int, columns: tuple[str, ...] = LOGGED_ATTEMPT) -> Any:
    """Attempt-log rows a sharded statement selected (``complete_effects``, ``log_changes``).

    Parameters ``<column>_<n>`` for each of ``columns`` and each row ``n``. One
    multi-row ``VALUES``: Citus draws the ids on the coordinator in row order
    (chain order is id order) and routes the rows, all of one shard, to its
    node. Returns ``(effect_id, outcome)`` per row.
    """
    # a selected SQL NULL stays NULL (a JSON column would bind None as JSON 'null',
    # and the row's link was computed over NULL)
    types = {c: effect_attempts.c[c].type for c in columns}
    types = {c: JSONB(none_as_null=True) if isinstance(t, JSON) else t for c, t in types.items()}
    return (
        pg_insert(effect_attempts)
        .values([{c: bindparam(f"{c}_{n}", type_=types[c]) for c in columns} for n in range(rows)])
        .returning(effect_attempts.c.effect_id, effect_attempts.c.outcome)
    )


def log_selected(rows: Sequence[Mapping[Any, Any]]) -> tuple[Any, dict[str, Any]]:
    """The insert of attempt-log ``rows`` a sharded statement selected, and its parameters.

    Columns the log has no place for (``wakes``) are left out.
    """
    columns = tuple(c for c in rows[0] if c in LOGGED_ATTEMPT)
    values = {f"{c}_{n}": row[c] for n, row in enumerate(rows) for c in columns}
    return log_attempts(len(rows), columns), values


def log_changes(
    changed: Any, *, worker: Any, outcome: Any, detail: Any = None, sharded: bool = False
) -> Any:
    """Insert one attempt-log row per row a ``changed`` CTE returned.

    ``changed`` must return ``id``, ``attempt``, ``attempt_started_at`` and ``shard``; when
    it returns nothing (another process won the compare-and-set), nothing is logged.
    With ``sharded`` the rows are selected, not inserted: the caller inserts them
    with :func:`log_attempts` (which says why), in the same transaction.
    """
    columns = ("effect_id", "attempt", "worker", "started_at", "outcome", "detail", "shard")
    values = (
        changed.c.id,
        changed.c.attempt,
        worker,
        changed.c.attempt_started_at,
        outcome,
        null() if detail is None else detail,
        changed.c.shard,
    )
    logged = select(*labelled(values, columns))
    if sharded:
        return logged
    return (
        pg_insert(effect_attempts)
        .from_select(list(columns), logged)
        .returning(effect_attempts.c.effect_id)
    )


#: Attempt-log outcomes that are the sink's (or an operator's) word on whether an
#: effect happened: after one of them, an earlier lost attempt is no longer in doubt.
#: Not ``retry``: an idempotent kind answers it for a call whose fate it cannot
#: tell (a timeout after sending), as for one never sent.
_ANSWERS = (
    AttemptOutcome.SUCCEEDED,
    AttemptOutcome.FAILED,
    AttemptOutcome.LOOKED_UP,
    AttemptOutcome.RESOLVED,
)


def lost_without_answer() -> Any:
    """An effect (of the statement's ``outbox_effects``) may have happened, though not started.

    An attempt's lease ran out with no answer (``expired``, whatever the
    reconciler made of it: redelivered, failed at its cap and retried by an
    operator since): the call may have reached the sink, and no later attempt
    or operator said whether it did. A relay's lost dispatch (resolution
    :data:`~outbox.models.REDISPATCH`) made no call, so it leaves no doubt.
    """
    lost, answer = effect_attempts.alias("lost"), effect_attempts.alias("answer")
    answered = exists().where(
        answer.c.effect_id == lost.c.effect_id,
        answer.c.shard == lost.c.shard,
        answer.c.attempt >= lost.c.attempt,
        in_statuses(answer.c.outcome, _ANSWERS),
    )
    return exists().where(
        lost.c.effect_id == effects.c.id,
        lost.c.shard == effects.c.shard,
        lost.c.outcome == const(AttemptOutcome.EXPIRED),
        # IS DISTINCT FROM: a row without a resolution counts as lost
        lost.c.detail["resolution"].astext.is_distinct_from(const(REDISPATCH)),
        ~answered,
    )
