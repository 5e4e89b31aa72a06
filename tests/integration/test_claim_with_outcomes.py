"""Outcomes of batch N and the claim of batch N+1 commit together; poison is still isolated."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg

from deliverers.testing import RecordingDeliverer
from outbox import Outbox
from outbox.delivery.recording import ClaimRider, OutcomeWriter
from outbox.models import AttemptOutcome, EffectStatus
from outbox.storage.async_store import AsyncStore, ClaimedEffect, Completion
from outbox.storage.dsn import libpq_dsn
from outbox.storage.engine import make_async_engine
from outbox.storage.sql.queue import EFFECT_QUEUE
from tests.support import DaemonThread, wait_for


def intend(ob: Outbox, n: int, kind: str = "k") -> None:
    run = ob.start_run("agent", "1")
    run.transaction("s", lambda tx: [tx.intend(kind, {"n": i}) for i in range(n)] and None)


def sql(dsn: str, text: str, params: Any = ()) -> list[tuple[Any, ...]]:
    with psycopg.connect(libpq_dsn(dsn), autocommit=True) as conn:
        return conn.execute(text, params).fetchall()


def succeeded(claimed: list[ClaimedEffect]) -> list[Completion]:
    return [
        Completion(c.id, c.attempt, EffectStatus.SUCCEEDED, AttemptOutcome.SUCCEEDED)
        for c in claimed
    ]


def test_outcomes_and_the_next_claim_commit_in_one_transaction(ob: Outbox, dsn: str) -> None:
    intend(ob, 10)

    async def main() -> tuple[list[ClaimedEffect], list[ClaimedEffect], dict[Any, str]]:
        store = AsyncStore(make_async_engine(dsn))
        try:
            first = await store.claim_many(
                EFFECT_QUEUE, [({"kind": "k"}, 5)], owner="me", lease_seconds=30
            )
            written = await OutcomeWriter(store, "me").write(
                succeeded(first), rider=ClaimRider([({"kind": "k"}, 5)], 30.0)
            )
            return first, written.claimed, written.logged
        finally:
            await store.dispose()

    first, second, logged = asyncio.run(main())
    assert logged == {c.id: "succeeded" for c in first}
    assert len(second) == 5 and not {c.id for c in second} & {c.id for c in first}
    assert all(c.lease_owner == "me" and c.attempt == 1 for c in second)
    # One transaction: the rows it claimed and the attempt log it wrote share their xid.
    xids = sql(
        dsn,
        "SELECT DISTINCT xmin::text FROM outbox_effects WHERE id = ANY(%s) "
        "UNION SELECT DISTINCT xmin::text FROM outbox_effect_attempts",
        [[c.id for c in second]],
    )
    assert len(xids) == 1


def test_a_poison_outcome_with_a_claim_is_isolated_and_claims_nothing(ob: Outbox, dsn: str) -> None:
    intend(ob, 8)

    async def main() -> tuple[Any, list[ClaimedEffect], Any]:
        store = AsyncStore(make_async_engine(dsn))
        try:
            claimed = await store.claim_many(
                EFFECT_QUEUE, [({"kind": "k"}, 4)], owner="me", lease_seconds=30
            )
            batch = succeeded(claimed)
            # a NUL in a text column: PostgreSQL refuses the whole statement
            batch[1] = Completion(
                claimed[1].id, 1, EffectStatus.FAILED, AttemptOutcome.FAILED, error="a\x00b"
            )
            written = await OutcomeWriter(store, "me").write(
                batch, rider=ClaimRider([({"kind": "k"}, 4)], 30.0)
            )
            return written, claimed, claimed[1].id
        finally:
            await store.dispose()

    written, _, poison = asyncio.run(main())
    assert list(written.substituted) == [poison] and not written.left and not written.abandoned
    assert written.claimed == [], "the claim rolled back with the refused write"
    states = dict(sql(dsn, "SELECT status, count(*) FROM outbox_effects GROUP BY status"))
    assert states == {"succeeded": 3, "failed": 1, "pending": 4}


def test_a_draining_daemon_claims_with_its_outcomes(ob: Outbox, dsn: str) -> None:
    n = 600
    intend(ob, n)
    deliverer = RecordingDeliverer("k")
    with DaemonThread(dsn, {"k": deliverer}, batch_size=50, concurrency=50):
        wait_for(
            lambda: (
                sql(dsn, "SELECT count(*) FROM outbox_effects WHERE status = 'succeeded'")[0][0]
                == n
            ),
            timeout=60,
            message="the backlog drained",
        )
    assert sorted(deliverer.keys) == sorted(e.idempotency_key for e in ob.effects(limit=n))
    # A claim's now() is its transaction's start; an outcome logged in the same
    # transaction has the same finished_at. Claims that rode with outcomes:
    claims, rode = sql(
        dsn,
        "SELECT count(DISTINCT e.attempt_started_at), count(DISTINCT e.attempt_started_at) "
        "FILTER (WHERE EXISTS (SELECT 1 FROM outbox_effect_attempts a "
        "WHERE a.finished_at = e.attempt_started_at)) FROM outbox_effects e",
    )[0]
    assert rode >= 1 and claims - rode < claims, (claims, rode)
