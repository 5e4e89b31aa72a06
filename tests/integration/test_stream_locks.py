"""Stream mode's row locks under contention: deliverers' claims of the same dispatched rows.

Stream deliverers claim the effects a relay dispatched, each naming the same
rows in its own order (a group's copies after a rebalance, the relay's batch
in claim order). Every claim locks the rows in id order, so none of them ever
deadlocks (the bench once ended with ``deadlock detected`` from such a mix),
and each effect is claimed by exactly one deliverer.
"""

from __future__ import annotations

import asyncio
import random

from outbox import Outbox
from outbox.ids import RELAY_OWNER_PREFIX
from outbox.storage.async_store import AsyncStore
from outbox.storage.engine import make_async_engine
from outbox.storage.sql.dispatch import DISPATCH_QUEUE

KIND = "k.locks"
RELAY = RELAY_OWNER_PREFIX + "test:1:locks"
ROUNDS, PER_ROUND, DELIVERERS = 8, 60, 3


def test_claims_of_the_same_rows_in_any_order_never_deadlock(ob: Outbox, dsn: str) -> None:
    run = ob.start_run("agent", "1")
    n = ROUNDS * PER_ROUND
    run.transaction("s", lambda tx: [tx.intend(KIND, {"i": i}) for i in range(n)] and None)
    shuffle = random.Random(15).shuffle

    async def main() -> None:
        store = AsyncStore(make_async_engine(dsn, pool_size=DELIVERERS + 2))
        try:
            owners: dict[object, list[str]] = {}
            for _ in range(ROUNDS):
                held = await store.claim_many(
                    DISPATCH_QUEUE, [({"kind": KIND}, PER_ROUND)], owner=RELAY, lease_seconds=600
                )
                orders = []
                for _ in range(DELIVERERS):
                    ids = [e.id for e in held]
                    shuffle(ids)
                    orders.append(ids)
                claims = [
                    asyncio.create_task(
                        store.claim_dispatched(ids, owner=f"d{k}", lease_seconds=60)
                    )
                    for k, ids in enumerate(orders)
                ]
                await asyncio.gather(*claims)
                for k, claim in enumerate(claims):
                    for effect in claim.result():
                        owners.setdefault(effect.id, []).append(f"d{k}")
            assert len(owners) == n
            assert all(len(who) == 1 for who in owners.values())
        finally:
            await store.dispose()

    asyncio.run(main())
