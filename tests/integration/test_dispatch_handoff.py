"""The hand-off from relay to stream deliverer, at the database (no broker needed).

A relay publishes, waits for the broker's acknowledgement, then marks the
effects ``dispatched``. A consumer can read the record before that mark
commits. Expected: the stream deliverer takes an effect a relay still holds
(the record proves it was published), the relay's late mark is fenced and
changes nothing, and an effect held by another *deliverer* is never taken.
"""

from __future__ import annotations

import asyncio
from typing import Any

from outbox import Outbox
from outbox.ids import RELAY_OWNER_PREFIX
from outbox.storage.async_store import AsyncStore, Completion
from outbox.storage.engine import make_async_engine
from outbox.storage.sql.queue import EFFECT_QUEUE

RELAY = RELAY_OWNER_PREFIX + "host:1:abc"


def intend(ob: Outbox, n: int) -> None:
    run = ob.start_run("agent", "1")
    run.transaction("s", lambda tx: [tx.intend("k", {"i": i}) for i in range(n)] and None)


def status_and_owner(ob: Outbox) -> list[tuple[str, str | None]]:
    with ob.engine.connect() as conn:
        rows = conn.exec_driver_sql(
            "SELECT status, lease_owner FROM outbox_effects ORDER BY seq"
        ).all()
    return [(r[0], r[1]) for r in rows]


def test_a_record_read_before_the_relay_marks_it_dispatched_is_delivered(
    ob: Outbox, dsn: str
) -> None:
    intend(ob, 2)

    async def main() -> dict[str, Any]:
        store = AsyncStore(make_async_engine(dsn))
        try:
            held = await store.claim_many(
                EFFECT_QUEUE, [({"kind": "k"}, 10)], owner=RELAY, lease_seconds=30
            )
            ids = [row.id for row in held]
            # The consumer reads the records while the relay waits for its acks.
            taken = await store.claim_dispatched(ids, owner="stream-1", lease_seconds=30)
            # The relay's mark comes late: fenced, it keeps nothing.
            kept = await store.mark_dispatched(
                RELAY, [(row.id, row.attempt) for row in held], dispatch_ttl=60
            )
            logged = await store.complete(
                "stream-1",
                [Completion(row.id, row.attempt, "succeeded", "succeeded") for row in taken],
            )
            return {"held": held, "taken": taken, "kept": kept, "logged": logged}
        finally:
            await store.dispose()

    out = asyncio.run(main())
    assert len(out["held"]) == 2
    assert {r.id for r in out["taken"]} == {r.id for r in out["held"]}
    assert {r.attempt for r in out["taken"]} == {1}, "the relay's attempt, not a new one"
    assert out["kept"] == set()
    assert sorted(outcome for _, outcome in out["logged"]) == ["succeeded", "succeeded"]
    assert status_and_owner(ob) == [("succeeded", None), ("succeeded", None)]


def test_an_effect_held_by_a_deliverer_is_not_taken_by_a_stream_deliverer(
    ob: Outbox, dsn: str
) -> None:
    intend(ob, 1)

    async def main() -> tuple[list[Any], list[Any]]:
        store = AsyncStore(make_async_engine(dsn))
        try:
            held = await store.claim_many(
                EFFECT_QUEUE, [({"kind": "k"}, 10)], owner="poll-deliverer", lease_seconds=30
            )
            taken = await store.claim_dispatched(
                [row.id for row in held], owner="stream-1", lease_seconds=30
            )
            return held, taken
        finally:
            await store.dispose()

    held, taken = asyncio.run(main())
    assert len(held) == 1 and taken == []
    assert status_and_owner(ob) == [("in_flight", "poll-deliverer")]


def test_cancelling_a_run_cancels_its_dispatched_effects(ob: Outbox, dsn: str) -> None:
    """An effect handed to Kafka has not started: a cancel stops it, as it stops a pending one.

    Expected: the run ends ``cancelled`` at once, the dispatched effect is
    ``cancelled``, and a stream deliverer that reads its record afterwards skips it.
    """
    run = ob.start_run("agent", "1")
    run.transaction("s", lambda tx: tx.intend("k", {"i": 1}) and None)

    async def dispatch() -> None:
        store = AsyncStore(make_async_engine(dsn))
        try:
            held = await store.claim_many(
                EFFECT_QUEUE, [({"kind": "k"}, 10)], owner=RELAY, lease_seconds=30
            )
            await store.mark_dispatched(
                RELAY, [(row.id, row.attempt) for row in held], dispatch_ttl=60
            )
        finally:
            await store.dispose()

    async def late_record() -> list[Any]:
        store = AsyncStore(make_async_engine(dsn))
        try:
            ids = [e.id for e in ob.effects(limit=10)]
            return await store.claim_dispatched(ids, owner="stream-1", lease_seconds=30)
        finally:
            await store.dispose()

    asyncio.run(dispatch())
    assert status_and_owner(ob) == [("dispatched", None)]
    assert ob.cancel(run.id, "not needed").value == "cancelled"
    assert [s for s, _ in status_and_owner(ob)] == ["cancelled"]
    assert asyncio.run(late_record()) == []
