"""On Citus a deliverer's claim runs beside the statements that write its last outcomes.

Each statement there commits on its own, so nothing ties the claim to the
outcomes' transaction; side by side the round waits for the slower of the two,
not for both (``AsyncStore._complete_beside_claim``). Two things must still
hold: what a claim committed reaches the deliverer even when the outcomes
failed (or its leases would run out on effects nobody called), and an outcome
that frees the next effect of its ordering key has that effect claimed in the
same round.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from functools import partial
from typing import Any

import psycopg
import pytest

from outbox import Outbox, StepTransaction
from outbox.delivery.recording import ClaimRider, OutcomeWriter, Written
from outbox.shards import key_shard, shard_of
from outbox.storage.async_store import AsyncStore, Completion
from outbox.storage.engine import make_async_engine
from outbox.storage.outcome_writes import OUTCOME_PART_ROWS
from outbox.storage.sql.queue import EFFECT_QUEUE
from tests.support import in_flight


def _intend(tx: StepTransaction, kind: str, count: int, key: str | None = None) -> None:
    for n in range(count):
        tx.intend(kind, {"n": n}, ordering_key=key)


def test_what_a_claim_took_beside_failed_outcomes_reaches_the_deliverer(
    ob: Outbox, dsn: str
) -> None:
    """The outcome's statement fails (a result no JSON column takes); the claim beside it
    committed its rows: they come back with the batch, and the outcome is written alone."""
    kind, owner = "k.beside", "beside-1"
    for _ in range(3):
        ob.start_run("beside", "1").transaction("s", partial(_intend, kind=kind, count=3))

    async def batch() -> tuple[Any, Written]:
        store = AsyncStore(make_async_engine(dsn))
        try:
            first = (
                await store.claim_many(
                    EFFECT_QUEUE, [({"kind": kind}, 1)], owner=owner, lease_seconds=60
                )
            )[0]
            poison = Completion(
                first.id,
                first.attempt,
                "succeeded",
                "succeeded",
                result_json='{"amount": 1',
                shard=first.shard,
            )
            rider = ClaimRider(quotas=[({"kind": kind}, 5)], lease_seconds=60)
            return first, await OutcomeWriter(store, owner).write([poison], rider=rider)
        finally:
            await store.dispose()

    first, written = asyncio.run(batch())
    claimed = {e.id for e in written.claimed}
    assert len(claimed) == 5, written
    assert in_flight(dsn, owner) == claimed, "every row claimed is held by the deliverer"
    # the outcome itself, refused whole, is written in its minimal form, alone
    assert first.id in written.substituted
    assert ob.effect(first.id).status.value != "in_flight"


def test_an_outcome_that_frees_the_next_of_its_ordering_key_has_it_claimed_at_once(
    ob: Outbox, dsn: str
) -> None:
    """The second effect of a key waits for the first; the round that records the first's
    outcome claims it (a claim beside the outcome would not see it free)."""
    kind, owner = "k.beside.ordered", "beside-2"
    run = ob.start_run("beside", "1")
    run.transaction("s", partial(_intend, kind=kind, count=2, key=f"key-{uuid.uuid4()}"))
    ids = [e.id for e in sorted(ob.effects(run_id=run.id), key=lambda e: e.seq or 0)]

    async def rounds() -> list[list[uuid.UUID]]:
        store = AsyncStore(make_async_engine(dsn))
        try:
            quotas = [({"kind": kind}, 10)]
            # two connections open already, as in a running deliverer: a claim
            # beside the outcome would start at once, before the outcome commits
            got, _ = await asyncio.gather(
                store.claim_many(EFFECT_QUEUE, quotas, owner=owner, lease_seconds=60),
                store.claim_many(
                    EFFECT_QUEUE, [({"kind": "k.none"}, 1)], owner=owner, lease_seconds=60
                ),
            )
            taken = [[e.id for e in got]]
            done = [
                Completion(e.id, e.attempt, "succeeded", "succeeded", shard=shard_of(run.id))
                for e in got
            ]
            batched = await store.complete_and_claim(
                owner, done, EFFECT_QUEUE, quotas, lease_seconds=60
            )
            return [*taken, [e.id for e in batched.claimed]]
        finally:
            await store.dispose()

    assert asyncio.run(rounds()) == [[ids[0]], [ids[1]]]


def test_a_batch_of_one_shard_is_written_in_parts_side_by_side_and_its_record_verifies(
    ob: Outbox, dsn: str
) -> None:
    """120 outcomes of one run (one shard): three statements of at most 50 rows, two of
    them on spare connections; every outcome is logged once and the run's record holds."""
    kind, owner = "k.beside.parts", "beside-3"
    run = ob.start_run("beside", "1")
    run.transaction("s", partial(_intend, kind=kind, count=OUTCOME_PART_ROWS * 2 + 20))
    ids = {e.id for e in ob.effects(run_id=run.id)}

    async def batch() -> list[tuple[uuid.UUID, str]]:
        store = AsyncStore(make_async_engine(dsn))
        try:
            got = await store.claim_many(
                EFFECT_QUEUE, [({"kind": kind}, len(ids))], owner=owner, lease_seconds=60
            )
            assert {e.id for e in got} == ids
            done = [
                Completion(e.id, e.attempt, "succeeded", "succeeded", result_json='{"ok": 1}')
                for e in got
            ]
            return await store.complete(owner, done)
        finally:
            await store.dispose()

    logged = asyncio.run(batch())
    assert sorted(logged) == sorted((i, "succeeded") for i in ids)
    assert {e.status.value for e in ob.effects(run_id=run.id)} == {"succeeded"}
    with psycopg.connect(dsn) as conn:
        attempts = conn.execute(
            "SELECT count(*) FROM outbox_effect_attempts WHERE effect_id = ANY(%s)", [list(ids)]
        ).fetchone()
    assert attempts == (len(ids),)
    run.complete({"ok": True})
    assert ob.verify_run(run.id) == []


def _runs_on_one_shard(ob: Outbox, count: int) -> list[Any]:
    """``count`` runs on one shard: started with business keys of that shard."""
    prefix = uuid.uuid4().hex
    target = key_shard("default", f"{prefix}-0")
    keys = (f"{prefix}-{n}" for n in range(10_000))
    chosen = [k for k in keys if key_shard("default", k) == target][:count]
    return [ob.start_run("beside", "1", key=k) for k in chosen]


def test_parts_that_committed_are_kept_when_another_part_fails(ob: Outbox, dsn: str) -> None:
    """Two runs of one shard, 30 outcomes each: two parts. The second holds an outcome no
    statement takes; the first part's 30 stay written once (they were written again, each
    with a second, stale attempt-log row), and the second's are written without it."""
    kind, owner = "k.beside.partial", "beside-4"
    first, second = _runs_on_one_shard(ob, 2)
    assert shard_of(first.id) == shard_of(second.id)
    for run in (first, second):
        run.transaction("s", partial(_intend, kind=kind, count=30))
    of_second = {e.id for e in ob.effects(run_id=second.id)}
    ids = {e.id for e in ob.effects(run_id=first.id)} | of_second

    async def batch() -> Written:
        store = AsyncStore(make_async_engine(dsn))
        try:
            got = await store.claim_many(
                EFFECT_QUEUE, [({"kind": kind}, 60)], owner=owner, lease_seconds=60
            )
            assert {e.id for e in got} == ids
            poison = min(of_second)
            done = [
                Completion(
                    e.id,
                    e.attempt,
                    "succeeded",
                    "succeeded",
                    result_json='{"cut": ' if e.id == poison else '{"ok": 1}',
                    shard=e.shard,
                )
                for e in got
            ]
            return await OutcomeWriter(store, owner).write(done)
        finally:
            await store.dispose()

    written = asyncio.run(batch())
    assert set(written.logged) == ids and len(written.substituted) == 1
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT effect_id, count(*) FROM outbox_effect_attempts"
            " WHERE effect_id = ANY(%s) GROUP BY effect_id",
            [list(ids)],
        ).fetchall()
    assert {count for _, count in rows} == {1}, "one attempt-log row an effect"
    assert len(rows) == 60


def test_a_cancelled_round_gives_back_what_its_claim_took(ob: Outbox, dsn: str) -> None:
    """The outcome's statement waits on a row lock; the claim beside it commits; the round
    is cancelled (a stop's grace ran out): the claimed rows are given back, pending again,
    not left in flight until their leases run out uncalled."""
    kind, owner = "k.beside.cancel", "beside-5"
    run = ob.start_run("beside", "1")
    run.transaction("s", partial(_intend, kind=kind, count=4))

    async def round_() -> set[uuid.UUID]:
        store = AsyncStore(make_async_engine(dsn))
        try:
            quotas = [({"kind": kind}, 1)]
            got = await store.claim_many(EFFECT_QUEUE, quotas, owner=owner, lease_seconds=60)
            done = [Completion(e.id, e.attempt, "succeeded", "succeeded") for e in got]
            async with await psycopg.AsyncConnection.connect(dsn) as locker:
                await locker.execute(
                    "SELECT 1 FROM outbox_effects WHERE id = %s AND shard = %s FOR UPDATE",
                    [got[0].id, got[0].shard],
                )
                task = asyncio.ensure_future(
                    store.complete_and_claim(
                        owner, done, EFFECT_QUEUE, [({"kind": kind}, 3)], lease_seconds=60
                    )
                )
                for _ in range(200):  # until the claim beside has committed
                    await asyncio.sleep(0.05)
                    if len(in_flight(dsn, owner)) == 4:
                        break
                claimed = in_flight(dsn, owner) - {got[0].id}
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                await locker.rollback()
            return claimed
        finally:
            await store.dispose()

    claimed = asyncio.run(round_())
    assert len(claimed) == 3
    statuses = {e.id: e.status.value for e in ob.effects(run_id=run.id)}
    assert {statuses[i] for i in claimed} == {"pending"}, statuses


def test_a_round_cancelled_while_its_claim_beside_ends_gives_back_what_it_took(
    ob: Outbox, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The outcomes are written; the claim beside them has committed but not yet
    returned when the round is cancelled (a stop's grace ran out): what it took is
    given back, pending again, not left in flight uncalled until the leases end."""
    kind, owner = "k.beside.late", "beside-6"
    run = ob.start_run("beside", "1")
    run.transaction("s", partial(_intend, kind=kind, count=4))
    real = AsyncStore._claim_partition

    async def slow_to_return(*args: Any, **kwargs: Any) -> Any:
        rows = await real(*args, **kwargs)
        if rows:
            await asyncio.sleep(1.5)  # committed; the round is cancelled meanwhile
        return rows

    async def round_() -> set[uuid.UUID]:
        store = AsyncStore(make_async_engine(dsn))
        try:
            quotas = [({"kind": kind}, 1)]
            got = await store.claim_many(EFFECT_QUEUE, quotas, owner=owner, lease_seconds=60)
            done = [Completion(e.id, e.attempt, "succeeded", "succeeded") for e in got]
            monkeypatch.setattr(AsyncStore, "_claim_partition", slow_to_return)
            task = asyncio.ensure_future(
                store.complete_and_claim(
                    owner, done, EFFECT_QUEUE, [({"kind": kind}, 3)], lease_seconds=60
                )
            )
            for _ in range(200):  # until the claim beside has committed
                await asyncio.sleep(0.05)
                if len(in_flight(dsn, owner)) == 3 and got[0].id not in in_flight(dsn, owner):
                    break
            claimed = in_flight(dsn, owner)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return claimed
        finally:
            await store.dispose()

    claimed = asyncio.run(round_())
    assert len(claimed) == 3
    statuses = {e.id: e.status.value for e in ob.effects(run_id=run.id)}
    assert {statuses[i] for i in claimed} == {"pending"}, statuses
