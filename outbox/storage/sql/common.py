"""What every statement builder shares: literals, JSON parameters, channels, status predicates.

Status predicates are derived from the named sets in :mod:`outbox.models`, so
each set of statuses is written once.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    Select,
    SmallInteger,
    Text,
    bindparam,
    cast,
    func,
    literal_column,
    null,
    select,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.sql.expression import ColumnElement, TextClause

from outbox.models import ACTIVE_RUN_STATUSES

__all__ = [
    "ACTIVE_CONDITION",
    "EFFECTS_CHANNEL",
    "RUNS_CHANNEL",
    "SECONDS",
    "SIGNALS_CHANNEL",
    "AnySelect",
    "const",
    "in_statuses",
    "json_param",
    "not_by_index",
    "notify",
    "on_shard",
    "shard_of",
    "sql_in",
    "woken_run",
]

# Rows of mixed columns; SQLAlchemy 2.1 types Select by its column tuple.
AnySelect = Select[*tuple[Any, ...]]

#: Deliverers LISTEN here: intents committed.
EFFECTS_CHANNEL = "outbox_effects"
#: Run workers LISTEN here: a run became runnable.
RUNS_CHANNEL = "outbox_runs"
#: A plain script blocked in ``wait_signal`` LISTENs here (payload: the run id).
SIGNALS_CHANNEL = "outbox_signals"

SECONDS = text("interval '1 second'")


def const(value: str) -> ColumnElement[str]:
    """A string constant written into the SQL, not bound.

    Status comparisons must be literals: a partial index (``WHERE status =
    'pending'``) is only usable by a generic prepared plan when the predicate
    is spelled out, and psycopg prepares statements after a few executions.
    """
    return literal_column("'" + value.replace("'", "''") + "'", Text)


def not_by_index(column: ColumnElement[str]) -> ColumnElement[str]:
    """``column`` in a form no partial index's predicate matches (``column || ''``).

    For a statement that finds its rows by id and checks their status too: the
    planner otherwise may read a status index instead and keep the ids it was
    given. With statistics taken before a backlog changed status (ANALYZE saw
    them pending), it guesses that index almost empty and reads all of it:
    every in-flight or dispatched effect, for a batch.
    """
    return column.concat("")


def shard_of(id: Any) -> ColumnElement[int]:
    """The shard of a run (or of an effect of no run) with this id (``outbox.shards``)."""
    return func.outbox_shard_of(id, type_=SmallInteger)


def on_shard(table: Any, sharded: bool) -> list[ColumnElement[bool]]:
    """On Citus: ``table``'s rows of the shard ``on_shard`` only (the statement is routed there)."""
    return [table.c.shard == bindparam("on_shard", type_=SmallInteger)] if sharded else []


def json_param(name: str) -> ColumnElement[object]:
    """A bind parameter carrying canonical JSON text, cast to jsonb by the server.

    The text comes from :func:`outbox.payloads.encode`; passing it through as
    text avoids a second serialisation in the driver.
    """
    return cast(bindparam(name, type_=Text), JSONB)


def in_statuses(
    column: ColumnElement[Any], statuses: Iterable[StrEnum | str]
) -> ColumnElement[bool]:
    """``column IN ('a', 'b')`` with the statuses written as literals (see :func:`const`)."""
    return column.in_([const(str(s)) for s in statuses])


def sql_in(column: str, values: Iterable[StrEnum | str]) -> str:
    """SQL text ``column IN (...)`` for a fixed set of status literals (DDL predicates)."""
    return f"{column} IN ({', '.join(repr(str(v)) for v in values)})"


#: A run accepts new steps only while active (live and not paused).
ACTIVE_CONDITION: TextClause = text(sql_in("outbox_runs.status", ACTIVE_RUN_STATUSES))


def notify(channel: str) -> AnySelect:
    """``SELECT pg_notify(channel, '')``: sent by the caller when a statement changed rows.

    Never inside a write's RETURNING: Citus refuses non-immutable functions there,
    and a NOTIFY must leave from the coordinator, where listeners connect.
    """
    return select(func.pg_notify(channel, ""))


def woken_run(waited_on: str) -> dict[str, Any]:
    """The SET of a parked run that goes on: runnable now, its timer and ``waited_on`` cleared.

    ``waited_on``: the column it waited by (``wait_effect``, ``wait_signal``).
    """
    return {
        "status": const("runnable"),
        "available_at": func.now(),
        "wake_at": null(),
        waited_on: null(),
        "updated_at": func.now(),
    }
