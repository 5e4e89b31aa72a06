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
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar
from uuid import UUID

import psycopg
from sqlalchemy import Connection

from outbox.faults import crash_point
from outbox.shards import shard_of
from outbox.storage.attempts import Completion, OutcomesLeft
from outbox.storage.direct import Prepared, prepared
from outbox.storage.engine import translate_errors
from outbox.storage.shard_turns import shard_groups
from outbox.storage.sql import effects as effect_sql
from outbox.storage.sql.attempt_log import log_selected
from outbox.storage.sql.common import RUNS_CHANNEL, notify

__all__ = [
    "OUTCOME_PART_ROWS",
    "complete_on",
    "logged_rows",
    "shard_parts",
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
) -> list[Row | Exception]:
    """``work(connection, item)`` for each item: each one's result, or what it raised, in order.

    The first item on ``conn``, each other on a ``spare`` connection at the same
    time while one is free, and those left over in turn on ``conn`` after (as is
    one whose spare connection could not be opened). Every item is tried.
    """

    async def apart(item: Item) -> Any:
        if spare is None:
            return _IN_TURN
        async with contextlib.AsyncExitStack() as stack:
            try:
                other = await stack.enter_async_context(spare())
            except Exception as exc:  # a refused connect: no spare after all
                log.debug("no spare connection (%s): in turn", exc)
                return _IN_TURN
            return _IN_TURN if other is None else await work(other, item)

    if not items:
        return []
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
        if isinstance(result, BaseException) and not isinstance(result, Exception):
            raise result  # cancelled, or worse: not a part's failure
    return results


def shard_parts(
    part: Sequence[Completion], runs: Mapping[UUID, UUID | None] | None
) -> list[list[Completion]]:
    """One shard's outcomes in statements of at most ``OUTCOME_PART_ROWS`` rows.

    A statement locks the runs of the effects it ends (a parked run woken, a
    costed effect's budget settled) in its rows' order: two statements that
    each lock two runs of the other's could take them in opposite orders and
    deadlock. So a run's outcomes share a statement only with whole runs found
    in no other (a run of more than ``OUTCOME_PART_ROWS`` has statements of its
    own, which share that one run alone: one lock cannot make a cycle). With an
    effect whose run ``runs`` does not name, the shard's outcomes are one statement.
    """
    size = OUTCOME_PART_ROWS
    if len(part) <= size or runs is None or any(c.effect_id not in runs for c in part):
        return [list(part)]
    by_run: dict[UUID, list[Completion]] = {}
    for c in part:  # an effect of no run locks none: a group of its own
        by_run.setdefault(runs[c.effect_id] or c.effect_id, []).append(c)
    parts: list[list[Completion]] = []
    mixed: list[Completion] = []
    for group in by_run.values():
        if len(group) > size:
            parts += [group[at : at + size] for at in range(0, len(group), size)]
            continue
        if len(mixed) + len(group) > size:
            parts.append(mixed)
            mixed = []
        mixed += group
    return [*parts, mixed] if mixed else parts


async def complete_on(
    conn: psycopg.AsyncConnection[dict[str, Any]],
    owner: str,
    done: Sequence[Completion],
    shards: dict[UUID, int] | None,
    spare: Spare[AsyncConn] | None = None,
    runs: Mapping[UUID, UUID | None] | None = None,
) -> list[tuple[UUID, str]]:
    """Write ``done`` on ``conn`` (the caller's transaction); ``shards``: on Citus, held rows'.

    On Citus a statement per shard (parts of it: :func:`shard_parts`, with
    ``runs`` the run of each held effect), routed to its node, each committed
    on its own, side by side on ``spare`` connections while there are any.
    When some parts fail, raises :class:`OutcomesLeft` with what the others
    wrote (it is committed) and what is left to write.
    """
    groups = await shard_groups(conn, done, lambda c: c.effect_id, shards, lambda c: c.shard)
    if None in groups:  # one server: one statement
        batch = await _complete_batch(conn, owner, groups[None])
        crash_point("during_completion")
        return batch
    parts = [
        (shard, [dataclasses.replace(c, shard=shard) for c in rows])
        for shard, part in groups.items()
        if shard is not None
        for rows in shard_parts(part, runs)
    ]

    async def write(
        on: AsyncConn, part: tuple[int, list[Completion]]
    ) -> tuple[list[tuple[UUID, str]], list[tuple[UUID, UUID]]]:
        with translate_errors("recording outcomes"):
            return await _complete_on_shard(on, owner, part[1], part[0])

    written = await side_by_side(conn, spare, parts, write)
    logged: list[tuple[UUID, str]] = []
    left: list[Completion] = []
    error: Exception | None = None
    waiters: dict[int, dict[UUID, UUID]] = {}
    woke = False
    for (shard, part), result in zip(parts, written, strict=True):
        if isinstance(result, Exception):
            left += part
            error = error or result
            continue
        done_here, wakes = result
        logged += done_here
        for run, effect in wakes:  # of this shard the statement woke it; another's below
            woke = True
            if shard_of(run) != shard:
                waiters.setdefault(shard_of(run), {})[run] = effect
    if woke:  # a run that awaited one of them goes on: its workers are told here
        await _wake_waiters(conn, waiters)
        await conn.execute("SELECT pg_notify(%s, '')", [RUNS_CHANNEL])
    crash_point("during_completion")
    if error is not None:
        raise OutcomesLeft(logged, left, error)
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
