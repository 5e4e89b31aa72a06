"""``side_by_side``: parts of a batch's write, on spare connections while there are any."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from outbox.storage.outcome_writes import side_by_side


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
    assert [r[1] for r in got] == [0, 10, 20, 30, 40]
    assert [r[0] for r in got] == ["own", "c1", "c2", "own", "own"]
    assert under_way[:3] == [0, 1, 2], "the first three at once"
    assert sorted(item for _, item in ran) == [0, 1, 2, 3, 4]


def test_without_a_lender_everything_runs_in_turn_on_the_callers_connection() -> None:
    seen: list[Any] = []

    async def work(conn: Any, item: int) -> int:
        seen.append(conn)
        return item

    assert asyncio.run(side_by_side("own", None, [1, 2, 3], work)) == [1, 2, 3]
    assert seen == ["own"] * 3


def test_a_failed_part_is_raised_once_every_part_has_ended() -> None:
    ended: list[int] = []

    async def work(conn: Any, item: int) -> int:
        if item == 0:
            raise ValueError("part 0")
        await asyncio.sleep(0.01)
        ended.append(item)
        return item

    with pytest.raises(ValueError, match="part 0"):
        asyncio.run(side_by_side("own", Lender(free=1).spare, [0, 1, 2], work))
    assert sorted(ended) == [1, 2], "the other parts were written (each commits on its own)"
