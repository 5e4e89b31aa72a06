"""Writing a batch of outcomes and the attempt-log rows of a sharded statement.

On one server a batch's outcomes are one statement, which logs the attempts
and wakes the runs that awaited them. On a Citus cluster each shard's are
statements of their own (``OUTCOME_PART_ROWS`` rows at most), routed to the node
holding it and committed there in one phase, side by side on the deliverer's
spare connections; the attempt-log rows they select are inserted after them
(``outbox.storage.sql.attempt_log`` says why).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar
from uuid import UUID

import psycopg
from sqlalchemy import Connection

from outbox.faults import crash_point
from outbox.shards import shard_of
from outbox.storage.attempts import Completion
from outbox.storage.direct import Prepared, prepared
from outbox.storage.shard_turns import shard_groups
from outbox.storage.sql import effects as effect_sql
from outbox.storage.sql.attempt_log import log_selected
from outbox.storage.sql.common import RUNS_CHANNEL, notify

__all__ = [
    "OUTCOME_PART_ROWS",
    "complete_on",
    "logged_rows",
    "side_by_side",
    "wake_parked",
]

log = logging.getLogger(__name__)

Row = TypeVar("Row")
Item = TypeVar("Item")
Conn = TypeVar("Conn")
AsyncConn = psycopg.AsyncConnection[dict[str, Any]]

#: On Citus, the most outcomes of one shard a statement writes. A batch of 100
#: (the default) is two statements, written side by side when the deliverer has
#: a connection free: one statement's rows wait on one process at a time (this
#: one, the coordinator, the worker), two keep more of them busy (a drain of a
#: 3-node cluster on 2 cores: 4,700 -> 5,200 effects/s).
OUTCOME_PART_ROWS = 50

#: Lends a connection free now, or None (``DirectConnections.spare``).
Spare = Callable[[], contextlib.AbstractAsyncContextManager[Conn | None]]
#: What :func:`side_by_side` gives back for an item no connection was free for.
_IN_TURN = object()


async def side_by_side(
    conn: Conn,
    spare: Spare[Conn] | None,
    items: Sequence[Item],
    work: Callable[[Conn, Item], Awaitable[Row]],
) -> list[Row]:
    """``work(connection, item)`` for each item, the results in order.

    The first item on ``conn``, each other on a ``spare`` connection at the same
    time while one is free, and those left over in turn on ``conn`` after. Every
    item is tried; the first failure is raised once none is under way.
    """

    async def apart(item: Item) -> Any:
        if spare is None:
            return _IN_TURN
        async with spare() as other:
            return _IN_TURN if other is None else await work(other, item)

    results: list[Any] = list(
        await asyncio.gather(
            work(conn, items[0]), *(apart(item) for item in items[1:]), return_exceptions=True
        )
    )
    for n, result in enumerate(results):
        if result is _IN_TURN:
            try:
                results[n] = await work(conn, items[n])
            except Exception as exc:
                results[n] = exc
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


async def complete_on(
    conn: psycopg.AsyncConnection[dict[str, Any]],
    owner: str,
    done: Sequence[Completion],
    shards: dict[UUID, int] | None,
    spare: Spare[AsyncConn] | None = None,
) -> list[tuple[UUID, str]]:
    """Write ``done`` on ``conn`` (the caller's transaction); ``shards``: on Citus, held rows'.

    On Citus a statement per shard (``OUTCOME_PART_ROWS`` rows at most), routed
    to its node, each committed on its own, side by side on ``spare``
    connections while there are any.
    """
    groups = await shard_groups(conn, done, lambda c: c.effect_id, shards, lambda c: c.shard)
    if None in groups:  # one server: one statement
        batch = await _complete_batch(conn, owner, groups[None])
        crash_point("during_completion")
        return batch
    parts = [
        (shard, [dataclasses.replace(c, shard=shard) for c in part[at : at + OUTCOME_PART_ROWS]])
        for shard, part in groups.items()
        if shard is not None
        for at in range(0, len(part), OUTCOME_PART_ROWS)
    ]
    written = await side_by_side(
        conn, spare, parts, lambda c, part: _complete_on_shard(c, owner, part[1], part[0])
    )
    logged: list[tuple[UUID, str]] = []
    waiters: dict[int, dict[UUID, UUID]] = {}
    woke = False
    for (shard, _), (done_here, wakes) in zip(parts, written, strict=True):
        logged += done_here
        for run, effect in wakes:  # of this shard the statement woke it; another's below
            woke = True
            if shard_of(run) != shard:
                waiters.setdefault(shard_of(run), {})[run] = effect
    if woke:  # a run that awaited one of them goes on: its workers are told here
        await _wake_waiters(conn, waiters)
        await conn.execute("SELECT pg_notify(%s, '')", [RUNS_CHANNEL])
    crash_point("during_completion")
    return logged


async def _wake_waiters(
    conn: psycopg.AsyncConnection[dict[str, Any]], waiters: dict[int, dict[UUID, UUID]]
) -> None:
    """On Citus: wake runs parked on effects of other shards that just ended, a shard at a time.

    After the outcomes committed, each shard's statement on its own: one transaction
    would take two phases across the workers. A run this misses (its node did not
    answer) is not lost: it looks again when its recheck timer ends.
    """
    wake = prepared(effect_sql.wake_waiters())
    for shard, awaited in waiters.items():
        params = {"on_shard": shard, "runs": list(awaited), "awaited": list(awaited.values())}
        try:
            await wake.execute(conn, params, prepare=False)
        except psycopg.Error as exc:
            log.warning("shard %d: runs awaiting effects not woken (%s)", shard, exc)


def wake_parked(conn: Connection, run_id: UUID, effect_id: UUID) -> bool:
    """Wake run ``run_id`` if it is still parked on ``effect_id``, which just ended.

    In ``conn``'s transaction, a statement on the run's own shard; its workers are
    told at commit. True when it woke.
    """
    params = {"on_shard": shard_of(run_id), "runs": [run_id], "awaited": [effect_id]}
    if conn.execute(effect_sql.wake_waiters(), params).first() is None:
        return False
    conn.execute(notify(RUNS_CHANNEL))
    return True


async def _complete_batch(
    conn: psycopg.AsyncConnection[dict[str, Any]], owner: str, done: Sequence[Completion]
) -> list[tuple[UUID, str]]:
    """Write ``done`` on one server: the statement logs them and wakes and notifies runs."""
    complete = prepared(effect_sql.complete_effects(False))
    cur = await complete.execute(conn, _completion_params(owner, done), prepare=True)
    return [(row["effect_id"], row["outcome"]) for row in await cur.fetchall()]


async def _complete_on_shard(
    conn: psycopg.AsyncConnection[dict[str, Any]],
    owner: str,
    done: Sequence[Completion],
    shard: int,
) -> tuple[list[tuple[UUID, str]], list[tuple[UUID, UUID]]]:
    """Write ``done``, all of ``shard``; and (run, effect) for each run an ended effect may wake."""
    complete = prepared(effect_sql.complete_effects(True))
    params = _completion_params(owner, done)
    # Citus refuses now() next to a column in an UPDATE: the time is bound once
    clock = await conn.execute("SELECT now() AS now")
    params.update(on_shard=shard, now=(await clock.fetchone() or {})["now"])
    selected, logged = await _selected_and_logged(conn, complete, params)
    wakes = [(row["wakes"], row["effect_id"]) for row in selected if row["wakes"] is not None]
    return [(row["effect_id"], row["outcome"]) for row in logged], wakes


def _completion_params(owner: str, done: Sequence[Completion]) -> dict[str, Any]:
    # The statement locks the rows in the batch's order: in id order, as a cancel, a
    # pause and an approval lock a run's effects, so none of them waits in a cycle.
    done = sorted(done, key=lambda c: c.effect_id)
    payload = "[" + ",".join(c.as_json() for c in done) + "]"
    return {"owner": owner, "done": payload, "ids": [c.effect_id for c in done]}


def logged_rows(
    conn: Connection, statement: Callable[[bool], Any], params: dict[str, Any], *, sharded: bool
) -> list[Any]:
    """Rows logged by ``statement(sharded)``, a statement that writes attempt-log rows.

    On ``conn``, in the caller's transaction; on Citus the statement selects the
    rows and they are inserted after it. The SQLAlchemy twin of
    :func:`_selected_and_logged`, for the sweeps and run transactions.
    """
    if not sharded:
        return list(conn.execute(statement(False), params).all())
    rows = conn.execute(statement(True), params).mappings().all()
    if not rows:
        return []
    insert, values = log_selected(rows)
    return list(conn.execute(insert, values).all())


async def _selected_and_logged(
    conn: psycopg.AsyncConnection[dict[str, Any]], statement: Prepared, params: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Run a sharded statement that selects attempt-log rows, then insert them.

    Two statements routed to the shard's node (``attempt_log`` says why), in a
    transaction of their own: on that node alone, one phase. Returns the rows
    the statement selected and ``(effect_id, outcome)`` per row logged.
    """
    async with conn.transaction():
        cur = await statement.execute(conn, params, prepare=False)
        rows = await cur.fetchall()
        if not rows:
            return [], []
        insert, values = log_selected(rows)
        log = prepared(insert)
        cur = await log.execute(conn, values, prepare=False)
        return rows, await cur.fetchall()
