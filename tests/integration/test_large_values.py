"""Large values by reference on the delivery side: claims return the reference, calls get the value.

A claim never reads a blob (its rows stay small, whatever the payload); the
daemon reads one payload just before calling the deliverer with it.
"""

from __future__ import annotations

import asyncio

from deliverers.testing import RecordingDeliverer
from outbox import Outbox
from outbox.blobs import is_reference
from outbox.storage.async_store import AsyncStore
from outbox.storage.engine import make_async_engine
from outbox.storage.sql.queue import EFFECT_QUEUE
from tests.support import DaemonThread, wait_for

BIG = {"document": "x" * (5 * 1024 * 1024)}


def test_a_claim_returns_the_reference_and_the_deliverer_gets_the_payload(
    ob: Outbox, dsn: str
) -> None:
    run = ob.start_run("agent", "1")
    run.transaction("s", lambda tx: tx.intend("k.big", BIG) and None)

    async def claim_and_read() -> tuple[object, object]:
        store = AsyncStore(make_async_engine(dsn))
        try:
            (claimed,) = await store.claim_many(
                EFFECT_QUEUE, [({"kind": "k.big"}, 10)], owner="t", lease_seconds=1
            )
            return claimed.payload, (await store.with_payload(claimed)).payload
        finally:
            await store.dispose()

    as_claimed, as_read = asyncio.run(claim_and_read())
    assert is_reference(as_claimed) and as_read == BIG


def test_the_daemon_delivers_a_large_payload_whole(ob: Outbox, dsn: str) -> None:
    run = ob.start_run("agent", "1")
    run.transaction(
        "s", lambda tx: [tx.intend("k.big", {**BIG, "n": n}) for n in range(3)] and None
    )
    recorder = RecordingDeliverer("k.big")
    with DaemonThread(dsn, {"k.big": recorder}, poll_seconds=0.1):
        wait_for(lambda: len(ob.effects(status="succeeded")) == 3, timeout=60)
    assert sorted(d.payload["n"] for d in recorder.deliveries) == [0, 1, 2]
    assert all(d.payload["document"] == BIG["document"] for d in recorder.deliveries)
