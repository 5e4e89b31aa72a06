"""G4: a deliverer whose lease expired cannot overwrite the outcome of a newer attempt."""

from __future__ import annotations

import asyncio
import threading
import uuid

from sqlalchemy import func, update

from deliverers.testing import RecordingDeliverer
from outbox import EffectStatus, Outbox
from outbox.delivery import Delivery, Outcome, Succeeded
from outbox.storage.async_store import AsyncStore, Completion
from outbox.storage.engine import make_async_engine
from outbox.storage.schema import effects
from outbox.storage.sql.queue import EFFECT_QUEUE
from tests.support import DaemonThread, wait_for


def test_stale_completion_is_logged_and_changes_nothing(ob: Outbox, dsn: str) -> None:
    run = ob.start_run("agent", "1")
    run.transaction("s", lambda tx: tx.intend("test.block", {"n": 1}) and None)
    release_a = threading.Event()

    def slow_then_succeed(delivery: Delivery) -> Outcome:
        release_a.wait(60)
        return Succeeded({"by": "A"})

    a = RecordingDeliverer("test.block", outcome=slow_then_succeed)
    b = RecordingDeliverer("test.block", outcome=lambda d: Succeeded({"by": "B"}))

    # A has one slot: busy with attempt 1, it claims nothing else.
    with DaemonThread(
        dsn, {"test.block": a}, owner="A", lease_seconds=6, concurrency=1, reconcile_seconds=3600
    ) as daemon_a:
        wait_for(lambda: a.deliveries, message="A is inside the call")
        with DaemonThread(dsn, {"test.block": b}, owner="B", reconcile_seconds=0.1):

            def expire_until_taken_over() -> bool:
                # Force A's lease to run out (A's heartbeat may push it back once).
                with ob.engine.begin() as conn:
                    conn.execute(
                        update(effects)
                        .where(effects.c.lease_owner == "A")
                        .values(lease_expires_at=effects.c.created_at)
                    )
                return ob.effects()[0].status == EffectStatus.SUCCEEDED

            wait_for(expire_until_taken_over, message="B redelivers and succeeds")
            effect = ob.effects()[0]
            assert effect.result == {"by": "B"} and effect.attempt == 2
            # A's heartbeat finds the lease gone while its call still runs.
            wait_for(
                lambda: (
                    daemon_a.daemon is not None
                    and daemon_a.daemon.metrics.leases_lost.labels(kind="test.block")._value.get()
                    >= 1
                ),
                message="A noticed its lost lease",
            )
            release_a.set()  # A's call returns now, for the attempt it lost

            def stale_logged() -> bool:
                return any(x.outcome == "stale" for x in ob.store.attempts(effect.id))

            wait_for(stale_logged, message="A's stale outcome in the attempt log")

    after = ob.effect(effect.id)
    assert after.status == EffectStatus.SUCCEEDED
    assert after.result == {"by": "B"}, "the newer attempt's outcome stands"
    assert after.attempt == 2
    log = [(x.attempt, x.outcome, x.worker) for x in ob.store.attempts(effect.id)]
    assert log[0][:2] == (1, "expired") and (log[0][2] or "").startswith("reconciler:")
    assert (2, "succeeded", "B") in log
    stale = [x for x in ob.store.attempts(effect.id) if x.outcome == "stale"]
    assert [(x.attempt, x.worker) for x in stale] == [(1, "A")]
    assert stale[0].detail["reported"] == "succeeded"
    assert [d.idempotency_key for d in a.deliveries + b.deliveries] == [effect.idempotency_key] * 2


def test_a_batch_with_an_older_attempts_outcome_beside_the_current_one_logs_it_stale(
    ob: Outbox, dsn: str
) -> None:
    """A deliverer retrying a failed completion can send attempt 1's outcome in the
    same batch as attempt 2's (the reconciler had redelivered in between, as when a
    Citus worker came back): only attempt 2 is the effect's outcome."""
    run = ob.start_run("agent", "1")
    run.transaction("s", lambda tx: tx.intend("k", {"n": 1}) and None)

    async def main() -> list[tuple[uuid.UUID, str]]:
        store = AsyncStore(make_async_engine(dsn))
        try:
            first = await store.claim_many(
                EFFECT_QUEUE, [({"kind": "k"}, 1)], owner="A", lease_seconds=30
            )
            # the reconciler sets attempt 1 aside; the same deliverer takes attempt 2
            with ob.engine.begin() as conn:
                conn.execute(
                    update(effects).values(
                        status="pending", lease_owner=None, available_at=func.now()
                    )
                )
            second = await store.claim_many(
                EFFECT_QUEUE, [({"kind": "k"}, 1)], owner="A", lease_seconds=30
            )
            assert [c.attempt for c in first + second] == [1, 2]
            return await store.complete(
                "A",
                [
                    Completion(first[0].id, 1, "succeeded", "succeeded"),
                    Completion(second[0].id, 2, "succeeded", "succeeded"),
                ],
            )
        finally:
            await store.dispose()

    logged = asyncio.run(main())
    assert sorted(outcome for _, outcome in logged) == ["stale", "succeeded"]
    effect = ob.effects()[0]
    log = sorted((x.attempt, x.outcome) for x in ob.store.attempts(effect.id))
    assert log == [(1, "stale"), (2, "succeeded")]
    assert effect.status == EffectStatus.SUCCEEDED and effect.attempt == 2
