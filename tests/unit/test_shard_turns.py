"""The order in which a deliverer on Citus asks the shards (``ShardTurns``), without a cluster."""

from __future__ import annotations

import time

import pytest

from outbox.shards import SHARDS
from outbox.storage import shard_turns
from outbox.storage.shard_turns import ShardTurns

P = "{'kind': 'k.one'}"


def _claim(turns: ShardTurns, holding: set[int], limit: int = 10) -> list[int]:
    """The shards one claim asks when ``holding`` have a row each (as AsyncStore._claim_on)."""
    order, may_end = turns.plan(P, turns.take_hints())
    asked: list[int] = []
    taken = 0
    for n, shard in enumerate(order):
        if taken >= limit or turns.ends_here(P, n, taken, may_end):
            break
        turns.took(P, shard)
        asked.append(shard)
        taken += shard in holding
    else:
        turns.swept(P)
    return asked


def test_only_a_shard_number_is_a_hint() -> None:
    turns = ShardTurns()
    for payload in ("", "x", "-1", str(SHARDS), "3.0", "7", "7", "12"):
        turns.hint(payload)
    assert turns.take_hints() == {7, 12}
    assert turns.take_hints() == frozenset()


def test_without_a_hint_a_claim_asks_every_shard_in_turn() -> None:
    turns = ShardTurns()
    assert _claim(turns, holding={5}) == list(range(SHARDS))
    # the next claim starts where this one stopped (after the last shard asked)
    order, may_end = turns.plan(P, frozenset())
    assert order[0] == 0 and may_end == SHARDS


def test_a_quota_met_ends_a_claim_and_the_next_starts_after_it() -> None:
    turns = ShardTurns()
    assert _claim(turns, holding={1, 2}, limit=2) == [0, 1, 2]
    assert turns.plan(P, frozenset())[0][0] == 3


def test_a_named_shard_is_asked_first_and_alone_when_it_has_rows() -> None:
    turns = ShardTurns()
    turns.hint("9")
    assert _claim(turns, holding={9}) == [9]


def test_a_named_shard_without_rows_goes_on_to_every_other() -> None:
    turns = ShardTurns()
    turns.hint("9")
    asked = _claim(turns, holding={20})
    assert asked[0] == 9 and sorted(asked) == list(range(SHARDS))


def test_claims_that_end_early_give_way_to_a_full_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """A steady stream of wake-ups for one shard must not starve the others."""
    turns = ShardTurns()
    turns.hint("9")
    assert _claim(turns, holding={9, 20}) == [9]
    monkeypatch.setattr(shard_turns, "SWEEP_SECONDS", 0.0)  # the window has passed
    turns.hint("9")
    asked = _claim(turns, holding={9, 20})
    assert asked[0] == 9 and 20 in asked and len(asked) == SHARDS
    # after the full round, a named shard may end a claim again
    monkeypatch.setattr(shard_turns, "SWEEP_SECONDS", 1.0)
    turns.hint("9")
    assert _claim(turns, holding={9, 20}) == [9]


def test_a_resting_shard_is_not_asked_even_when_named() -> None:
    turns = ShardTurns()
    turns.rest(9, None)
    turns.hint("9")
    asked = _claim(turns, holding={9, 20})
    assert 9 not in asked and 20 in asked


def _walk(turns: ShardTurns, rows: dict[int, int], limit: int) -> list[int]:
    """The shards one walk asks when ``rows`` says how many each gives."""
    walk = turns.walk(P, limit, frozenset())
    asked, shard = [], next(walk, None)
    while shard is not None:
        asked.append(shard)
        shard = shard_turns.next_turn(walk, rows.get(shard, 0))
    return asked


def test_a_shard_is_read_first_unless_the_last_claim_met_its_quota_or_it_was_named() -> None:
    turns = ShardTurns()
    assert turns.asks_first(P, 3, frozenset()), "no claim yet: read before claiming"
    assert not turns.asks_first(P, 3, frozenset({3})), "a wake-up named it: claim at once"
    assert _walk(turns, {0: 5, 1: 5}, limit=10) == [0, 1], "the quota met on two shards"
    assert not turns.asks_first(P, 7, frozenset()), "a backlog: claim without reading"
    assert len(_walk(turns, {4: 1}, limit=10)) == SHARDS, "short of the quota: every shard"
    assert turns.asks_first(P, 7, frozenset()), "idle again: read first"


def test_a_backlog_on_a_few_shards_is_not_asked_of_the_others_with_a_claim_each() -> None:
    turns = ShardTurns()
    backlog = {3: 100, 17: 100}
    assert _walk(turns, backlog, limit=150) == [*range(18)], "0-2, 4-16 had nothing"
    assert not turns.asks_first(P, 3, frozenset()), "it had rows: claim at once"
    assert all(turns.asks_first(P, s, frozenset()) for s in (0, 5)), "empty when asked"
    assert not turns.asks_first(P, 18, frozenset()), "not asked yet, in a backlog: claim"
    # 0-2 and 4-16 were empty a moment ago: passed over until a sweep's time has gone by
    assert _walk(turns, backlog, limit=150) == [*range(18, SHARDS), 3, 17]
    assert turns.asks_first(P, 18, frozenset()), "empty when asked: read it first"
    assert not turns.asks_first(P, 17, frozenset()), "it had rows"
    assert not turns.asks_first(P, 18, frozenset({18})), "a wake-up named it: claim at once"


def test_a_backlog_passes_over_shards_just_found_empty_until_a_sweep_is_due(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One shard's backlog is not read of the 31 others before every claim, nor forever."""
    turns = ShardTurns()
    backlog = {5: 1000}
    assert _walk(turns, backlog, limit=100) == [*range(6)], "the first claim asks on to 5"
    assert _walk(turns, backlog, limit=100) == [*range(6, SHARDS), 5], "0-4 passed over"
    assert _walk(turns, backlog, limit=100) == [5], "every other shard was empty just now"
    assert _walk(turns, backlog, limit=100) == [5]
    named = turns.walk(P, 100, frozenset({9}))
    assert next(named) == 9, "a wake-up names a shard: asked even in a backlog"
    assert shard_turns.next_turn(named, 0) == 5
    clock = time.monotonic() + shard_turns.SWEEP_SECONDS
    monkeypatch.setattr(time, "monotonic", lambda: clock)
    assert _walk(turns, backlog, limit=100) == [*range(6, SHARDS), *range(6)], "a sweep is due"
    assert _walk(turns, backlog, limit=100) == [5]
    # the backlog gone, its claim falls short of the quota: idle again, every shard is asked
    assert _walk(turns, {}, limit=100) == [5]
    assert len(_walk(turns, {}, limit=100)) == SHARDS
