"""The deliverers' owner registry on a cluster: it stays on the coordinator, the
effects it is checked against are distributed."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest

from deliverers.testing import RecordingDeliverer
from outbox import Outbox, Run, StepTransaction
from outbox.delivery.daemon import DeliveryDaemon
from outbox.delivery.settings import DeliverySettings
from outbox.shards import shard_of
from outbox.storage.async_store import AsyncStore
from outbox.storage.engine import make_async_engine
from outbox.storage.shard_turns import ShardTurns
from outbox.storage.sql.owners import OWNER_LOCK_CLASS


def _held_by_a_gone_owner(
    ob: Outbox, dsn: str, agent: str, runs: int, step: Callable[[StepTransaction], None]
) -> tuple[str, list[Run]]:
    """``runs`` runs of ``step``'s intents, each in flight under a deliverer that is
    gone: registered five minutes ago, its lock free, an hour of lease left."""
    gone = f"gone-{uuid.uuid4().hex[:6]}"
    started = [ob.start_run(agent, "1") for _ in range(runs)]
    for run in started:
        run.transaction("s", step)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for run in started:
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
    return gone, started


def _one(kind: str) -> Callable[[StepTransaction], None]:
    def step(tx: StepTransaction) -> None:
        tx.intend(kind, {"n": 1})

    return step


def _forget(dsn: str, owner: str) -> int:
    async def main() -> int:
        store = AsyncStore(make_async_engine(dsn))
        try:
            return await store.forget_gone_owners([owner], restart_grace=0)
        finally:
            await store.dispose()

    return asyncio.run(main())


def test_a_gone_owner_is_forgotten_once_it_holds_nothing(ob: Outbox, dsn: str) -> None:
    gone, (run,) = _held_by_a_gone_owner(ob, dsn, "owners", 1, _one("k.owned"))
    assert _forget(dsn, gone) == 0, "forgotten while it holds an attempt"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE outbox_effects SET status = 'pending', lease_owner = NULL,"
            " lease_expires_at = NULL WHERE run_id = %s AND shard = outbox_shard_of(%s)",
            [run.id, run.id],
        )
    assert _forget(dsn, gone) == 1


def test_a_gone_deliverers_idempotent_attempts_are_put_back_long_before_their_lease(
    ob: Outbox, dsn: str
) -> None:
    """Early recovery on a cluster: the registry (and the owners' locks) on the
    coordinator, the attempts on the workers' shards. A deliverer registered whose
    lock is free holds attempts on several shards with an hour's lease left; a live
    daemon puts the idempotent ones back, logged, and delivers each once, in
    seconds. The blind kind waits for its lease."""

    def both(tx: StepTransaction) -> None:
        tx.intend("k.again", {"n": 1})
        tx.intend("k.blind", {"n": 2})

    gone, runs = _held_by_a_gone_owner(ob, dsn, "owners-gone", 6, both)
    assert len({shard_of(run.id) for run in runs}) > 1
    again = RecordingDeliverer("k.again", idempotent=True)
    blind = RecordingDeliverer("k.blind", idempotent=False)
    settings = DeliverySettings(poll_seconds=0.1, restart_grace_seconds=0)

    async def main() -> float:
        store = AsyncStore(make_async_engine(dsn))
        daemon = DeliveryDaemon(store, {"k.again": again, "k.blind": blind}, settings)
        task = asyncio.create_task(daemon.run())
        started = time.monotonic()
        try:
            while len(again.deliveries) < len(runs):
                assert time.monotonic() - started < 30, f"{len(again.deliveries)} put back"
                await asyncio.sleep(0.1)
            took = time.monotonic() - started
            await asyncio.sleep(1.0)  # nothing more comes
            return took
        finally:
            daemon.stop()
            await task
            await store.dispose()

    took = asyncio.run(main())
    assert sorted(d.idempotency_key for d in again.deliveries) == sorted(
        set(d.idempotency_key for d in again.deliveries)
    ), "each once"
    assert blind.deliveries == [], "a call that may have landed is never sent blindly again"
    with psycopg.connect(dsn) as conn:
        conn.execute("SET citus.multi_task_query_log_level = 'off'")
        logged = conn.execute(
            "SELECT a.outcome, a.detail->>'note' FROM outbox_effect_attempts a"
            " JOIN outbox_effects e ON e.id = a.effect_id AND e.shard = a.shard"
            " WHERE e.kind = 'k.again' AND e.run_id = ANY(%s) AND a.attempt = 1",
            [[run.id for run in runs]],
        ).fetchall()
        held = conn.execute(
            "SELECT count(*) FROM outbox_effects WHERE kind = 'k.blind' AND lease_owner = %s"
            " AND status = 'in_flight'",
            [gone],
        ).fetchone()
    assert len(logged) == len(runs)
    assert all(outcome == "expired" and gone in note for outcome, note in logged), logged
    assert held == (len(runs),)
    print(f"gone deliverer's attempts back and delivered in {took:.2f} s (lease 1 h)")


def test_an_owner_back_during_the_put_back_keeps_the_attempts_left(
    ob: Outbox, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The put-back goes a shard at a time; the lock is asked again in each shard's
    transaction, so a deliverer whose lock session came back after the first keeps
    its attempts on the others (put back, they would be called twice)."""
    gone, runs = _held_by_a_gone_owner(ob, dsn, "owners-back", 8, _one("k.back"))
    shards = {shard_of(run.id) for run in runs}
    assert len(shards) > 1
    back = psycopg.connect(dsn, autocommit=True)
    asked: list[int] = []
    real = ShardTurns.answering

    @contextlib.contextmanager
    def answering(self: ShardTurns, shard: int | None, conn: object) -> Iterator[None]:
        with real(self, shard, conn):
            yield
        asked.append(shard or 0)
        if len(asked) == 1:  # its lock session is back after the first shard's turn
            taken = back.execute(
                "SELECT pg_try_advisory_lock(%s, hashtext(%s))", [OWNER_LOCK_CLASS, gone]
            )
            assert taken.fetchone() == (True,)

    monkeypatch.setattr(ShardTurns, "answering", answering)

    async def main() -> list[uuid.UUID]:
        store = AsyncStore(make_async_engine(dsn))
        try:
            return await store.expire_gone_owner(
                gone, {"k.back": 5}, note="gone", worker="t", restart_grace=0
            )
        finally:
            await store.dispose()

    try:
        put_back = asyncio.run(main())
    finally:
        back.close()
    first = asked[0]
    assert len(asked) == 2, "the second shard's turn found the owner back and stopped"
    assert len(put_back) == sum(1 for run in runs if shard_of(run.id) == first)
    with psycopg.connect(dsn) as conn:
        conn.execute("SET citus.multi_task_query_log_level = 'off'")
        kept = conn.execute(
            "SELECT count(*) FROM outbox_effects WHERE kind = 'k.back' AND status = 'in_flight'"
            " AND lease_owner = %s",
            [gone],
        ).fetchone()
    assert kept == (len(runs) - len(put_back),)
