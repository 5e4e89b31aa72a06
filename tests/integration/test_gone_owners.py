"""Owner locks: a deliverer whose session lock is free is gone; a restart or blip is no death."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg

from deliverers.testing import RecordingDeliverer
from outbox import Outbox
from outbox.delivery.liveness import GoneOwners
from outbox.storage.async_store import AsyncStore
from outbox.storage.dsn import libpq_dsn
from outbox.storage.engine import make_async_engine
from outbox.storage.owner_lock import OwnerLock
from outbox.storage.sql.dispatch import DISPATCH_QUEUE
from outbox.storage.sql.owners import OWNER_LOCK_CLASS
from outbox.storage.sql.queue import EFFECT_QUEUE

KINDS = ("t.idem", "t.blind")


def deliverers() -> dict[str, Any]:
    return {
        "t.idem": RecordingDeliverer("t.idem", idempotent=True),
        "t.blind": RecordingDeliverer("t.blind", idempotent=False),
    }


def intend(ob: Outbox, n: int = 3) -> None:
    run = ob.start_run("agent", "1")

    def step(tx: Any) -> None:
        for i in range(n):
            for kind in KINDS:
                tx.intend(kind, {"i": i})

    run.transaction("s", step)


def sql(dsn: str, text: str, params: Any = ()) -> list[tuple[Any, ...]]:
    with psycopg.connect(libpq_dsn(dsn), autocommit=True) as conn:
        cur = conn.execute(text, params)
        return cur.fetchall() if cur.description else []


async def claim_all(store: AsyncStore, owner: str) -> None:
    await store.claim_many(
        EFFECT_QUEUE, [({"kind": k}, 100) for k in KINDS], owner=owner, lease_seconds=300
    )


def held_by(dsn: str, owner: str) -> dict[str, int]:
    got = sql(
        dsn,
        "SELECT kind, count(*) FROM outbox_effects "
        "WHERE status = 'in_flight' AND lease_owner = %s GROUP BY kind",
        [owner],
    )
    return dict(got)


def test_gone_owner_loses_only_its_idempotent_attempts(ob: Outbox, dsn: str) -> None:
    intend(ob)

    async def main() -> tuple[list[tuple[str, bool]], list[tuple[str, bool]], int]:
        store = AsyncStore(make_async_engine(dsn))
        try:
            # A deliverer that registered, held its lock, claimed, and died.
            lock = OwnerLock(store.dsn, "victim")
            lock.start()
            assert await lock.wait_held(10)
            await claim_all(store, "victim")
            await lock.close()
            sql(dsn, "INSERT INTO outbox_owners (owner) VALUES ('victim')")  # died, not stopped
            in_restart_window = await store.gone_owners(["t.idem"], restart_grace=1e9)
            gone = await store.gone_owners(["t.idem"], restart_grace=0)
            reconciler = GoneOwners(
                store,
                deliverers(),
                owner="peer",
                grace_seconds=0.2,
                restart_grace_seconds=0,
                default_max_attempts=10,
            )
            assert await reconciler.check() == 0, "not before the grace period"
            await asyncio.sleep(0.3)
            return in_restart_window, gone, await reconciler.check()
        finally:
            await store.dispose()

    in_restart_window, gone, put_back = asyncio.run(main())
    assert in_restart_window == [], "just after a (re)start no owner counts as gone"
    assert gone == [("victim", True)]
    assert put_back == 3
    assert held_by(dsn, "victim") == {"t.blind": 3}, "non-idempotent attempts wait for the lease"
    logged = sql(
        dsn,
        "SELECT e.kind, e.status, a.worker, a.detail->>'resolution' FROM outbox_effect_attempts a "
        "JOIN outbox_effects e ON e.id = a.effect_id",
    )
    assert sorted(logged) == [("t.idem", "pending", "reconciler:peer", "redeliver")] * 3


def test_live_owner_and_unregistered_owner_keep_their_attempts(ob: Outbox, dsn: str) -> None:
    intend(ob)

    async def main() -> list[tuple[str, bool]]:
        store = AsyncStore(make_async_engine(dsn))
        lock = OwnerLock(store.dsn, "alive")
        try:
            lock.start()
            assert await lock.wait_held(10)
            await store.claim_many(
                EFFECT_QUEUE, [({"kind": "t.idem"}, 2)], owner="alive", lease_seconds=300
            )
            # An owner that never registered (a relay, an older deliverer) is left to leases.
            await store.claim_many(
                EFFECT_QUEUE, [({"kind": "t.idem"}, 1)], owner="unregistered", lease_seconds=300
            )
            reconciler = GoneOwners(
                store,
                deliverers(),
                owner="peer",
                grace_seconds=0,
                restart_grace_seconds=0,
                default_max_attempts=10,
            )
            assert await reconciler.check() == 0
            return await store.gone_owners(["t.idem"], restart_grace=0)
        finally:
            await lock.close()
            await store.dispose()

    assert asyncio.run(main()) == []
    assert held_by(dsn, "alive") == {"t.idem": 2}
    assert held_by(dsn, "unregistered") == {"t.idem": 1}
    assert sql(dsn, "SELECT owner FROM outbox_owners") == [], "a clean stop unregisters"


def test_lock_session_that_drops_and_comes_back_is_not_a_death(ob: Outbox, dsn: str) -> None:
    intend(ob)

    async def main() -> tuple[int, bool, int]:
        store = AsyncStore(make_async_engine(dsn))
        lock = OwnerLock(store.dsn, "blinking")
        try:
            lock.start()
            assert await lock.wait_held(10)
            await claim_all(store, "blinking")
            reconciler = GoneOwners(
                store,
                deliverers(),
                owner="peer",
                grace_seconds=2.0,
                restart_grace_seconds=0,
                default_max_attempts=10,
            )
            # Its lock session is cut (an admin, a network blip): the lock is free.
            sql(
                dsn,
                "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' "
                "AND classid = %s AND objid = hashtext('blinking')::oid AND objsubid = 2",
                [OWNER_LOCK_CLASS],
            )
            for _ in range(200):
                if await store.gone_owners(["t.idem"], restart_grace=0):
                    break
                await asyncio.sleep(0.01)
            seen_gone = await reconciler.check()  # suspected, within the grace: nothing moves
            for _ in range(1000):  # it takes its lock again on a new session
                if not await store.gone_owners(["t.idem"], restart_grace=0):
                    break
                await asyncio.sleep(0.01)
            back = await lock.wait_held(10)  # (it registers just after taking the lock)
            await asyncio.sleep(2.1)
            return seen_gone, back, await reconciler.check()
        finally:
            await lock.close()
            await store.dispose()

    seen_gone, back, later = asyncio.run(main())
    assert (seen_gone, back, later) == (0, True, 0)
    assert held_by(dsn, "blinking") == {"t.idem": 3, "t.blind": 3}


def test_reconcile_names_the_attempts_a_dead_deliverer_holds_before_their_leases_end(
    ob: Outbox, dsn: str
) -> None:
    """Right after a kill -9, no lease has expired: "0 expired" alone hid the dead one's work."""
    import json

    from click.testing import CliRunner

    from outbox.cli import cli
    from tests.support import wait_for

    intend(ob, n=2)
    intend(ob, n=1)  # a relay dispatches these two

    async def die_holding() -> None:
        store = AsyncStore(make_async_engine(dsn))
        try:
            for owner, spec, quota in (
                ("relay:host:4243:dead", DISPATCH_QUEUE, 1),
                ("host:4242:dead", EFFECT_QUEUE, 100),
            ):
                lock = OwnerLock(store.dsn, owner)
                lock.start()
                assert await lock.wait_held(10)
                await store.claim_many(
                    spec, [({"kind": k}, quota) for k in KINDS], owner=owner, lease_seconds=300
                )
                await lock.close()
                sql(dsn, "INSERT INTO outbox_owners (owner) VALUES (%s)", [owner])
        finally:
            await store.dispose()

    asyncio.run(die_holding())
    # A lock seen free in the first seconds after the server started is no death.
    wait_for(
        lambda: sql(dsn, "SELECT now() - pg_postmaster_start_time() > interval '6 s'")[0][0],
        timeout=30,
    )
    args = ["--dsn", dsn, "reconcile", "--dry-run"]
    done = CliRunner().invoke(cli, [*args, "--json"], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    report = json.loads(done.output)
    assert report["counts"] == {}, "no lease has ended yet"
    held = {
        g["owner"]: (g["in_flight"], g["dispatched"]) for g in report["held_by_gone_deliverers"]
    }
    assert held == {"host:4242:dead": (4, 0), "relay:host:4243:dead": (0, 2)}
    table = CliRunner().invoke(cli, args, catch_exceptions=False).output
    assert "held by 2 deliverer(s) or relay(s) that are gone" in table
    assert "host:4242:dead" in table and "relay:host:4243:dead" in table
