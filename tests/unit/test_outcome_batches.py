"""How many writes a batch of outcomes costs: one on one server, one per shard on Citus.

And a source that lingers (a Kafka source, whose claims do not ride its
writes) has the attempts still under way recorded with the ones that ended
first. Both on :class:`~outbox.delivery.memory.InMemoryStore`, which counts
the statements a PostgreSQL store would send.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from outbox.delivery import Deliverer, Delivery, Outcome, Succeeded
from outbox.delivery.daemon import DeliveryDaemon
from outbox.delivery.memory import InMemoryStore
from outbox.delivery.recording import OutcomeWriter, Written
from outbox.delivery.settings import DeliverySettings
from outbox.delivery.sources import PollSource, Writing
from outbox.models import AttemptOutcome, EffectStatus
from outbox.storage.attempts import Completion
from outbox.storage.sql.queue import EFFECT_QUEUE

pytestmark = pytest.mark.timeout(30)


class ShardedStore(InMemoryStore):
    """The same rules, as a distributed database's store says of itself."""

    distributed = True


async def claimed_outcomes(store: InMemoryStore, n: int) -> list[Completion]:
    for i in range(n):
        store.add("k.a", {"n": i})
    claimed = await store.claim_many(
        EFFECT_QUEUE, [({"kind": "k.a"}, n)], owner="me", lease_seconds=10.0
    )
    return [
        Completion(e.id, e.attempt, EffectStatus.SUCCEEDED, AttemptOutcome.SUCCEEDED, shard=i % 32)
        for i, e in enumerate(claimed)
    ]


@pytest.mark.parametrize(("store", "writes"), [(InMemoryStore(), 1), (ShardedStore(), 32)])
def test_a_batch_naming_many_shards_is_one_write_on_one_server(
    store: InMemoryStore, writes: int
) -> None:
    async def main() -> Written:
        done = await claimed_outcomes(store, 100)
        return await OutcomeWriter(store, "me").write(done)

    written = asyncio.run(main())
    assert len(written.logged) == 100 and not written.left
    assert store.calls["complete"] == writes


class Staggered(Deliverer):
    """Succeeds after as many hundredths of a second as the payload's ``n``."""

    default_idempotent = True

    async def deliver(self, delivery: Delivery) -> Outcome:
        await asyncio.sleep(delivery.payload["n"] / 100)
        return Succeeded()


class LingeringSource(PollSource):
    """A poll source whose claims do not ride its writes, as a Kafka source's do not."""

    def __init__(self, store: Any, settings: DeliverySettings, linger: float) -> None:
        super().__init__(store, settings)
        self.linger = linger

    async def write(self, batch: list[Completion], writing: Writing) -> Written:
        return await writing.writer.write(batch, timeout=writing.timeout)


def writes_for_ten_staggered_calls(linger: float) -> int:
    store = InMemoryStore()
    settings = DeliverySettings(poll_seconds=0.05, reconcile_seconds=0.05, grace_seconds=2.0)

    async def main() -> int:
        daemon = DeliveryDaemon(
            store,
            {"k.a": Staggered("k.a", Staggered.config_model())},
            settings,
            source=LingeringSource(store, settings, linger),
        )
        task = asyncio.create_task(daemon.run())
        try:
            await asyncio.sleep(0.1)  # claiming, finding nothing
            for n in range(10):
                store.add("k.a", {"n": n})
            while daemon.delivered < 10:
                await asyncio.sleep(0.005)
        finally:
            daemon.stop()
            await asyncio.wait_for(task, 10)
        return store.calls["complete"]

    return asyncio.run(main())


def test_a_lingering_source_records_the_calls_under_way_with_the_first_to_end() -> None:
    # The calls end 10 ms apart over 90 ms: a linger of a second covers them all,
    # none writes each on its own.
    assert writes_for_ten_staggered_calls(1.0) == 1
    assert writes_for_ten_staggered_calls(0.0) >= 5
