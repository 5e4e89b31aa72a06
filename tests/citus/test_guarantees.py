"""The guarantees on a Citus cluster: the same client, the same promises, rows spread over nodes.

One distributed schema per module (``outbox migrate --distribute`` on a real
coordinator and two workers). Each test drives the public client (and the SQL
API where that is what a user calls) and then looks at where the rows landed:
a run's step, effects, ledger and keys on the node that holds its shard.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import uuid
from decimal import Decimal
from functools import partial
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from sqlalchemy import Column, Integer, MetaData, String, Table, create_engine, text

from deliverers.testing import RecordingDeliverer
from outbox import (
    AsyncOutbox,
    BudgetExceeded,
    EffectFailed,
    EffectStatus,
    IdempotencyConflict,
    Outbox,
    Run,
    RunPaused,
    RunStatus,
    StepTransaction,
)
from outbox.cli import cli as cli_main
from outbox.errors import ForkRefused
from outbox.governance.gates import Gate
from outbox.runs import waits
from outbox.serve.app import OutboxServer
from outbox.serve.settings import Credentials, ServeSettings
from outbox.shards import SHARDS, key_shard, on_shard, shard_of
from outbox.storage.async_store import AsyncStore, Completion, DutyAsk
from outbox.storage.direct import prepared
from outbox.storage.dsn import psycopg_url
from outbox.storage.engine import make_async_engine
from outbox.storage.sql import queue
from outbox.storage.sql.queue import EFFECT_QUEUE
from tests.citus_support import CitusDatabase, node_port_of
from tests.integration.test_console import (
    OPERATOR,
    _close_clients,  # noqa: F401 (an autouse fixture: closes the signed-in clients)
    every_page_renders,
    resolve_goes_to_the_attempt_log,
    search_finds_a_run_by_an_effects_key,
)
from tests.integration.test_reconcile import lose_attempts, run_reconcile
from tests.support import DaemonThread, WorkerThread, delivery_plan_modes, wait_for


def _node_of(dsn: str, run_id: uuid.UUID) -> int:
    with psycopg.connect(dsn) as conn:
        return node_port_of(conn, "outbox_runs", shard_of(run_id))


def _count(dsn: str, sql: str, *params: Any) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(sql, params).fetchone()
    assert row is not None
    return int(row[0])


def test_every_run_scoped_table_is_distributed_by_shard_and_co_located(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT table_name::text, citus_table_type, distribution_column, colocation_id"
            " FROM citus_tables ORDER BY 1"
        ).fetchall()
        settings = conn.execute(
            "SELECT result FROM run_command_on_all_nodes("
            "$$SELECT current_setting('outbox.distributed', true)$$)"
        ).fetchall()
    tables = {name: (kind, column, group) for name, kind, column, group in rows}
    distributed = {n for n, (kind, _, _) in tables.items() if kind == "distributed"}
    assert distributed >= {"outbox_runs", "outbox_steps", "outbox_effects", "outbox_effect_keys"}
    assert {tables[n][1] for n in distributed} == {"shard"}
    assert len({tables[n][2] for n in distributed}) == 1, "one co-location group"
    assert tables["outbox_gates"][0] == "reference"
    assert {r[0] for r in settings} == {"on"}, "every node knows the tables are distributed"


def test_a_step_its_row_and_its_intents_commit_together_or_not_at_all(ob: Outbox) -> None:
    """G1 across nodes: the caller's row on the coordinator, the step and intent on a worker."""
    metadata = MetaData()
    invoices = Table(
        "citus_invoices", metadata, Column("id", Integer, primary_key=True), Column("who", String)
    )
    metadata.create_all(ob.engine)
    run = ob.start_run("billing", "1", {"month": "2026-11"})

    def charge(tx: Any) -> str:
        tx.connection.execute(invoices.insert().values(id=1, who="acme"))
        return str(tx.intend("payment.charge", {"amount": 5000}).id)

    effect_id = run.transaction("charge", charge)

    def broken(tx: Any) -> None:
        tx.connection.execute(invoices.insert().values(id=2, who="globex"))
        tx.intend("payment.charge", {"amount": 1})
        raise RuntimeError("the agent failed after writing")

    with pytest.raises(RuntimeError):
        run.transaction("broken", broken)
    with ob.engine.connect() as conn:
        assert conn.execute(text("SELECT id FROM citus_invoices")).scalars().all() == [1]
    effects = ob.effects(run_id=run.id)
    assert [str(e.id) for e in effects] == [effect_id]
    assert ob.run(run.id).completed_steps == ["charge"]


@pytest.mark.parametrize("intents", [1, 32, 33, 80])
def test_a_step_of_any_size_writes_every_intent_in_order(ob: Outbox, intents: int) -> None:
    """A worker writes a small step's effects an insert each and a large one's in one
    statement (commit_step.sql, at 32): either way each intent once, in step order."""
    run = ob.start_run("sizes", "1", {"intents": intents})

    def many(tx: StepTransaction) -> list[str]:
        return [str(tx.intend("k.sizes", {"n": n}, key=f"{run.id}-{n}").id) for n in range(intents)]

    ids = run.transaction("many", many)
    assert run.transaction("many", many) == ids, "replayed"
    effects = ob.effects(run_id=run.id)
    assert [str(e.id) for e in effects] == ids
    assert [e.payload for e in effects] == [{"n": n} for n in range(intents)]


def test_the_step_write_is_one_call_on_the_node_holding_the_run(ob: Outbox, dsn: str) -> None:
    run = ob.start_run("billing", "1")
    run.transaction("s", lambda tx: [tx.intend("k.x", {"n": n}) for n in range(3)] and None)
    port = _node_of(dsn, run.id)
    worker = next(w for w in ob_workers(dsn) if w.endswith(f":{port}"))
    # the rows are on that worker's shard tables, none anywhere else
    with psycopg.connect(f"postgresql://postgres@{worker}/{dsn.rsplit('/', 1)[1]}") as conn:
        conn.execute("SET citus.override_table_visibility = off")
        shard_rows = conn.execute(
            "SELECT count(*) FROM outbox_effects WHERE run_id = %s", [run.id]
        ).fetchone()
    assert shard_rows is not None and shard_rows[0] == 3
    with psycopg.connect(dsn) as conn:
        delegated = conn.execute(
            "SELECT force_delegation, distribution_argument_index FROM pg_dist_object"
            " WHERE objid = 'outbox_write_step'::regproc"
        ).fetchone()
    assert delegated == (True, 0)


def ob_workers(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT nodename, nodeport FROM pg_dist_node WHERE groupid > 0 ORDER BY nodeport"
        ).fetchall()
    return [f"{h}:{p}" for h, p in rows]


def test_a_callers_key_is_unique_in_its_namespace_across_shards(ob: Outbox, dsn: str) -> None:
    """G5 for keys: two runs on two nodes cannot both take one key; the same intent is one."""
    first, second = ob.start_run("a", "1"), ob.start_run("a", "1")
    while _node_of(dsn, second.id) == _node_of(dsn, first.id):
        second = ob.start_run("a", "1")
    key = f"refund-{uuid.uuid4().hex[:8]}"
    effect = first.transaction("pay", lambda tx: str(tx.intend("k.pay", {"n": 1}, key=key).id))
    again = first.transaction("pay-again", lambda tx: str(tx.intend("k.pay", {"n": 1}, key=key).id))
    assert again == effect, "the same key, kind and payload name the same effect"
    with pytest.raises(IdempotencyConflict, match="another owner"):
        second.transaction("pay", lambda tx: tx.intend("k.pay", {"n": 1}, key=key))
    assert ob.effects(run_id=second.id) == []
    # the key is registered on its own shard (and mirrored on the run's when that differs)
    assert (
        _count(dsn, "SELECT count(*) FROM outbox_effect_keys WHERE key = %s AND NOT mirror", key)
        == 1
    )
    assert _count(
        dsn,
        "SELECT shard FROM outbox_effect_keys WHERE key = %s AND NOT mirror",
        key,
    ) == key_shard("default", key)


def test_a_business_key_starts_one_run_whoever_starts_it(ob: Outbox, dsn: str) -> None:
    key = f"order-{uuid.uuid4().hex[:8]}"
    runs = [ob.start_run("shop", "1", {"order": 7}, key=key) for _ in range(3)]
    assert len({r.id for r in runs}) == 1
    # a run given no id is started on its key's shard: the start touched one shard
    assert shard_of(runs[0].id) == key_shard("default", key)
    # an id of the caller's own, on any shard, is the same start when retried
    own = uuid.uuid4()
    key2 = f"order-{uuid.uuid4().hex[:8]}"
    started = ob.start_run("shop", "1", {"order": 8}, key=key2, run_id=own)
    assert started.id == own and ob.start_run("shop", "1", {"order": 8}, key=key2).id == own
    with pytest.raises(IdempotencyConflict):
        ob.start_run("shop", "1", {"order": 9}, key=key2)


def test_the_two_call_sql_step_is_refused_where_its_notes_cannot_follow_it(dsn: str) -> None:
    """OB008's guard lives in the transaction's settings, which a delegated write never sees."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT outbox_start_run('sql', '1')").fetchone()
        assert row is not None
        run_id = row[0]
        conn.commit()
        with pytest.raises(psycopg.Error) as info:
            conn.execute(
                "SELECT outbox_intend('k.x', '{}'::jsonb, run_id => %s, step_id => 's')", [run_id]
            )
        assert info.value.sqlstate == "OB001" and "outbox_commit_step" in str(info.value)
        conn.rollback()
        # the one call writes the step and its intents together, delegated
        conn.execute(
            "SELECT * FROM outbox_commit_step(%s, 's', intents => %s::jsonb)",
            [run_id, json.dumps([{"kind": "k.x", "payload": {"n": 1}}])],
        )
        conn.commit()
    assert _count(dsn, "SELECT count(*) FROM outbox_effects WHERE run_id = %s", run_id) == 1


def test_a_replayed_run_returns_what_it_recorded(ob: Outbox) -> None:
    """G5: a second handle on the run replays the recorded steps, calling nothing again."""
    run = ob.start_run("replay", "1")
    calls: list[int] = []

    def fetch() -> int:
        calls.append(1)
        return 41

    def fetch_again() -> int:
        calls.append(2)
        return 0

    assert run.call("fetch", fetch) == 41
    assert run.transaction("s", lambda tx: tx.intend("k.x", {"n": 1}).idempotency_key)
    again = ob.run(run.id)
    assert again.call("fetch", fetch_again) == 41
    key = again.transaction("s", lambda tx: tx.intend("k.x", {"n": 1}).idempotency_key)
    assert calls == [1] and len(ob.effects(run_id=run.id)) == 1
    assert key == ob.effects(run_id=run.id)[0].idempotency_key


def _wake_ups(listener: psycopg.Connection[Any], seconds: float) -> list[str]:
    return [n.payload for n in listener.notifies(timeout=seconds) if n.channel == "outbox_effects"]


def test_a_steps_wake_up_rides_with_its_call_and_not_with_a_refusal(dsn: str) -> None:
    """On Citus the deliverers' NOTIFY is sent from the coordinator in the step call's own
    round trip and transaction (sync and async clients): it names the run's shard, and a
    refused step sends none."""
    kind = "citus.wake"
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute("LISTEN outbox_effects")
        with Outbox.connect(dsn) as ob:
            run = ob.start_run("wake", "1")
            run.transaction("s", lambda tx: tx.intend(kind, {"n": 1}))
            assert _wake_ups(listener, 2.0) == [str(shard_of(run.id))]
            ob.pause(run.id, "held")
            with pytest.raises(RunPaused):
                run.transaction("t", lambda tx: tx.intend(kind, {"n": 2}))
            assert _wake_ups(listener, 1.0) == []

        async def async_step() -> uuid.UUID:
            async with await AsyncOutbox.connect(dsn) as aob:
                arun = await aob.start_run("wake", "1")
                await arun.transaction("s", lambda tx: tx.intend(kind, {"n": 3}))
                return arun.id

        async_run = asyncio.run(async_step())
        assert _wake_ups(listener, 2.0) == [str(shard_of(async_run))]
    with psycopg.connect(dsn) as conn:
        held = conn.execute(
            "SELECT count(*) FROM outbox_effects WHERE run_id = %s", [run.id]
        ).fetchone()
    assert held == (1,), "the refused step wrote nothing"


def test_an_outbox_on_a_callers_own_engine_takes_steps_from_a_connections_first(
    dsn: str,
) -> None:
    """An engine the caller made does not know the tables are distributed when a
    connection opens: the client asks before the step, not in the middle of it."""
    engine = create_engine(psycopg_url(dsn), pool_size=1, max_overflow=0)
    ob = Outbox(engine)
    try:
        run = ob.start_run("own-engine", "1")
        engine.dispose()  # the step gets a connection that has asked nothing yet
        effect = run.transaction("s", lambda tx: str(tx.intend("k.own", {"n": 1}).id))
        keyed = run.transaction("t", lambda tx: str(tx.intend("k.own", {}, key=f"{run.id}-t").id))
        assert [str(e.id) for e in ob.effects(run_id=run.id)] == [effect, keyed]
    finally:
        ob.close()


def test_the_rarer_parts_of_a_step_write_run_on_its_worker(ob: Outbox, dsn: str) -> None:
    """Debits, reserved costs with their ledger rows, a value stored by reference and an
    over-budget refusal: the branches of the step write a small step never takes."""
    run = ob.start_run("rare", "1", budget=10)
    big = "x" * 40_000  # over the blob threshold: stored by reference

    def think(tx: StepTransaction) -> str:
        tx.spend(3, "model")
        tx.intend("k.cost", {"n": 1}, cost=2)
        return big

    assert run.transaction("think", think) == big
    assert ob.run(run.id).transaction("think", think) == big, "replayed from its reference"
    with pytest.raises(BudgetExceeded):
        run.transaction("more", lambda tx: tx.intend("k.cost", {"n": 2}, cost=20))
    record = ob.run(run.id).record
    assert (record.spent, record.reserved) == (Decimal(3), Decimal(2))
    ledger = "SELECT entry, amount FROM outbox_budget_ledger WHERE run_id = %s ORDER BY entry"
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(ledger, [run.id]).fetchall()
    assert rows == [("reserve", 2), ("spend", 3)]


def test_a_step_without_intents_reads_no_gates(ob: Outbox, dsn: str) -> None:
    """Gates are read, and effects inserted, only for a step that has intents: on a worker
    each is a statement Citus deparses and plans. Shown by a lock: with the gates'
    placement on the run's worker locked, a step without intents commits, and a step
    with one waits until the lock is let go."""
    run = ob.start_run("gates", "1")
    port = _node_of(dsn, run.id)
    worker = next(w for w in ob_workers(dsn) if w.endswith(f":{port}"))
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT shard_name('outbox_gates'::regclass, shardid) FROM pg_dist_shard"
            " WHERE logicalrelid = 'outbox_gates'::regclass"
        ).fetchone()
    assert row is not None
    ended: dict[str, BaseException | None] = {}

    def step(name: str, intends: bool) -> threading.Thread:
        def take() -> None:
            try:
                run.transaction(name, lambda tx: tx.intend("k.g", {}) if intends else None)
                ended[name] = None
            except BaseException as exc:  # reported by the asserts below
                ended[name] = exc

        thread = threading.Thread(target=take, daemon=True)
        thread.start()
        return thread

    with psycopg.connect(f"postgresql://postgres@{worker}/{dsn.rsplit('/', 1)[1]}") as locker:
        locker.execute("SET citus.enable_manual_changes_to_shards = on")  # a LOCK is one
        locker.execute(f"LOCK TABLE {row[0]} IN ACCESS EXCLUSIVE MODE")
        step("bare", intends=False).join(30)
        assert ended == {"bare": None}, "a step without intents waited for the gates"
        gated = step("gated", intends=True)
        gated.join(1.0)
        assert gated.is_alive(), "a step with an intent reads the gates"
        locker.rollback()
    gated.join(30)
    assert ended == {"bare": None, "gated": None}
    assert ob.run(run.id).completed_steps == ["bare", "gated"]


def test_a_paused_run_takes_no_step_until_resumed(ob: Outbox) -> None:
    run = ob.start_run("pause", "1")
    run.transaction("one", lambda tx: None)
    ob.pause(run.id, "checking the ledger")
    with pytest.raises(RunPaused):
        run.transaction("two", lambda tx: None)
    ob.resume(run.id)
    run.transaction("two", lambda tx: None)
    assert ob.run(run.id).completed_steps == ["one", "two"]


def test_a_signal_reaches_a_waiting_run_on_its_node(ob: Outbox) -> None:
    run = ob.start_run("signal", "1")
    got: list[Any] = []
    waiter = threading.Thread(
        target=lambda: got.append(ob.run(run.id).wait_signal("approve", name="approved")),
        daemon=True,
    )
    waiter.start()
    time.sleep(0.5)
    receipt = ob.signal(run.id, "approved", {"by": "ops"})
    waiter.join(30)
    assert got == [{"by": "ops"}] and receipt.duplicate is False


def intend_five(tx: Any, n: int) -> None:
    for i in range(5):
        tx.intend("k.deliver", {"r": n, "i": i})


def test_every_effect_is_delivered_once_by_two_deliverers(ob: Outbox, dsn: str) -> None:
    """G2/G3/G4: claims take turns over the shards; every effect once, every outcome fenced."""
    runs = [ob.start_run("fan", "1") for _ in range(6)]
    for n, run in enumerate(runs):
        run.transaction("s", partial(intend_five, n=n))
    ids = {e.id for r in runs for e in ob.effects(run_id=r.id)}
    assert len({shard_of(r.id) for r in runs}) > 1
    one, two = RecordingDeliverer("k.deliver"), RecordingDeliverer("k.deliver")
    with (
        DaemonThread(dsn, {"k.deliver": one}, batch_size=4, poll_seconds=0.1),
        DaemonThread(dsn, {"k.deliver": two}, batch_size=4, poll_seconds=0.1),
    ):
        wait_for(lambda: all(ob.effect(i).status.value == "succeeded" for i in ids), timeout=60)
    delivered = [d.effect_id for d in [*one.deliveries, *two.deliveries]]
    assert sorted(map(str, delivered)) == sorted(map(str, ids)), "each effect once"
    assert _count(
        dsn, "SELECT count(*) FROM outbox_effect_attempts WHERE effect_id = ANY(%s)", list(ids)
    ) == len(ids)


def test_a_late_completion_after_a_takeover_changes_nothing(ob: Outbox, dsn: str) -> None:
    """G4: the lease ran out, the reconciler put the effect back; the old answer is stale."""
    run = ob.start_run("fence", "1")
    effect_id = uuid.UUID(run.transaction("s", lambda tx: str(tx.intend("k.fence", {"n": 1}).id)))
    shard = shard_of(run.id)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE outbox_effects SET status = 'in_flight', attempt = 1, lease_owner = 'old',"
            " lease_expires_at = now() - interval '1 minute' WHERE id = %s AND shard = %s",
            [effect_id, shard],
        )
    deliverer = RecordingDeliverer("k.fence")
    with DaemonThread(dsn, {"k.fence": deliverer}, poll_seconds=0.1, lease_seconds=5) as daemon:
        wait_for(lambda: ob.effect(effect_id).status.value == "succeeded", timeout=60)
        assert daemon.daemon is not None
    # the old owner answers now, for attempt 1: logged as stale, nothing else changes
    store_effect = ob.effect(effect_id)
    assert store_effect.attempt == 2

    async def late() -> list[tuple[uuid.UUID, str]]:
        store = AsyncStore(make_async_engine(dsn))
        try:
            return await store.complete(
                "old", [Completion(effect_id, 1, "failed", "failed", error="too late", shard=shard)]
            )
        finally:
            await store.dispose()

    assert asyncio.run(late()) == [(effect_id, "stale")]
    assert ob.effect(effect_id).status.value == "succeeded"
    assert len(deliverer.deliveries) == 1


def test_shards_spread_over_both_workers(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        nodes = conn.execute(
            "SELECT count(DISTINCT nodeport) FROM citus_shards"
            " WHERE table_name = 'outbox_runs'::regclass"
        ).fetchone()
        shards = conn.execute(
            "SELECT count(*) FROM citus_shards WHERE table_name = 'outbox_runs'::regclass"
        ).fetchone()
    assert nodes == (2,) and shards == (SHARDS,)


def test_workers_drive_runs_on_every_shard_through_a_timer(ob: Outbox, dsn: str) -> None:
    """Durable runs on both workers: claimed a shard at a time, parked on a timer, woken, done."""
    steps: list[str] = []

    def handler(run: Run) -> str:
        run.transaction("before", lambda tx: None)
        run.sleep("nap", 0.3)
        steps.append(str(run.id))
        return "done"

    # run ids are random: six land on one worker once in 32, so start more until both have some
    runs = [ob.start_run("napper", "1") for _ in range(6)]
    while len({_node_of(dsn, r.id) for r in runs}) < 2 and len(runs) < 40:
        runs.append(ob.start_run("napper", "1"))
    assert len({_node_of(dsn, r.id) for r in runs}) == 2, "runs on both workers"
    with WorkerThread(ob, "napper", "1", handler):
        wait_for(
            lambda: all(ob.run(r.id).status == RunStatus.COMPLETED for r in runs),
            timeout=60,
            message="every run completed",
        )
    assert sorted(steps) == sorted(str(r.id) for r in runs), "each run finished once"
    assert all(ob.run(r.id).completed_steps == ["before", "nap"] for r in runs)


def test_a_run_parked_on_an_effect_of_another_shard_goes_on_when_it_ends(
    ob: Outbox, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An outcome's statement stays on its shard: a run of another shard parked on the
    effect is woken right after it commits, not by its recheck timer (put out of reach)."""
    monkeypatch.setattr(waits, "EFFECT_RECHECK_SECONDS", 3600.0)
    kind = "citus.awaited"
    payer = ob.start_run("payer", "1")
    effects = payer.transaction(
        "pay", lambda tx: [str(tx.intend(kind, {"n": n}).id) for n in range(3)]
    )
    # one effect each: an effect names the last run parked on it (on one server too)
    waiters = [ob.start_run("waiter", "1", {"effect": effect}) for effect in effects]
    waiters = [w for w in waiters if shard_of(w.id) != shard_of(payer.id)]
    assert waiters, "three runs on the payer's shard: once in 32,768"

    def handler(run: Run) -> Any:
        return run.await_effect(uuid.UUID(run.inputs["effect"]))

    def statuses() -> set[RunStatus]:
        return {ob.run(w.id).status for w in waiters}

    with WorkerThread(ob, "waiter", "1", handler):
        wait_for(lambda: statuses() == {RunStatus.WAITING}, timeout=30, message="parked")
        with DaemonThread(dsn, {kind: RecordingDeliverer(kind)}, poll_seconds=0.1):
            wait_for(
                lambda: statuses() == {RunStatus.COMPLETED},
                timeout=20,
                message="woken by the outcome, on another shard",
            )
    assert all("recorded" in ob.run(w.id).record.result for w in waiters)


def test_a_run_parked_on_its_own_effect_goes_on_when_it_ends(
    ob: Outbox, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The outcome's statement wakes a run of its own shard, not its recheck timer (put out
    of reach); the deliverer sends the NOTIFY from the coordinator as it does so."""
    monkeypatch.setattr(waits, "EFFECT_RECHECK_SECONDS", 3600.0)
    kind = "citus.own"

    def handler(run: Run) -> Any:
        effect = run.transaction("pay", lambda tx: str(tx.intend(kind, {}).id))
        return run.await_effect(uuid.UUID(effect))

    runs = [ob.start_run("self-waiter", "1") for _ in range(2)]

    def statuses() -> set[RunStatus]:
        return {ob.run(r.id).status for r in runs}

    with WorkerThread(ob, "self-waiter", "1", handler):
        wait_for(lambda: statuses() == {RunStatus.WAITING}, timeout=30, message="parked")
        with DaemonThread(dsn, {kind: RecordingDeliverer(kind)}, poll_seconds=0.1):
            wait_for(
                lambda: statuses() == {RunStatus.COMPLETED},
                timeout=20,
                message="woken by the outcome, on its own shard",
            )


def test_an_operators_resolve_and_an_approvers_rejection_wake_runs_of_other_shards(
    ob: Outbox, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A person's decision ends the effect on its shard; a run of another shard parked
    on it is woken right after, in a transaction of its own, not by its recheck timer."""
    monkeypatch.setattr(waits, "EFFECT_RECHECK_SECONDS", 3600.0)
    gate = Gate(
        name="citus-all", kind="citus.held", when=[{"pointer": "/n", "op": "ge", "value": 0}]
    )
    ob.apply_gates([gate])
    payer = ob.start_run("payer", "1")
    unknown = payer.transaction(
        "ask", lambda tx: [str(tx.intend("citus.asked", {"n": n}).id) for n in range(3)]
    )
    held = payer.transaction(
        "hold", lambda tx: [str(tx.intend("citus.held", {"n": n}).id) for n in range(3)]
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE outbox_effects SET status = 'unknown', attempt = 1"
            " WHERE id = ANY(%s::uuid[]) AND shard = %s",
            [unknown, shard_of(payer.id)],
        )
    assert {ob.effect(e).status for e in held} == {EffectStatus.AWAITING_APPROVAL}
    waiters = {ob.start_run("waiter", "1", {"effect": e}).id: e for e in unknown + held}
    elsewhere = [w for w in waiters if shard_of(w) != shard_of(payer.id)]
    assert elsewhere, "six runs on the payer's shard: once in 10^9"

    def handler(run: Run) -> Any:
        try:
            return run.await_effect(uuid.UUID(run.inputs["effect"]))
        except EffectFailed as exc:
            return exc.status

    def statuses() -> set[RunStatus]:
        return {ob.run(w).status for w in elsewhere}

    with WorkerThread(ob, "waiter", "1", handler):
        wait_for(lambda: statuses() == {RunStatus.WAITING}, timeout=30, message="parked")
        for effect in unknown:
            ob.resolve_effect(effect, outcome="failed", note="never reached", operator="ops")
        for effect in held:
            ob.reject_effect(effect, note="not this month", by="cfo")
        wait_for(lambda: statuses() == {RunStatus.COMPLETED}, timeout=20, message="woken")
    ended = {"failed" if waiters[w] in unknown else "rejected" for w in elsewhere}
    assert {ob.run(w).record.result for w in elsewhere} == ended
    ob.remove_gates([gate.name])


def _intend_amount(tx: StepTransaction, amount: int) -> str:
    return str(tx.intend("citus.pay", {"amount": amount}).id)


def test_a_gate_holds_and_approvals_and_deadlines_act_on_the_held_effect(ob: Outbox) -> None:
    """Approval decisions and the deadline sweep name the effect's shard (a router
    statement each): Citus refuses a lock of a row by id alone."""
    ob.apply_gates(
        [
            Gate(
                name="citus-large",
                kind="citus.pay",
                when=[{"pointer": "/amount", "op": "gt", "value": 100}],
            )
        ]
    )
    held = []
    for amount in (500, 600, 700):
        run = ob.start_run("citus-payer", "1")
        pay = partial(_intend_amount, amount=amount)
        held.append(ob.effect(run.transaction("pay", pay)))
    assert {e.status for e in held} == {EffectStatus.AWAITING_APPROVAL}
    approved = ob.approve_effect(held[0].id, digest=held[0].digest, note="ok", by="cfo")
    assert approved.status == EffectStatus.PENDING
    ob.reject_effect(held[1].id, note="no", by="cfo")
    assert ob.effect(held[1].id).status == EffectStatus.REJECTED
    with ob.engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE outbox_effects SET approval_deadline = now() - interval '1 second'"
                " WHERE id = :id"
            ),
            {"id": held[2].id},
        )
    assert ob.expire_approvals() == {"rejected": 1}
    assert ob.effect(held[2].id).status == EffectStatus.REJECTED
    ob.apply_gates([], prune=True)


def test_a_batch_carries_its_heartbeat_but_not_the_duty_probe_on_a_cluster(
    ob: Outbox, dsn: str
) -> None:
    """A busy daemon's batch transaction (outcomes, claim, lease heartbeat) commits on a
    cluster, the heartbeat a statement per shard. The duty probe, a read of every
    shard (about 50 ms), does not ride there: the duties round sends it on its own
    connection (a drain of 2,560 effects: 1,058-1,221 /s with it riding, 1,309-1,566
    without)."""
    kind = "k.ride"
    for i in range(6):
        ob.start_run("ride", "1").transaction("s", partial(_intend_one, kind=kind, n=i))

    async def batches() -> tuple[set[uuid.UUID], set[uuid.UUID], Any]:
        store = AsyncStore(make_async_engine(dsn))
        try:
            held = await store.claim_many(
                EFFECT_QUEUE, [({"kind": kind}, 6)], owner="rider", lease_seconds=30
            )
            first, rest = held[0], held[1:]
            done = [
                Completion(first.id, first.attempt, "succeeded", "succeeded", shard=first.shard)
            ]
            batched = await store.complete_and_claim(
                "rider",
                done,
                EFFECT_QUEUE,
                [({"kind": kind}, 1)],
                lease_seconds=30,
                extend=[(e.id, e.attempt) for e in rest],
                probe=DutyAsk(gone_kinds=(kind,)),
            )
            return {e.id for e in rest}, batched.kept, batched.findings
        finally:
            await store.dispose()

    rest, kept, findings = asyncio.run(batches())
    assert len(rest) == 5 and kept == rest
    assert findings is None, "the probe asked for was left to the duties round"


def _intend_one(tx: StepTransaction, kind: str, n: int) -> None:
    tx.intend(kind, {"n": n})


def test_every_session_plans_each_statement_with_its_shard(
    dsn: str, citus_module_db: CitusDatabase
) -> None:
    """A long session's prepared claims and step writes keep working past five runs.

    PostgreSQL may plan a prepared statement (or one inside PL/pgSQL) without
    its values after five runs; Citus cannot route such a plan, and under
    PostgreSQL's ``auto`` it never picks one for them. ``migrate --distribute``
    leaves ``auto`` (forcing custom plans re-plans every PL/pgSQL expression), and
    resets the ``force_custom_plan`` an earlier release set.
    """
    for node in (citus_module_db.coordinator, *citus_module_db.workers):
        with psycopg.connect(node) as conn:
            assert conn.execute("SHOW plan_cache_mode").fetchone() == ("auto",)
    # A deliverer's connections plan generically on one server; here none does,
    # not even those opened before the first of them learnt it is on a cluster.
    assert delivery_plan_modes(dsn) == ["auto"] * 4
    # the claim statement, prepared on one session and run well past five times on
    # each of four shards, is planned with its shard every time: no failure
    sharded = dataclasses.replace(EFFECT_QUEUE, sharded=True)
    claim = prepared(queue.claim(sharded))
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=0) as conn:
        for _ in range(12):
            for shard in range(4):
                params = queue.claim_params(
                    {"kind": "k.none"}, limit=5, owner="o", lease_seconds=30, shard=shard
                )
                rows = conn.execute(claim.sql, claim.params(params), prepare=True).fetchall()
                assert rows == [(None,) * (len(rows[0]) - 1) + (False,)]
    # forced to plan without its values, the same claim fails: Citus cannot route it
    forced = f"{dsn}?options=-c%20plan_cache_mode%3Dforce_generic_plan"
    with (
        psycopg.connect(forced, autocommit=True, prepare_threshold=0) as conn,
        pytest.raises(psycopg.Error, match="could not create distributed plan"),
    ):
        conn.execute(claim.sql, claim.params(params), prepare=True)
    # a step's statements on the worker are fast-path inserts and updates (routed with
    # a generic plan too) or read no distributed table: even so forced, steps go on
    generic = Outbox.connect(forced)
    try:
        run = generic.start_run("plans", "generic")
        for n in range(7):
            run.transaction(f"s{n}", lambda tx: tx.intend("k.generic", {"n": 1}) and None)
    finally:
        generic.close()
    with psycopg.connect(dsn) as conn:
        written = conn.execute(
            "SELECT count(*) FROM outbox_effects WHERE run_id = %s AND shard = %s",
            [run.id, shard_of(run.id)],
        ).fetchone()
    assert written == (7,)
    ob = Outbox.connect(dsn)
    deliverer = RecordingDeliverer("k.plans")
    try:
        run = ob.start_run("plans", "custom")
        with DaemonThread(dsn, {"k.plans": deliverer}, poll_seconds=0.05):
            for n in range(12):
                run.transaction(f"s{n}", lambda tx: tx.intend("k.plans", {"n": 1}) and None)
                time.sleep(0.05)
            wait_for(lambda: len(deliverer.deliveries) == 12, timeout=60, message="12 deliveries")
    finally:
        ob.close()


def test_distributing_again_resets_forced_custom_plans(
    dsn: str, citus_module_db: CitusDatabase
) -> None:
    """A database an earlier release distributed (forced custom plans) gets ``auto`` back."""
    database = dsn.rsplit("/", 1)[1].split("?")[0]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT run_command_on_all_nodes(%s)",
            [f'ALTER DATABASE "{database}" SET plan_cache_mode = force_custom_plan'],
        )
    result = CliRunner().invoke(cli_main, ["migrate", "--distribute"], env={"OUTBOX_DSN": dsn})
    assert result.exit_code == 0, result.output
    for node in (citus_module_db.coordinator, *citus_module_db.workers):
        with psycopg.connect(node) as conn:
            assert conn.execute("SHOW plan_cache_mode").fetchone() == ("auto",)


def test_reconcile_lists_the_work_of_a_gone_deliverer_on_a_cluster(ob: Outbox, dsn: str) -> None:
    """The owners live on the coordinator, the effects on the workers: two reads, no join."""
    owner = "host:4242:gone-citus"
    runs = [ob.start_run("gone", "1") for _ in range(4)]
    for run in runs:
        run.transaction("s", lambda tx: tx.intend("k.gone", {"n": 1}) and None)
    assert len({shard_of(r.id) for r in runs}) > 1

    async def claim_and_vanish() -> int:
        store = AsyncStore(make_async_engine(dsn))
        try:
            claimed = await store.claim_many(
                EFFECT_QUEUE, [({"kind": "k.gone"}, 10)], owner=owner, lease_seconds=300
            )
            return len(claimed)
        finally:
            await store.dispose()

    assert asyncio.run(claim_and_vanish()) == 4
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO outbox_owners (owner) VALUES (%s)", [owner])
        started = "SELECT now() - pg_postmaster_start_time() > interval '6 s'"
        wait_for(lambda: conn.execute(started).fetchone() == (True,), timeout=30)
    done = CliRunner().invoke(
        cli_main, ["--dsn", dsn, "reconcile", "--dry-run", "--json"], catch_exceptions=False
    )
    assert done.exit_code == 0, done.output
    held = {g["owner"]: g["in_flight"] for g in json.loads(done.output)["held_by_gone_deliverers"]}
    assert held.get(owner) == 4


def test_the_console_renders_searches_and_resolves_on_a_cluster(ob: Outbox) -> None:
    """The console's tests from one server, on the cluster: its reads may span shards."""
    console = OutboxServer(
        ob,
        ServeSettings(port=0, counts_cache_seconds=0),
        Credentials(operator_token=OPERATOR.encode()),
    ).start()
    try:
        every_page_renders(ob, console, "console-pages")
        search_finds_a_run_by_an_effects_key(ob, console, "console-search")
        resolve_goes_to_the_attempt_log(ob, console, "console-resolve")
    finally:
        console.shutdown()


def test_a_runs_record_verifies_on_a_cluster_and_an_edited_result_is_named(
    ob: Outbox, dsn: str
) -> None:
    """The tamper-evident record on a cluster: the links the completion computed on the
    worker verify, `outbox audit verify` reads the run from its shard, and a result
    edited by hand breaks it (before: the record's read joined the attempt log and the
    effects by id alone, which Citus refuses)."""
    run = ob.start_run("auditor", "1", {"month": "2026-11"})
    run.transaction("s", lambda tx: [tx.intend("k.aud", {"n": i}) for i in range(3)] and None)
    with DaemonThread(dsn, {"k.aud": RecordingDeliverer("k.aud")}, poll_seconds=0.05):
        wait_for(
            lambda: all(e.status == EffectStatus.SUCCEEDED for e in ob.effects(run_id=run.id)),
            message="three deliveries",
        )
    run.complete({"ok": True})
    assert ob.verify_run(run.id) == []
    env = {"OUTBOX_DSN": dsn}
    verified = CliRunner().invoke(cli_main, ["audit", "verify", str(run.id), "--json"], env=env)
    assert verified.exit_code == 0, verified.output
    assert json.loads(verified.stdout)["intact"] is True
    edited = ob.effects(run_id=run.id)[0]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE outbox_effects SET result = '{\"forged\": true}' WHERE id = %s AND shard = %s",
            [edited.id, shard_of(run.id)],
        )
    (broken,) = ob.verify_run(run.id)
    assert str(edited.id) in str(broken) and "its result is not the one" in str(broken)


def test_a_cancel_leaves_a_possibly_done_effect_unknown_and_compensates_it_once_resolved(
    ob: Outbox, dsn: str
) -> None:
    """G3 on a cluster: a lost attempt put back for redelivery may have happened.

    The cancel (one statement on the run's node) makes it ``unknown``, not
    ``cancelled``; resolved as done, it is compensated like any succeeded effect.
    """
    run = ob.start_run("doubt", "1")
    effect_id = uuid.UUID(
        run.transaction(
            "book",
            lambda tx: str(tx.intend("k.doubt", {"n": 1}, compensate=("k.undo", {"n": 1})).id),
        )
    )
    lose_attempts(dsn, ["k.doubt"])
    assert run_reconcile(dsn, {"k.doubt": RecordingDeliverer("k.doubt")}).counts == {"redeliver": 1}
    assert ob.cancel(run.id, "changed my mind", by="test") == RunStatus.CANCELLING
    assert ob.effect(effect_id).status.value == "unknown"
    ob.resolve_effect(effect_id, outcome="succeeded", note="it was booked", operator="ops")
    undo = RecordingDeliverer("k.undo")
    with DaemonThread(dsn, {"k.undo": undo}, poll_seconds=0.1):

        def compensated() -> bool:
            ob.advance_stopping_runs()
            return ob.run(run.id).status == RunStatus.COMPENSATED

        wait_for(compensated, timeout=60, message="the possibly-done booking compensated")
    assert [d.payload for d in undo.deliveries] == [{"n": 1}]
    assert ob.verify_run(run.id) == []


def test_a_fork_replays_its_steps_debits_and_chain_from_another_shard(ob: Outbox, dsn: str) -> None:
    """A fork's copied steps, their debits and its re-chained history are written on
    its shard (the original's, or another for a caller's fork id); an effect of a
    step it would run again that a lost attempt may have done refuses it."""
    original = ob.start_run("forked", "1", {"month": 12}, budget=10.0)
    original.call("fetch", lambda: {"tool": "fetch"})

    def charge(tx: StepTransaction) -> str:
        tx.set_state({"after": "charge"})
        tx.spend(2.5, "model")
        return str(tx.intend("k.fork", {"cents": 100}).id)

    charged = original.transaction("charge", charge)
    original.call("notify", lambda: {"step": "notify"})
    original.complete({"done": True})

    elsewhere = on_shard(uuid.uuid4(), (shard_of(original.id) + 1) % SHARDS)
    forks = [ob.fork(original.id, "notify"), ob.fork(original.id, "notify", fork_id=elsewhere)]
    assert shard_of(forks[0].id) == shard_of(original.id), "a fork's own id: the same shard"
    for fork in forks:
        assert fork.completed_steps == ["fetch", "charge"]
        assert fork.record.spent == 2.5 and fork.state == {"after": "charge"}
        fork.call("notify", lambda: {"step": "notify again"})
        assert ob.verify_run(fork.id) == []
    assert ob.verify_run(original.id) == []

    lose_attempts(dsn, ["k.fork"])
    assert run_reconcile(dsn, {"k.fork": RecordingDeliverer("k.fork")}).counts == {"redeliver": 1}
    with pytest.raises(ForkRefused) as refused:
        ob.fork(original.id, "charge")
    assert [(e["effect_id"], e["status"], e["lost_attempt"]) for e in refused.value.effects] == [
        (charged, "pending", True)
    ]
