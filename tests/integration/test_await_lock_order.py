"""A wait on an effect and that effect's completion never deadlock.

A wait's check locks the run, then marks the effect awaited (its row's lock).
A completion locks the effect, then wakes the run that awaits it (the run
row's lock): the opposite order. A check that held the run while it waited
for a completing effect's row was a deadlock, and PostgreSQL broke it after a
second by failing one side (CI saw a wait fail with "deadlock detected").
The check now never waits for an effect's row while it holds the run: it lets
go of the run, waits for that row alone, and looks again.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest

from outbox import AsyncOutbox, Outbox
from outbox.storage.async_store import AsyncStore
from outbox.storage.attempts import Completion
from outbox.storage.engine import make_async_engine
from outbox.storage.run_tx import RunTx
from outbox.storage.sql.queue import EFFECT_QUEUE
from tests.support import lock_waiters, wait_for

KIND = "k.ordered"


def _await_async(dsn: str, run_id: uuid.UUID, effect_id: uuid.UUID) -> Any:
    async def main() -> Any:
        async with await AsyncOutbox.connect(dsn) as aob:
            run = await aob.run(run_id)
            return await run.await_effect(effect_id, timeout=30)

    return asyncio.run(main())


@pytest.mark.parametrize("client", ["sync", "async"])
def test_a_wait_that_holds_its_run_while_the_effect_completes_does_not_deadlock(
    ob: Outbox, dsn: str, client: str
) -> None:
    run = ob.start_run("orders", "1")
    effect_id = uuid.UUID(run.transaction("charge", lambda tx: str(tx.intend(KIND, {}).id)))
    with ob.store.run_tx() as tx:  # an earlier check of this wait marked it awaited
        assert isinstance(tx, RunTx)
        assert tx.await_effect(run.id, effect_id) is not None
    store = AsyncStore(make_async_engine(dsn))
    loop = asyncio.new_event_loop()
    claimed = loop.run_until_complete(
        store.claim_many(EFFECT_QUEUE, [({"kind": KIND}, 1)], owner="w", lease_seconds=60)
    )
    assert [c.id for c in claimed] == [effect_id]
    outcomes: dict[str, Any] = {}

    def wait() -> None:
        try:
            if client == "sync":
                outcomes["wait"] = run.await_effect(effect_id, timeout=30)
            else:
                outcomes["wait"] = _await_async(dsn, run.id, effect_id)
        except Exception as error:
            outcomes["wait"] = error

    def complete() -> None:
        done = Completion(effect_id, claimed[0].attempt, "succeeded", "succeeded", '{"ok": 1}')
        try:
            outcomes["completion"] = loop.run_until_complete(store.complete("w", [done]))
        except Exception as error:
            outcomes["completion"] = error

    # The run's lock is held here first, so that the wait's check queues for it before
    # the completion does, and takes it first when it is let go: the check then holds
    # the run while the completion holds the effect and waits for the run.
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT 1 FROM outbox_runs WHERE id = %s FOR UPDATE", [run.id])
        waiter = threading.Thread(target=wait)
        waiter.start()
        wait_for(lambda: len(lock_waiters(dsn)) == 1, timeout=10)
        completer = threading.Thread(target=complete)
        completer.start()
        wait_for(lambda: len(lock_waiters(dsn)) == 2, timeout=10)
        began = time.monotonic()
    waiter.join(30)
    completer.join(30)
    elapsed = time.monotonic() - began
    loop.run_until_complete(store.dispose())
    loop.close()
    assert outcomes == {"wait": {"ok": 1}, "completion": [(effect_id, "succeeded")]}
    # PostgreSQL breaks a deadlock after deadlock_timeout (1 s): none was waited out
    assert elapsed < 1.0, elapsed
