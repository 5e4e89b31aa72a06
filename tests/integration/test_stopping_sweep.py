"""The stopping sweep reaches every stopping run, however many cannot move on.

A run being cancelled waits while an effect of it is in flight or ``unknown``
(an operator must say), and its last change stays where it was. The sweep took
the oldest changes first, a page at a time: a full page of such runs was every
pass, and a run behind them whose effect had finished was never ended.
"""

from __future__ import annotations

import asyncio
import uuid

from outbox import Outbox, RunStatus
from outbox.runs.stopping import StoppingSweep
from outbox.shards import shard_of
from outbox.storage.async_store import AsyncStore, Completion
from outbox.storage.engine import make_async_engine
from tests.integration.test_reconcile import lose_attempts


def _finish(dsn: str, effect_id: uuid.UUID) -> None:
    """The late answer of the attempt ``lose_attempts`` started: it succeeded."""

    async def main() -> None:
        store = AsyncStore(make_async_engine(dsn))
        try:
            done = Completion(effect_id, 1, "succeeded", "succeeded", shard=shard_of(effect_id))
            assert await store.complete("dead-deliverer", [done]) == [(effect_id, "succeeded")]
        finally:
            await store.dispose()

    asyncio.run(main())


def test_a_run_behind_a_page_of_runs_that_cannot_move_on_is_still_ended(
    ob: Outbox, dsn: str
) -> None:
    a_run_behind_a_full_page_is_ended(ob, dsn)


def a_run_behind_a_full_page_is_ended(ob: Outbox, dsn: str) -> None:
    """Five runs cancelled while their effects are in flight; the newest one's ends."""
    runs = [ob.start_run("a", "1", {"n": n}) for n in range(5)]
    effects = [
        uuid.UUID(run.transaction("s", lambda tx: str(tx.intend("k.slow", {}).id))) for run in runs
    ]
    lose_attempts(dsn, ["k.slow"])  # every effect in flight, its deliverer silent
    for run in runs:  # oldest change first: in this order
        assert ob.cancel(run.id, "stop") == RunStatus.CANCELLING
    _finish(dsn, effects[-1])  # the newest run may end now; the four before it may not

    sweep = StoppingSweep(max_rows=2)
    for _ in range(3):  # two full pages, then the rest
        with ob.store.run_tx() as tx:
            sweep(tx)
    assert ob.run(runs[-1].id).status == RunStatus.CANCELLED
    assert {ob.run(r.id).status for r in runs[:-1]} == {RunStatus.CANCELLING}

    # a page that was not full started the round again: the next pass is the first page
    with ob.store.run_tx() as tx:
        assert sweep(tx) == {"cancelling": 2}
