"""``side_by_side``: parts of a batch's write, on spare connections while there are any."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

from outbox.storage.attempts import Completion
from outbox.storage.outcome_writes import OUTCOME_PART_ROWS, shard_parts, side_by_side


class Lender:
    """Lends up to ``free`` stand-in connections at once (named c1, c2, ...), as
    ``DirectConnections.spare`` does: None, never a wait, when none is free."""

    def __init__(self, free: int) -> None:
        self.free, self.lent = free, 0

    @contextlib.asynccontextmanager
    async def spare(self) -> AsyncIterator[Any]:
        if self.free == 0:
            yield None
            return
        self.free -= 1
        self.lent += 1
        try:
            yield f"c{self.lent}"
        finally:
            self.free += 1


def test_each_part_runs_once_in_order_of_its_results_the_rest_in_turn_on_the_callers() -> None:
    lender, ran, under_way = Lender(free=2), [], []

    async def work(conn: Any, item: int) -> tuple[Any, int]:
        under_way.append(item)
        await asyncio.sleep(0.01 * (5 - item))  # the later parts end first
        ran.append((conn, item))
        return conn, item * 10

    got = asyncio.run(side_by_side("own", lender.spare, [0, 1, 2, 3, 4], work))
    assert got == [("own", 0), ("c1", 10), ("c2", 20), ("own", 30), ("own", 40)]
    assert under_way[:3] == [0, 1, 2], "the first three at once"
    assert sorted(item for _, item in ran) == [0, 1, 2, 3, 4]


def test_without_a_lender_everything_runs_in_turn_on_the_callers_connection() -> None:
    seen: list[Any] = []

    async def work(conn: Any, item: int) -> int:
        seen.append(conn)
        return item

    assert asyncio.run(side_by_side("own", None, [1, 2, 3], work)) == [1, 2, 3]
    assert seen == ["own"] * 3


def test_a_failed_part_is_given_back_in_its_place_and_the_others_run() -> None:
    async def work(conn: Any, item: int) -> int:
        if item == 1:
            raise ValueError("part 1")
        await asyncio.sleep(0.01)
        return item

    got = asyncio.run(side_by_side("own", Lender(free=1).spare, [0, 1, 2], work))
    assert got[0] == 0 and got[2] == 2
    assert isinstance(got[1], ValueError) and str(got[1]) == "part 1"


def test_a_spare_that_cannot_be_opened_leaves_its_part_to_the_callers_connection() -> None:
    @contextlib.asynccontextmanager
    async def refused() -> AsyncIterator[Any]:
        raise ConnectionRefusedError("too many clients")
        yield  # pragma: no cover

    seen: list[Any] = []

    async def work(conn: Any, item: int) -> int:
        seen.append((conn, item))
        return item

    assert asyncio.run(side_by_side("own", refused, [0, 1], work)) == [0, 1]
    assert seen == [("own", 0), ("own", 1)]
    assert asyncio.run(side_by_side("own", refused, [], work)) == []


def _done(run: int, n: int) -> Completion:
    return Completion(uuid.UUID(int=run * 1000 + n), 1, "succeeded", "succeeded", shard=3)


def test_parts_share_a_run_only_when_each_holds_that_run_alone() -> None:
    """No two parts can lock two runs each in opposite orders; each at most 50 rows."""
    runs: dict[uuid.UUID, uuid.UUID | None] = {}
    batch = []
    for run, count in [(1, 30), (2, 30), (3, 120), (4, 5)]:
        for n in range(count):
            c = _done(run, n)
            runs[c.effect_id] = uuid.UUID(int=run)
            batch.append(c)
    loose = _done(9, 0)  # an effect of no run
    runs[loose.effect_id] = None
    batch.append(loose)
    parts = shard_parts(batch, runs)
    assert sorted(c.effect_id for p in parts for c in p) == sorted(c.effect_id for c in batch)
    assert max(len(p) for p in parts) <= OUTCOME_PART_ROWS
    held = [{runs[c.effect_id] for c in p} - {None} for p in parts]
    for n, one in enumerate(held):
        for other in held[n + 1 :]:
            shared = one & other
            assert not shared or (one == shared == other), (one, other)
    assert sorted(len(p) for p in parts) == [20, 30, 36, 50, 50]


def test_a_shard_with_an_effect_of_unknown_run_is_written_whole() -> None:
    batch = [_done(1, n) for n in range(60)]
    runs: dict[uuid.UUID, uuid.UUID | None] = {
        c.effect_id: uuid.UUID(int=n % 7) for n, c in enumerate(batch)
    }
    assert len(shard_parts(batch, runs)) > 1
    del runs[batch[5].effect_id]
    assert shard_parts(batch, runs) == [batch]
    assert shard_parts(batch, None) == [batch]
