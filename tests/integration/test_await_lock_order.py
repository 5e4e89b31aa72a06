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
from collections.abc import Callable
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


def race(
    dsn: str, table: str, row_id: uuid.UUID, first: Callable[[], Any], second: Callable[[], Any]
) -> tuple[Any, Any, float]:
    """``first`` and ``second`` in threads; what each returned (or raised), and how long.

    The row ``row_id`` of ``table`` is held here first, so that ``first`` queues for
    it before ``second`` starts and queues too; both go on when it is let go. The
    time runs from then until both ended: PostgreSQL breaks a deadlock after
    ``deadlock_timeout`` (1 s), so a race under a second waited none out.
    """
    results: list[Any] = [None, None]

    def call(index: int, side: Callable[[], Any]) -> None:
        try:
            results[index] = side()
        except Exception as error:
            results[index] = error

    threads = [
        threading.Thread(target=call, args=(i, side)) for i, side in enumerate((first, second))
    ]
    with psycopg.connect(dsn) as holder:
        holder.execute(f"SELECT 1 FROM {table} WHERE id = %s FOR UPDATE", [row_id])
        threads[0].start()
        wait_for(lambda: len(lock_waiters(dsn)) == 1, timeout=10)
        threads[1].start()
        wait_for(lambda: len(lock_waiters(dsn)) == 2, timeout=10)
        began = time.monotonic()
    for thread in threads:
        thread.join(30)
    return results[0], results[1], time.monotonic() - began


class AwaitedEffect:
    """A run that awaits its one effect, claimed by deliverer ``w``; its completion."""

    def __init__(self, ob: Outbox, dsn: str, key: str, *, lease_seconds: float) -> None:
        self.run = ob.start_run("orders", key)
        self.id = uuid.UUID(self.run.transaction("charge", lambda tx: str(tx.intend(KIND, {}).id)))
        with ob.store.run_tx() as tx:  # an earlier check of this wait marked it awaited
            assert isinstance(tx, RunTx)
            assert tx.await_effect(self.run.id, self.id) is not None
        self.store = AsyncStore(make_async_engine(dsn))
        self.loop = asyncio.new_event_loop()
        claimed = self.loop.run_until_complete(
            self.store.claim_many(
                EFFECT_QUEUE, [({"kind": KIND}, 1)], owner="w", lease_seconds=lease_seconds
            )
        )
        assert [c.id for c in claimed] == [self.id]
        self.attempt = claimed[0].attempt

    def complete(self) -> Any:
        """The claimed attempt's late or timely answer: succeeded."""
        done = Completion(self.id, self.attempt, "succeeded", "succeeded", '{"ok": 1}')
        return self.loop.run_until_complete(self.store.complete("w", [done]))

    def reconcile(self) -> None:
        """Its lease ran out: the reconciler puts it back to pending (an idempotent kind)."""
        deliverers = {KIND: RecordingDeliverer(KIND, idempotent=True)}
        report = self.loop.run_until_complete(reconcile(self.store, deliverers, worker="r"))
        assert report.counts == {"redeliver": 1}

    def close(self) -> None:
        self.loop.run_until_complete(self.store.dispose())
        self.loop.close()


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
    effect = AwaitedEffect(ob, dsn, "1", lease_seconds=60)
    run = effect.run

    def wait() -> Any:
        if client == "sync":
            return run.await_effect(effect.id, timeout=30)
        return _await_async(dsn, run.id, effect.id)

    # The wait's check queues for the run first and takes it first when it is let
    # go: the check then holds the run while the completion holds the effect and
    # waits for the run.
    try:
        waited, completion, elapsed = race(dsn, "outbox_runs", run.id, wait, effect.complete)
    finally:
        effect.close()
    assert (waited, completion) == ({"ok": 1}, [(effect.id, "succeeded")])
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
    effect = AwaitedEffect(ob, dsn, "2", lease_seconds=0.001)
    run = effect.run
    effect.reconcile()
    assert ob.effect(effect.id).status == EffectStatus.PENDING

    def operator() -> RunStatus:
        if action == "cancel":
            return ob.cancel(run.id, "the customer left", by="ops")
        return ob.pause(run.id, "the bank is down")

    # The operator first was the deadlock: it took the run and waited for the effect
    # that the completion held.
    try:
        if first == "operator":
            stopped, completion, elapsed = race(
                dsn, "outbox_runs", run.id, operator, effect.complete
            )
        else:
            completion, stopped, elapsed = race(
                dsn, "outbox_runs", run.id, effect.complete, operator
            )
    finally:
        effect.close()
    expected = RunStatus.CANCELLED if action == "cancel" else RunStatus.PAUSED
    assert elapsed < 1.0, elapsed
    log = [(a.outcome, (a.detail or {}).get("reported")) for a in ob.store.attempts(effect.id)]
    if first == "operator" and action == "cancel":
        # The lost call may have happened: the cancel left the effect unknown, not
        # cancelled, and the late answer of that same attempt is the truth about it
        # (it may land before the cancel's own sweep, which then has nothing to wait for).
        assert stopped in (RunStatus.CANCELLING, RunStatus.CANCELLED), (stopped, completion)
        assert completion == [(effect.id, "succeeded")], completion
        assert [outcome for outcome, _ in log][-2:] == ["unknown", "succeeded"], log
        ob.advance_stopping_runs()  # nothing to undo: it declared no compensation
    elif first == "operator":
        # the late answer came after the pause: kept as stale, with what it said
        assert stopped == expected, (stopped, completion)
        assert completion == [(effect.id, "stale")], completion
        assert ob.effect(effect.id).status == EffectStatus.PAUSED
        assert log[-1] == ("stale", "succeeded"), log
    else:
        assert stopped == expected, (stopped, completion)
        assert completion == [(effect.id, "succeeded")], completion
        assert ob.effect(effect.id).status == EffectStatus.SUCCEEDED
        assert "cancelled" not in [outcome for outcome, _ in log], log
    assert ob.run(run.id).status == expected


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
    # Ids are time-ordered to the millisecond (UUIDv7): the held effect is intended
    # a few milliseconds later, so it has the higher id.
    low = uuid.UUID(run.transaction("ship", lambda tx: str(tx.intend(KIND, {"n": 0}).id)))
    time.sleep(0.01)
    held = uuid.UUID(
        run.transaction("pay", lambda tx: str(tx.intend(KIND, {"n": 1}, approval=policy).id))
    )
    assert low < held
    assert ob.effect(held).status == EffectStatus.AWAITING_APPROVAL
    digest = ob.effect(held).digest
    time.sleep(0.4)  # the deadline passes
    approved, paused, elapsed = race(
        dsn,
        "outbox_effects",
        held,
        lambda: ob.approve_effect(held, digest=digest, note="late", by="cfo"),
        lambda: ob.pause(run.id, "checking"),
    )
    assert isinstance(approved, ApprovalRefused), (approved, paused)
    assert isinstance(paused, RunTerminal), (approved, paused)  # cancelled before it
    assert elapsed < 1.0, elapsed
    assert ob.run(run.id).status == RunStatus.CANCELLED
    assert {ob.effect(low).status, ob.effect(held).status} == {EffectStatus.CANCELLED}


def test_a_stopping_sweep_and_a_late_completion_of_an_awaited_effect_do_not_deadlock(
    ob: Outbox, dsn: str
) -> None:
    # The sweep moves a cancelling run on: it stops an effect that is pending again
    # (an attempt in flight at the cancel was lost and given back), under the run's
    # lock, while that attempt's late answer holds the effect and wakes the run.
    effect = AwaitedEffect(ob, dsn, "3", lease_seconds=0.001)
    run = effect.run
    assert ob.cancel(run.id, "the customer left", by="ops") == RunStatus.CANCELLING
    effect.reconcile()
    try:
        moved, completion, elapsed = race(
            dsn, "outbox_runs", run.id, ob.advance_stopping_runs, effect.complete
        )
    finally:
        effect.close()
    # the lost call may have happened: the sweep leaves it unknown, and the late
    # answer of that attempt settles it
    assert moved == {"cancelling": 1}, (moved, completion)
    assert completion == [(effect.id, "succeeded")], completion
    assert elapsed < 1.0, elapsed
    assert ob.effect(effect.id).status == EffectStatus.SUCCEEDED
    assert ob.advance_stopping_runs() == {"cancelled": 1}, "it declared nothing to undo"


def test_a_resume_and_a_cancel_of_a_paused_run_do_not_deadlock(ob: Outbox, dsn: str) -> None:
    # Both change the run's unstarted effects under its lock: a resume releases the
    # paused ones, a cancel cancels them. Taken in the same order (effects, then the
    # run), the one that queued first for the run goes first and the other follows.
    run = ob.start_run("orders", "4")
    effect_id = uuid.UUID(run.transaction("charge", lambda tx: str(tx.intend(KIND, {}).id)))
    assert ob.pause(run.id, "checking") == RunStatus.PAUSED
    assert ob.effect(effect_id).status == EffectStatus.PAUSED
    resumed, cancelled, elapsed = race(
        dsn,
        "outbox_runs",
        run.id,
        lambda: ob.resume(run.id),
        lambda: ob.cancel(run.id, "not needed", by="ops"),
    )
    assert resumed == RunStatus.RUNNABLE, (resumed, cancelled)
    assert cancelled == RunStatus.CANCELLED, (resumed, cancelled)
    assert elapsed < 1.0, elapsed
    assert ob.effect(effect_id).status == EffectStatus.CANCELLED
