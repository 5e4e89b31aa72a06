"""The deliverers' owner registry on a cluster: it stays on the coordinator, the
effects it is checked against are distributed."""

from __future__ import annotations

import asyncio
import uuid

import psycopg

from outbox import Outbox
from outbox.storage.async_store import AsyncStore
from outbox.storage.engine import make_async_engine


def _forget(dsn: str, owner: str) -> int:
    async def main() -> int:
        store = AsyncStore(make_async_engine(dsn))
        try:
            return await store.forget_gone_owners([owner], restart_grace=0)
        finally:
            await store.dispose()

    return asyncio.run(main())


def test_a_gone_owner_is_forgotten_once_it_holds_nothing(ob: Outbox, dsn: str) -> None:
    run = ob.start_run("owners", "1")
    run.transaction("s", lambda tx: tx.intend("k.owned", {"n": 1}) and None)
    gone = f"gone-{uuid.uuid4().hex[:6]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE outbox_effects SET status = 'in_flight', attempt = 1, lease_owner = %s,"
            " lease_expires_at = now() + interval '1 hour', attempt_started_at = now()"
            " WHERE run_id = %s AND shard = outbox_shard_of(%s)",
            [gone, run.id, run.id],
        )
        conn.execute(
            "INSERT INTO outbox_owners (owner, registered_at)"
            " VALUES (%s, now() - interval '5 minutes')",
            [gone],
        )
    assert _forget(dsn, gone) == 0, "forgotten while it holds an attempt"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE outbox_effects SET status = 'pending', lease_owner = NULL,"
            " lease_expires_at = NULL WHERE run_id = %s AND shard = outbox_shard_of(%s)",
            [run.id, run.id],
        )
    assert _forget(dsn, gone) == 1
