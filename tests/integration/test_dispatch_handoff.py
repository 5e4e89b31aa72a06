"""The hand-off from relay to stream deliverer, at the database (no broker needed).

A relay claims a batch straight into ``dispatched`` (leased to it for the
dispatch TTL), publishes it, and gives back what the broker did not take.
Expected: a stream deliverer takes a dispatched effect over with the relay's
attempt; the relay's give-back of an effect a deliverer already took is
fenced and changes nothing; what it gives back in time is ``pending`` again;
an effect in flight under a relay of an earlier version (which marked after
publishing) is still taken; an effect held by another *deliverer* never is; a
relay that is gone (its session lock free) has its dispatches end early.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from outbox import Outbox
from outbox.delivery.attempt import released
from outbox.ids import RELAY_OWNER_PREFIX
from outbox.storage.async_store import AsyncStore, Completion
from outbox.storage.engine import make_async_engine
from outbox.storage.owner_lock import OwnerLock
from outbox.storage.sql.dispatch import DISPATCH_QUEUE
from outbox.storage.sql.queue import EFFECT_QUEUE

RELAY = RELAY_OWNER_PREFIX + "host:1:abc"

T = TypeVar("T")


def intend(ob: Outbox, n: int) -> None:
    run = ob.start_run("agent", "1")
    run.transaction("s", lambda tx: [tx.intend("k", {"i": i}) for i in range(n)] and None)


def status_and_owner(ob: Outbox) -> list[tuple[str, str | None]]:
    with ob.engine.connect() as conn:
        rows = conn.exec_driver_sql(
            "SELECT status, lease_owner FROM outbox_effects ORDER BY seq"
        ).all()
    return [(r[0], r[1]) for r in rows]


def on_store(dsn: str, work: Callable[[AsyncStore], Awaitable[T]]) -> T:
    """Run ``work`` on a store of its own, as a process of its own would."""

    async def main() -> T:
        store = AsyncStore(make_async_engine(dsn))
        try:
            return await work(store)
        finally:
            await store.dispose()

    return asyncio.run(main())


def claimed_then_read(dsn: str, owner: str) -> tuple[list[Any], list[Any]]:
    """``owner`` claims (the poll claim, into ``in_flight``); a stream deliverer reads them."""

    async def work(store: AsyncStore) -> tuple[list[Any], list[Any]]:
        held = await store.claim_many(
            EFFECT_QUEUE, [({"kind": "k"}, 10)], owner=owner, lease_seconds=30
        )
        taken = await store.claim_dispatched(
            [row.id for row in held], owner="stream-1", lease_seconds=30
        )
        return held, taken

    return on_store(dsn, work)


def test_a_dispatched_effect_is_taken_over_and_a_late_give_back_is_fenced(
    ob: Outbox, dsn: str
) -> None:
    intend(ob, 3)

    async def work(store: AsyncStore) -> dict[str, Any]:
        held = await store.claim_many(
            DISPATCH_QUEUE, [({"kind": "k"}, 10)], owner=RELAY, lease_seconds=300
        )
        # A relay holds no lease to extend: a long-lived relay remembers nothing
        # of what it dispatched (its map of held rows' shards stays empty).
        remembered = dict(store._shards.of)
        statuses = status_and_owner(ob)
        # The consumer read two records; the third failed to publish.
        taken = await store.claim_dispatched(
            [row.id for row in held[:2]], owner="stream-1", lease_seconds=30
        )
        # The relay gives back the failed one, and (a flush that timed out after
        # the broker took it) the first too: that one is fenced off.
        given_back = await store.complete(
            RELAY, [released(held[0], "no ack", delay=60), released(held[2], "no ack")]
        )
        logged = await store.complete(
            "stream-1",
            [Completion(row.id, row.attempt, "succeeded", "succeeded") for row in taken],
        )
        return {
            "held": held,
            "remembered": remembered,
            "statuses": statuses,
            "taken": taken,
            "given_back": dict(given_back),
            "logged": logged,
        }

    out = on_store(dsn, work)
    held = out["held"]
    assert len(held) == 3 and {r.attempt for r in held} == {1}
    assert out["remembered"] == {}
    assert out["statuses"] == [("dispatched", RELAY)] * 3
    assert {r.id for r in out["taken"]} == {r.id for r in held[:2]}
    assert {r.attempt for r in out["taken"]} == {1}, "the relay's attempt, not a new one"
    assert out["given_back"] == {held[0].id: "stale", held[2].id: "released"}
    assert sorted(outcome for _, outcome in out["logged"]) == ["succeeded", "succeeded"]
    assert sorted(status_and_owner(ob)) == [
        ("pending", None),
        ("succeeded", None),
        ("succeeded", None),
    ]


def test_an_effect_in_flight_under_an_earlier_relay_is_taken_from_its_record(
    ob: Outbox, dsn: str
) -> None:
    """A relay of an earlier version claimed into ``in_flight`` and marked after publishing."""
    intend(ob, 2)

    held, taken = claimed_then_read(dsn, RELAY)
    assert {r.id for r in taken} == {r.id for r in held} and len(held) == 2
    assert status_and_owner(ob) == [("in_flight", "stream-1")] * 2


def test_an_effect_held_by_a_deliverer_is_not_taken_by_a_stream_deliverer(
    ob: Outbox, dsn: str
) -> None:
    intend(ob, 1)

    held, taken = claimed_then_read(dsn, "poll-deliverer")
    assert len(held) == 1 and taken == []
    assert status_and_owner(ob) == [("in_flight", "poll-deliverer")]


def test_cancelling_a_run_cancels_its_dispatched_effects(ob: Outbox, dsn: str) -> None:
    """An effect handed to Kafka has not started: a cancel stops it, as it stops a pending one.

    Expected: the run ends ``cancelled`` at once, the dispatched effect is
    ``cancelled``, and a stream deliverer that reads its record afterwards skips it.
    """
    run = ob.start_run("agent", "1")
    run.transaction("s", lambda tx: tx.intend("k", {"i": 1}) and None)

    async def dispatch(store: AsyncStore) -> None:
        await store.claim_many(DISPATCH_QUEUE, [({"kind": "k"}, 10)], owner=RELAY, lease_seconds=60)

    async def late_record(store: AsyncStore) -> list[Any]:
        ids = [e.id for e in ob.effects(limit=10)]
        return await store.claim_dispatched(ids, owner="stream-1", lease_seconds=30)

    on_store(dsn, dispatch)
    assert status_and_owner(ob) == [("dispatched", RELAY)]
    assert ob.cancel(run.id, "not needed").value == "cancelled"
    assert [s for s, _ in status_and_owner(ob)] == ["cancelled"]
    assert on_store(dsn, late_record) == []


def test_a_dispatch_whose_ttl_ran_out_is_pending_again_and_nobodys(ob: Outbox, dsn: str) -> None:
    """A relay died between its claim and its publish: no record will ever come.

    Expected: once the TTL has run out, the reconciler's round puts the effect
    back to ``pending`` with the relay's name cleared, logged as ``expired``,
    and the next relay's claim takes it with a new attempt.
    """
    intend(ob, 1)

    async def dispatch_and_expire(store: AsyncStore) -> int:
        await store.claim_many(
            DISPATCH_QUEUE, [({"kind": "k"}, 10)], owner=RELAY, lease_seconds=0.05
        )
        await asyncio.sleep(0.2)
        redispatched, _ = await store.expired(100, redispatch_as="reconciler:test")
        return redispatched

    async def dispatch_again(store: AsyncStore) -> list[Any]:
        return await store.claim_many(
            DISPATCH_QUEUE, [({"kind": "k"}, 10)], owner=RELAY + "-2", lease_seconds=300
        )

    assert on_store(dsn, dispatch_and_expire) == 1
    assert status_and_owner(ob) == [("pending", None)]
    effect = ob.effects(limit=1)[0]
    assert [(a.attempt, a.outcome) for a in ob.store.attempts(effect.id)] == [(1, "expired")]
    again = on_store(dsn, dispatch_again)
    assert [(r.attempt, r.lease_owner) for r in again] == [(2, RELAY + "-2")]
    assert effect.run_id is not None and ob.verify_run(effect.run_id) == []


def test_a_dispatched_effect_cannot_be_completed_by_a_deliverer_that_never_claimed_it(
    ob: Outbox, dsn: str
) -> None:
    """The completion's fence admits ``dispatched`` rows for their own relay only.

    A stream deliverer that reports an outcome without having claimed the effect
    from its record (a stale process, a bug) is logged ``stale`` and changes
    nothing: the effect stays dispatched, for the deliverer that reads its record.
    """
    intend(ob, 1)

    async def work(store: AsyncStore) -> dict[Any, str]:
        held = await store.claim_many(
            DISPATCH_QUEUE, [({"kind": "k"}, 10)], owner=RELAY, lease_seconds=300
        )
        done = [Completion(row.id, row.attempt, "succeeded", "succeeded") for row in held]
        return dict(await store.complete("stream-1", done))

    logged = on_store(dsn, work)
    assert list(logged.values()) == ["stale"]
    assert status_and_owner(ob) == [("dispatched", RELAY)]


def test_a_gone_relays_dispatches_end_early_and_a_live_relays_do_not(ob: Outbox, dsn: str) -> None:
    """A relay holds its owner's session lock; killed, its lock is free (it stays registered).

    Expected: its dispatch leases end at once (the next reconcile round dispatches
    them again, logged ``expired``), though the TTL has 300 s to run; a relay whose
    lock is held keeps its own; just after a server (re)start nobody counts as gone;
    and a gone relay is unregistered only once nothing it dispatched is left.
    """
    intend(ob, 4)
    alive = RELAY_OWNER_PREFIX + "host:2:def"

    async def work(store: AsyncStore) -> dict[str, Any]:
        locks = {owner: OwnerLock(store.dsn, owner) for owner in (RELAY, alive)}
        for owner, lock in locks.items():
            lock.start()
            assert await lock.wait_held(10)
            await store.claim_many(
                DISPATCH_QUEUE, [({"kind": "k"}, 2)], owner=owner, lease_seconds=300
            )
        await locks[RELAY].close()  # its backend ended (its row stays: it died)
        async with store.engine.begin() as conn:
            await conn.exec_driver_sql(
                "INSERT INTO outbox_owners (owner, registered_at)"
                " VALUES (%(o)s, now() - interval '1 hour')",
                {"o": RELAY},
            )
        found: dict[str, Any] = {
            "gone": await store.gone_relays(restart_grace=0),
            "in_restart_window": await store.end_relay_dispatches(
                RELAY, ttl=0, gone_only=True, restart_grace=1e9
            ),
            "alive": await store.end_relay_dispatches(
                alive, ttl=0, gone_only=True, restart_grace=0
            ),
            "forgotten_holding": await store.forget_gone_owners([RELAY], restart_grace=0),
            "gone_ended": await store.end_relay_dispatches(
                RELAY, ttl=0, gone_only=True, restart_grace=0
            ),
        }
        await asyncio.sleep(0.01)
        found["redispatched"] = (await store.expired(100, redispatch_as="reconciler:t"))[0]
        found["forgotten"] = await store.forget_gone_owners([RELAY], restart_grace=0)
        await locks[alive].close()
        return found

    found = on_store(dsn, work)
    assert found == {
        "gone": [RELAY],
        "in_restart_window": 0,
        "alive": 0,
        "forgotten_holding": 0,
        "gone_ended": 2,
        "redispatched": 2,
        "forgotten": 1,
    }
    assert sorted(status_and_owner(ob), key=str) == sorted(
        [("dispatched", alive)] * 2 + [("pending", None)] * 2, key=str
    )
    run_id = ob.effects(limit=1)[0].run_id
    assert run_id is not None and ob.verify_run(run_id) == []


def test_a_relay_starting_under_a_dead_relays_name_ends_its_dispatches(
    ob: Outbox, dsn: str
) -> None:
    """Holding the name's lock, a relay knows what is dispatched under the name is a
    predecessor's (a relay restarted with ``--owner``): those leases end at once."""
    intend(ob, 2)

    async def work(store: AsyncStore) -> tuple[int, int]:
        await store.claim_many(
            DISPATCH_QUEUE, [({"kind": "k"}, 10)], owner=RELAY, lease_seconds=300
        )
        ended = await store.end_relay_dispatches(RELAY, ttl=0, gone_only=False, restart_grace=0)
        await asyncio.sleep(0.01)
        return ended, (await store.expired(100, redispatch_as="reconciler:t"))[0]

    assert on_store(dsn, work) == (2, 2)
    assert status_and_owner(ob) == [("pending", None)] * 2
