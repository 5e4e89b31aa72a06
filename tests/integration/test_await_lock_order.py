"""A wait, a cancel or a pause never deadlocks with the completion of an effect the run awaits.

A wait's check locks the run, then marks the effect awaited (its row's lock).
A completion locks the effect, then wakes the run that awaits it (the run
row's lock): the opposite order. A check that held the run while it waited
for a completing effect's row was a deadlock, and PostgreSQL broke it after a
second by failing one side (CI saw a wait fail with "deadlock detected").
The check now never waits for an effect's row while it holds the run: it lets
go of the run, waits for that row alone, and looks again.

A cancel and a pause change the run's effects that have not started while
they hold the run: they lock those effects first, then the run, as a
completion does.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest

from deliverers.testing import RecordingDeliverer
from outbox import (
    ApprovalRefused,
    AsyncOutbox,
    EffectStatus,
    Outbox,
    RunStatus,
    RunTerminal,
)
from outbox.delivery.reconcile import reconcile
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


@pytest.mark.parametrize("first", ["operator", "completion"])
@pytest.mark.parametrize("action", ["cancel", "pause"])
def test_a_cancel_or_pause_and_a_late_completion_of_an_awaited_effect_do_not_deadlock(
    ob: Outbox, dsn: str, action: str, first: str
) -> None:
    # The same two rows: a cancel (or a pause) locks the run, then cancels (holds) its
    # effects that have not started; a completion of an effect the run awaits holds the
    # effect, then wakes the run. The effect here is pending again (its deliverer died
    # and the reconciler put it back), so the old attempt's late answer is still the
    # truth about it, and the operator's action would change it. Whichever of the two
    # gets the effect's row first wins; neither waits for the other while holding a row
    # the other needs.
    run = ob.start_run("orders", "2")
    effect_id = uuid.UUID(run.transaction("charge", lambda tx: str(tx.intend(KIND, {}).id)))
    with ob.store.run_tx() as tx:
        assert isinstance(tx, RunTx)
        assert tx.await_effect(run.id, effect_id) is not None
    store = AsyncStore(make_async_engine(dsn))
    loop = asyncio.new_event_loop()
    claimed = loop.run_until_complete(
        store.claim_many(EFFECT_QUEUE, [({"kind": KIND}, 1)], owner="w", lease_seconds=0.001)
    )
    assert [c.id for c in claimed] == [effect_id]
    redelivered = loop.run_until_complete(
        reconcile(store, {KIND: RecordingDeliverer(KIND, idempotent=True)}, worker="r")
    )
    assert redelivered.counts == {"redeliver": 1}
    assert ob.effect(effect_id).status == EffectStatus.PENDING
    outcomes: dict[str, Any] = {}

    def operator() -> None:
        try:
            if action == "cancel":
                outcomes["operator"] = ob.cancel(run.id, "the customer left", by="ops")
            else:
                outcomes["operator"] = ob.pause(run.id, "the bank is down")
        except Exception as error:
            outcomes["operator"] = error

    def complete() -> None:
        done = Completion(effect_id, claimed[0].attempt, "succeeded", "succeeded", '{"ok": 1}')
        try:
            outcomes["completion"] = loop.run_until_complete(store.complete("w", [done]))
        except Exception as error:
            outcomes["completion"] = error

    # With the run's lock held here, the first side queues for the run; the second
    # then queues too, and both go on when it is let go. The operator first was the
    # deadlock: it took the run and waited for the effect that the completion held.
    order = [operator, complete] if first == "operator" else [complete, operator]
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT 1 FROM outbox_runs WHERE id = %s FOR UPDATE", [run.id])
        threads = [threading.Thread(target=side) for side in order]
        threads[0].start()
        wait_for(lambda: len(lock_waiters(dsn)) == 1, timeout=10)
        threads[1].start()
        wait_for(lambda: len(lock_waiters(dsn)) == 2, timeout=10)
        began = time.monotonic()
    for thread in threads:
        thread.join(30)
    elapsed = time.monotonic() - began
    loop.run_until_complete(store.dispose())
    loop.close()
    stopped = RunStatus.CANCELLED if action == "cancel" else RunStatus.PAUSED
    assert outcomes["operator"] == stopped, outcomes
    assert elapsed < 1.0, elapsed  # no deadlock was waited out
    log = [(a.outcome, (a.detail or {}).get("reported")) for a in ob.store.attempts(effect_id)]
    if first == "operator":
        # the late answer came after the operator: kept as stale, with what it said
        assert outcomes["completion"] == [(effect_id, "stale")], outcomes
        held = EffectStatus.CANCELLED if action == "cancel" else EffectStatus.PAUSED
        assert ob.effect(effect_id).status == held
        assert log[-1] == ("stale", "succeeded"), log
    else:
        assert outcomes["completion"] == [(effect_id, "succeeded")], outcomes
        assert ob.effect(effect_id).status == EffectStatus.SUCCEEDED
        assert "cancelled" not in [outcome for outcome, _ in log], log
    assert ob.run(run.id).status == stopped


def test_an_approval_past_its_deadline_and_a_pause_of_its_run_do_not_deadlock(
    ob: Outbox, dsn: str
) -> None:
    # An approval that comes after the deadline applies on_timeout first, here
    # cancel_run, which locks the run's unstarted effects and then the run. A pause
    # locks the same effects, in id order. The approval held its effect (the higher
    # id) while the pause held the lower one and waited for it: a deadlock. The
    # approval now takes the run's unstarted effects first, in the same order.
    run = ob.start_run("payer", "1")
    policy = {"timeout": 0.2, "on_timeout": "cancel_run"}
    low, held = (
        uuid.UUID(i)
        for i in run.transaction(
            "pay",
            lambda tx: [
                str(tx.intend(KIND, {"n": 0}).id),
                str(tx.intend(KIND, {"n": 1}, approval=policy).id),
            ],
        )
    )
    assert low < held
    assert ob.effect(held).status == EffectStatus.AWAITING_APPROVAL
    digest = ob.effect(held).digest
    time.sleep(0.4)  # the deadline passes
    outcomes: dict[str, Any] = {}

    def approve() -> None:
        try:
            outcomes["approve"] = ob.approve_effect(held, digest=digest, note="late", by="cfo")
        except Exception as error:
            outcomes["approve"] = error

    def pause() -> None:
        try:
            outcomes["pause"] = ob.pause(run.id, "checking")
        except Exception as error:
            outcomes["pause"] = error

    with psycopg.connect(dsn) as holder:  # the approval queues first, then the pause
        holder.execute("SELECT 1 FROM outbox_effects WHERE id = %s FOR UPDATE", [held])
        approver = threading.Thread(target=approve)
        approver.start()
        wait_for(lambda: len(lock_waiters(dsn)) == 1, timeout=10)
        pauser = threading.Thread(target=pause)
        pauser.start()
        wait_for(lambda: len(lock_waiters(dsn)) == 2, timeout=10)
        began = time.monotonic()
    approver.join(30)
    pauser.join(30)
    elapsed = time.monotonic() - began
    assert isinstance(outcomes["approve"], ApprovalRefused), outcomes
    assert isinstance(outcomes["pause"], RunTerminal), outcomes  # cancelled before it
    assert elapsed < 1.0, elapsed  # no deadlock was waited out
    assert ob.run(run.id).status == RunStatus.CANCELLED
    assert {ob.effect(low).status, ob.effect(held).status} == {EffectStatus.CANCELLED}
