"""On Citus a statement per shard: a session lost is not a node down.

A worker that does not answer fails one statement while the coordinator's
session lives on, and its shards rest (``ShardTurns.answering``). A session
that ended (terminated, its server restarted, the network cut) fails every
statement after it: taken for a node down, it rested all 32 shards, so the
deliverer claimed nothing for ``SHARD_REST_SECONDS`` with every node up, and a
heartbeat on it reported every lease lost. And what a claim's statements on
other shards committed before the session went is the caller's: raised, those
effects (or runs) would wait uncalled for their leases to run out.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import psycopg
import pytest

from outbox import Outbox, StepTransaction
from outbox.errors import DatabaseError
from outbox.shards import shard_of
from outbox.storage.async_store import AsyncStore, Batched, ClaimedEffect, Completion
from outbox.storage.attempts import ClaimCutShort
from outbox.storage.engine import make_async_engine, make_engine
from outbox.storage.shard_turns import SHARD_REST_SECONDS
from outbox.storage.sql.dispatch import DISPATCH_QUEUE
from outbox.storage.sql.queue import EFFECT_QUEUE
from outbox.storage.store import Store
from tests.support import in_flight


def _intend(tx: StepTransaction, kind: str, count: int) -> None:
    for n in range(count):
        tx.intend(kind, {"n": n})


def _spread(ob: Outbox, kind: str, runs: int = 8) -> set[int]:
    """Two effects in each of ``runs`` runs; the shards they landed on."""
    shards = set()
    for i in range(runs):
        run = ob.start_run(f"lost-{kind}-{i}", "1")
        run.transaction("s", partial(_intend, kind=kind, count=2))
        shards.add(shard_of(run.id))
    return shards


def _terminate(dsn: str, pid: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s::int)", [pid])


def _rested(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "did not answer" in r.getMessage()]


def test_a_claim_on_a_lost_session_rests_no_shard(
    ob: Outbox, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    kind = "k.lost-claim"
    assert len(_spread(ob, kind)) > 1

    async def claims() -> tuple[int, BaseException | None, int]:
        store = AsyncStore(make_async_engine(dsn))
        try:
            quota = [({"kind": kind}, 1)]
            first = await store.claim_many(EFFECT_QUEUE, quota, owner="o", lease_seconds=60)
            async with store._direct.connection() as conn:  # the session the claims use
                _terminate(dsn, conn.info.backend_pid)
            raised = None
            try:
                await store.claim_many(EFFECT_QUEUE, quota, owner="o", lease_seconds=60)
            except DatabaseError as exc:
                raised = exc
            quota = [({"kind": kind}, 100)]
            rest = await store.claim_many(EFFECT_QUEUE, quota, owner="o", lease_seconds=60)
            return len(first), raised, len(rest)
        finally:
            await store.dispose()

    with caplog.at_level(logging.WARNING):
        first, raised, rest = asyncio.run(claims())
    assert first == 1
    assert raised is not None, "the claim on the lost session failed"
    assert _rested(caplog) == [], "a lost session is not a node down"
    assert rest == 15, f"within {SHARD_REST_SECONDS}s of a lost session every shard still claims"


def test_a_heartbeat_on_a_lost_session_reports_no_lease_lost(
    ob: Outbox, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    kind = "k.lost-heartbeat"
    assert len(_spread(ob, kind)) > 1

    async def heartbeat() -> tuple[set[uuid.UUID], set[uuid.UUID] | BaseException]:
        store = AsyncStore(make_async_engine(dsn))
        try:
            quota = [({"kind": kind}, 100)]
            claimed = await store.claim_many(EFFECT_QUEUE, quota, owner="o", lease_seconds=60)
            held = [(e.id, e.attempt) for e in claimed]
            await store.extend(EFFECT_QUEUE, held, owner="o", lease_seconds=60)
            async with store.engine.connect() as conn:  # the pooled session extend uses
                pid = (await conn.exec_driver_sql("SELECT pg_backend_pid()")).scalar_one()
            _terminate(dsn, pid)
            try:
                kept: set[uuid.UUID] | BaseException = await store.extend(
                    EFFECT_QUEUE, held, owner="o", lease_seconds=60
                )
            except DatabaseError as exc:
                kept = exc
            return {e.id for e in claimed}, kept
        finally:
            await store.dispose()

    with caplog.at_level(logging.WARNING):
        claimed, kept = asyncio.run(heartbeat())
    assert len(claimed) == 16
    # a heartbeat that fails leaves each lease as good as its last renewal; one that
    # answers names every lease still held: never a part of them, with every node up
    assert isinstance(kept, DatabaseError) or kept == claimed, kept
    assert _rested(caplog) == []


def _losing_the_session_after(
    original: Callable[..., Any], dsn: str, pid_of: Callable[[Any], int]
) -> Callable[..., Any]:
    """``original`` (a claim on one shard), but the session is terminated after the
    first statement that claimed something."""
    lost = [False]

    def claim(*args: Any, **kwargs: Any) -> Any:
        rows = original(*args, **kwargs)
        if rows and not lost[0]:
            lost[0] = True
            _terminate(dsn, pid_of(args[1]))
        return rows

    async def claim_async(*args: Any, **kwargs: Any) -> Any:
        rows = await original(*args, **kwargs)
        if rows and not lost[0]:
            lost[0] = True
            _terminate(dsn, pid_of(args[1]))
        return rows

    return claim_async if asyncio.iscoroutinefunction(original) else claim


def _lose_the_session_after_a_claim(monkeypatch: pytest.MonkeyPatch, dsn: str) -> None:
    """A deliverer's claims on one shard lose their session after the first that claims."""
    monkeypatch.setattr(
        AsyncStore,
        "_claim_partition",
        _losing_the_session_after(
            AsyncStore._claim_partition, dsn, lambda conn: conn.info.backend_pid
        ),
    )


def test_a_claim_keeps_what_it_committed_before_its_session_was_lost(
    ob: Outbox, dsn: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    kind, owner = "k.lost-midway", "midway"
    assert len(_spread(ob, kind)) > 1
    _lose_the_session_after_a_claim(monkeypatch, dsn)

    async def claim() -> set[uuid.UUID]:
        store = AsyncStore(make_async_engine(dsn))
        try:
            quota = [({"kind": kind}, 100)]
            got = await store.claim_many(EFFECT_QUEUE, quota, owner=owner, lease_seconds=60)
            return {e.id for e in got}
        finally:
            await store.dispose()

    with caplog.at_level(logging.WARNING):
        claimed = asyncio.run(claim())
    assert 0 < len(claimed) < 16
    assert in_flight(dsn, owner) == claimed, "every effect claimed is the caller's"
    assert _rested(caplog) == []


def test_a_run_claim_keeps_what_it_committed_before_its_session_was_lost(
    ob: Outbox, dsn: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    agent = "lost-runs"
    runs = [ob.start_run(agent, "1").id for _ in range(8)]
    assert len({shard_of(r) for r in runs}) > 1
    monkeypatch.setattr(
        Store,
        "_claim_runs_on",
        _losing_the_session_after(
            Store._claim_runs_on,
            dsn,
            lambda conn: conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one(),
        ),
    )
    store = Store(make_engine(dsn))
    try:
        with caplog.at_level(logging.WARNING):
            claimed = store.claim_runs(
                [({"agent": agent, "agent_version": "1"}, 8)], owner="w", lease_seconds=60
            )
    finally:
        store.engine.dispose()
    assert 0 < len(claimed) < 8
    with psycopg.connect(dsn) as conn:
        held = conn.execute(
            "SELECT id FROM outbox_runs WHERE lease_owner = 'w' AND agent = %s", [agent]
        ).fetchall()
    assert {row[0] for row in held} == {r.id for r in claimed}
    assert _rested(caplog) == []


def test_a_claim_of_several_kinds_beside_outcomes_keeps_every_kinds_rows(
    ob: Outbox, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Beside the outcomes every statement commits on its own: the first kind's rows are
    committed when the second kind's claim finds the session gone."""
    first, second, owner = "k.lost-a", "k.lost-b", "several"
    _spread(ob, first, runs=1)
    assert len(_spread(ob, second)) > 1
    _lose_the_session_after_a_claim(monkeypatch, dsn)

    async def round_() -> set[uuid.UUID]:
        store = AsyncStore(make_async_engine(dsn))
        try:
            quotas = [({"kind": first}, 1), ({"kind": second}, 100)]
            batched = await store.complete_and_claim(
                owner, [], EFFECT_QUEUE, quotas, lease_seconds=60
            )
            return {e.id for e in batched.claimed}
        finally:
            await store.dispose()

    claimed = asyncio.run(round_())
    assert len(claimed) == 1
    assert in_flight(dsn, owner) == claimed, "every effect claimed is the caller's"


async def _succeed_and_claim(
    store: AsyncStore, owner: str, done: ClaimedEffect, kind: str, *, heartbeat: ClaimedEffect
) -> Batched:
    """A deliverer's batch: ``done`` succeeded, up to 100 of ``kind`` claimed, ``heartbeat``'s
    lease extended with them."""
    return await store.complete_and_claim(
        owner,
        [Completion(done.id, done.attempt, "succeeded", "succeeded", shard=done.shard)],
        EFFECT_QUEUE,
        [({"kind": kind}, 100)],
        lease_seconds=60,
        extend=[(heartbeat.id, heartbeat.attempt)],
    )


def test_a_claim_after_ordered_outcomes_keeps_its_rows_and_writes_each_outcome_once(
    ob: Outbox, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ordered effect's outcome is written before the claim, on the same session: the
    session goes during the claim; the claim's rows come back, the outcome is written
    once, and the heartbeat that would have ridden is left undone, not reported lost."""
    ordered, kind, owner = "k.lost-ordered", "k.lost-after", "ordered"
    ob.start_run("lost-ordered", "1").transaction(
        "s", lambda tx: tx.intend(ordered, {"n": 0}, ordering_key="acct-1") and None
    )
    assert len(_spread(ob, kind)) > 1

    async def round_() -> tuple[Any, set[uuid.UUID]]:
        store = AsyncStore(make_async_engine(dsn))
        try:
            (held,) = await store.claim_many(
                EFFECT_QUEUE, [({"kind": ordered}, 1)], owner=owner, lease_seconds=60
            )
            _lose_the_session_after_a_claim(monkeypatch, dsn)
            batched = await _succeed_and_claim(store, owner, held, kind, heartbeat=held)
            return batched, {e.id for e in batched.claimed}
        finally:
            await store.dispose()

    batched, claimed = asyncio.run(round_())
    assert batched.logged and batched.logged[0][1] == "succeeded"
    assert 0 < len(claimed) < 16 and not batched.rode
    assert in_flight(dsn, owner) == claimed
    with psycopg.connect(dsn) as conn:
        (logged,) = conn.execute(
            "SELECT count(*) FROM outbox_effect_attempts a JOIN outbox_effects e"
            " ON e.id = a.effect_id AND e.shard = a.shard WHERE e.kind = %s",
            [ordered],
        ).fetchone() or (None,)
    assert logged == 1, "the outcome is written once"


def test_a_heartbeat_riding_a_batch_on_a_lost_session_leaves_its_claim_returned(
    ob: Outbox, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outcomes and claim committed, the session goes before the heartbeat riding with
    them: the batch still returns what it claimed, its duties left to the daemon."""
    kind, owner = "k.lost-ride", "ride"
    assert len(_spread(ob, kind)) > 1
    ride = AsyncStore._ride

    async def session_lost_first(store: AsyncStore, conn: Any, *args: Any) -> Any:
        _terminate(dsn, conn.info.backend_pid)
        return await ride(store, conn, *args)

    async def round_() -> tuple[Any, set[uuid.UUID]]:
        store = AsyncStore(make_async_engine(dsn))
        try:
            held = await store.claim_many(
                EFFECT_QUEUE, [({"kind": kind}, 2)], owner=owner, lease_seconds=60
            )
            monkeypatch.setattr(AsyncStore, "_ride", session_lost_first)
            batched = await _succeed_and_claim(store, owner, held[0], kind, heartbeat=held[1])
            return batched, {e.id for e in batched.claimed} | {held[1].id}
        finally:
            await store.dispose()

    batched, holding = asyncio.run(round_())
    assert batched.logged and not batched.rode and len(batched.claimed) == 14
    assert in_flight(dsn, owner) == holding, "every effect claimed is the caller's"


def test_a_stream_claim_keeps_what_it_committed_and_names_what_is_left(
    ob: Outbox, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream deliverer's claim of the effects its records name, a statement a
    shard: cut short after one statement claimed rows, it hands those rows back
    (raised away, they would wait in flight, never called) and the ids it did
    not settle, which a second claim takes, each effect once."""
    kind, relay, owner = "k.lost-stream", "relay-lost", "stream-lost"
    assert len(_spread(ob, kind)) > 1
    monkeypatch.setattr(
        AsyncStore,
        "_claim_dispatched_on",
        _losing_the_session_after(
            AsyncStore._claim_dispatched_on, dsn, lambda conn: conn.info.backend_pid
        ),
    )

    observed: list[tuple[str, Mapping[str, int]]] = []

    async def claims() -> tuple[list[uuid.UUID], ClaimCutShort, set[uuid.UUID]]:
        store = AsyncStore(make_async_engine(dsn))
        try:
            quota = [({"kind": kind}, 100)]
            sent = await store.claim_many(DISPATCH_QUEUE, quota, owner=relay, lease_seconds=60)
            ids = [e.id for e in sent]
            store.observer = lambda what, _seconds, rows: observed.append((what, rows))
            with pytest.raises(ClaimCutShort) as cut:
                await store.claim_dispatched(ids, owner=owner, lease_seconds=60)
            rest = await store.claim_dispatched(cut.value.left, owner=owner, lease_seconds=60)
            return ids, cut.value, {e.id for e in rest}
        finally:
            await store.dispose()

    ids, cut, rest = asyncio.run(claims())
    first = {e.id for e in cut.rows}
    assert len(ids) == 16 and 0 < len(first) < 16
    assert cut.lost, "the session went, not a node"
    assert set(cut.left) == set(ids) - first, "every id not claimed is left, none twice"
    assert rest == set(cut.left)
    assert in_flight(dsn, owner) == set(ids), "each effect claimed once, none left dispatched"
    # the cut claim's rows are counted (a bench, a metric) like the second claim's
    assert observed == [("claim", {"claim": len(first)}), ("claim", {"claim": len(rest)})]
