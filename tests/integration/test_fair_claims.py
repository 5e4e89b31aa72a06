"""Claims by priority and fairness key, and a kind's shared rate, on a real PostgreSQL.

Priority order: a claim takes higher priorities first, each priority in queue
order. Fairness: a batch is shared between the fairness keys of one priority,
and filled from the lanes that have more, so a backlog under one key never
holds back another's and a claim still comes back full. Rates: every claim of
a rated kind takes tokens from one bucket row in PostgreSQL, whichever process
makes it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from sqlalchemy import text

from deliverers.testing import RecordingDeliverer
from outbox import Outbox, StepTransaction
from outbox.delivery import DelivererConfig, Delivery, Outcome, Succeeded
from outbox.storage.async_store import AsyncStore, ClaimedEffect
from outbox.storage.engine import make_async_engine
from outbox.storage.sql import queue
from outbox.storage.sql.queue import EFFECT_QUEUE, Rate
from tests.support import DaemonThread, wait_for


def intend(ob: Outbox, kind: str, n: int, **options: Any) -> None:
    run = ob.start_run("agent", "1")

    def step(tx: StepTransaction) -> None:
        for i in range(n):
            tx.intend(kind, {"n": i, **options}, **options)

    run.transaction("s", step)


def claim(dsn: str, kind: str, limit: int, rate: Rate | None = None) -> list[ClaimedEffect]:
    async def go() -> list[ClaimedEffect]:
        store = AsyncStore(make_async_engine(dsn))
        try:
            return await store.claim_many(
                EFFECT_QUEUE,
                [({"kind": kind}, limit)],
                owner="test",
                lease_seconds=30,
                rates=None if rate is None else {kind: rate},
            )
        finally:
            await store.dispose()

    return asyncio.run(go())


def test_claims_take_higher_priority_first_each_priority_in_intent_order(
    ob: Outbox, dsn: str
) -> None:
    run = ob.start_run("agent", "1")

    def step(tx: StepTransaction) -> None:
        for i, priority in enumerate([0, 5, -2, 5, 0, 9, -2, 0]):
            tx.intend("k.p", {"i": i}, priority=priority)

    run.transaction("s", step)
    order = [e.payload["i"] for _ in range(8) for e in claim(dsn, "k.p", 1)]
    assert order == [5, 1, 3, 0, 4, 7, 2, 6]
    batch = [e.payload["i"] for e in claim(dsn, "k.p", 8)]
    assert batch == []
    with ob.engine.begin() as conn:
        conn.execute(text("UPDATE outbox_effects SET status = 'pending'"))
    assert [e.payload["i"] for e in claim(dsn, "k.p", 8)] == [5, 1, 3, 0, 4, 7, 2, 6]


def test_a_backlog_under_one_fairness_key_does_not_hold_back_another(ob: Outbox, dsn: str) -> None:
    intend(ob, "k.f", 500, fairness_key="tenant-a")
    intend(ob, "k.f", 3, fairness_key="tenant-b")  # intended after all of tenant-a's
    intend(ob, "k.f", 1, fairness_key="tenant-c")
    first = claim(dsn, "k.f", 10)
    tenants = [e.payload["fairness_key"] for e in first]
    assert len(first) == 10
    assert tenants.count("tenant-b") == 3 and tenants.count("tenant-c") == 1
    full = claim(dsn, "k.f", 100)
    assert len(full) == 100, "the share tenants b and c did not use went to tenant a"
    assert {e.payload["fairness_key"] for e in full} == {"tenant-a"}


def test_equal_backlogs_share_a_batch_round_robin(ob: Outbox, dsn: str) -> None:
    for tenant in ("x", "y", "z"):
        intend(ob, "k.rr", 50, fairness_key=tenant)
    counts: dict[str, int] = {}
    for e in claim(dsn, "k.rr", 30):
        counts[e.payload["fairness_key"]] = counts.get(e.payload["fairness_key"], 0) + 1
    assert counts == {"x": 10, "y": 10, "z": 10}


def test_priority_beats_fairness(ob: Outbox, dsn: str) -> None:
    intend(ob, "k.pf", 20, fairness_key="bulk")
    intend(ob, "k.pf", 5, fairness_key="bulk", priority=1)
    intend(ob, "k.pf", 5, fairness_key="other")
    got = claim(dsn, "k.pf", 8)
    assert [e.payload.get("priority", 0) for e in got[:5]] == [1] * 5
    assert {e.payload["fairness_key"] for e in got[5:]} == {"bulk", "other"}


def test_runs_are_claimed_by_priority_then_fairly(ob: Outbox) -> None:
    for _ in range(4):
        ob.start_run("w", "1", fairness_key="big")
    ob.start_run("w", "1", fairness_key="small")
    urgent = ob.start_run("w", "1", priority=3, fairness_key="big")
    claimed = ob.store.claim_runs(
        [({"agent": "w", "agent_version": "1"}, 3)], owner="t", lease_seconds=30
    )
    assert claimed[0].id == urgent.id
    assert {r.fairness_key for r in claimed[1:]} == {"big", "small"}


def test_a_rate_caps_claims_across_processes(ob: Outbox, dsn: str) -> None:
    intend(ob, "k.rated", 40)
    rate = Rate(per_second=10, burst=3)
    started = time.monotonic()
    got: list[int] = []
    lock = threading.Lock()

    def claimer() -> None:  # two claimers with their own engines: two sessions, one bucket
        # until 13 are claimed (the burst of 3, then 10 at 10 per second): however
        # slow the machine, the rate alone decides how soon that can be
        while time.monotonic() - started < 60:
            with lock:
                if sum(got) >= 13:
                    return
            n = len(claim(dsn, "k.rated", 20, rate))
            with lock:
                got.append(n)
            time.sleep(0.02)

    threads = [threading.Thread(target=claimer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = sum(got)
    elapsed = time.monotonic() - started
    assert total >= 13, (total, elapsed, got)
    # a burst of 3, then one every 0.1 s: the 13th no sooner than 1 s after the first
    assert elapsed >= 0.9, (total, elapsed, got)
    assert total <= 3 + 10 * elapsed + 1, (total, elapsed, got)
    assert max(got) <= 3


def test_a_daemon_delivers_a_rated_kind_at_its_rate(ob: Outbox, dsn: str) -> None:
    intend(ob, "k.quota", 12)
    recorded_starts: list[float] = []
    lock = threading.Lock()

    def record(delivery: Delivery) -> Outcome:
        with lock:
            recorded_starts.append(time.monotonic())
        return Succeeded()

    config = DelivererConfig(rate=5, burst=2)
    one = RecordingDeliverer("k.quota", outcome=record, config=config)
    two = RecordingDeliverer("k.quota", outcome=record, config=config)
    with (
        DaemonThread(dsn, {"k.quota": one}, poll_seconds=0.1),
        DaemonThread(dsn, {"k.quota": two}, poll_seconds=0.1),
    ):
        wait_for(lambda: len(ob.effects(status="succeeded", limit=100)) == 12, timeout=30)
    starts = sorted(recorded_starts)
    span = starts[-1] - starts[0]
    # 12 calls at 5/s with a burst of 2: the last starts no sooner than 10 tokens later
    assert span >= 10 / 5 * 0.9, span
    assert len(one.deliveries) + len(two.deliveries) == 12


def explain_claim(ob: Outbox, kind: str, *, lanes: bool) -> str:
    """The plan PostgreSQL chooses for one claim of ``kind`` (not executed)."""
    statement = queue.claim(EFFECT_QUEUE, lanes=lanes)
    params = queue.claim_params({"kind": kind}, limit=100, owner="test", lease_seconds=30)
    with ob.engine.begin() as conn:
        compiled = statement.compile(dialect=conn.dialect)
        rows = conn.exec_driver_sql("EXPLAIN " + str(compiled), compiled.construct_params(params))
        return "\n".join(row[0] for row in rows)


def test_a_backlog_is_claimed_through_the_index_not_scanned(ob: Outbox, dsn: str) -> None:
    # The one-lane check once read as NOT EXISTS (an earlier lane): the planner
    # guessed a third of the backlog passes and chose a sequential scan, which
    # with one lane read every pending row twice per claim (0.4 s at a million).
    intend(ob, "email.send", 1)
    with ob.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO outbox_effects (id, shard, run_id, step_id, step_index, kind, "
                "payload, payload_hash, idempotency_key, status) SELECT gen_random_uuid(), shard, "
                "run_id, step_id, step_index, kind, payload, payload_hash, "
                "idempotency_key || '-' || g, status "
                "FROM outbox_effects, generate_series(1, 50000) g"
            )
        )
        conn.execute(text("ANALYZE outbox_effects"))
    plan = explain_claim(ob, "email.send", lanes=False)
    assert "Seq Scan on outbox_effects" not in plan, plan
    claimed = claim(dsn, "email.send", 100)
    assert len(claimed) == 100
    # With a second lane the lanes statement takes over: index probes too.
    with ob.engine.begin() as conn:
        conn.execute(text("UPDATE outbox_effects SET fairness_key = 'b' WHERE seq % 2 = 0"))
        conn.execute(text("ANALYZE outbox_effects"))
    plan = explain_claim(ob, "email.send", lanes=True)
    assert "Seq Scan on outbox_effects" not in plan, plan
    ids = [c.id for c in claim(dsn, "email.send", 100)]
    with ob.engine.begin() as conn:
        keys = conn.execute(
            text("SELECT DISTINCT fairness_key FROM outbox_effects WHERE id = ANY(:ids)"),
            {"ids": ids},
        )
        assert {row[0] for row in keys} == {"", "b"}  # '' is the default key
