"""Every statement of the hot paths runs on one shard: Citus is told to refuse any other.

``citus.multi_task_query_log_level = error`` makes the coordinator raise on any
statement it would send to more than one shard, and
``citus.max_intermediate_result_size = 0`` on any it would split into sub-plans
run one by one (each on one shard, their rows collected on the coordinator and
sent back: round trips, and a transaction that may take two phases). With both set for the whole
database (so every session of the client, the deliverers and the workers has
it), the paths that carry the load (start a run, write steps with intents and
keys, claim, extend leases, complete, expire, wake timers, claim runs, pause,
resume, signal, replay, a run's effects listed) must run without a single
refusal. Other reads for people (listing runs, effects of every run, the
console, audit) may span shards and are not run here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner

from deliverers.testing import RecordingDeliverer, TansuBroker
from outbox import IdempotencyConflict, Outbox, Run, RunStatus, StepTransaction
from outbox.cli import cli as cli_main
from outbox.delivery.settings import DeliverySettings
from outbox.ids import RELAY_OWNER_PREFIX
from outbox.shards import shard_of
from outbox.storage.async_store import AsyncStore
from outbox.storage.engine import make_async_engine, make_engine
from outbox.storage.owner_lock import OwnerLock
from outbox.storage.sql.dispatch import DISPATCH_QUEUE
from outbox.storage.sql.queue import EFFECT_QUEUE
from outbox.storage.store import Store
from tests.citus_support import CitusDatabase, node_port_of
from tests.integration.test_retention import archive_holds_every_deleted_row, build_history
from tests.integration.test_stream_daemon import stream_daemon
from tests.support import DaemonThread, WorkerThread, wait_for

KIND = "k.one"
STREAMED = "k.streamed"


def distributed_and_guarded(database: CitusDatabase) -> str:
    """``database`` migrated and distributed, every session refusing a multi-shard statement."""
    result = CliRunner().invoke(
        cli_main, ["migrate", "--distribute", "--json"], env={"OUTBOX_DSN": database.dsn}
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["distributed"]
    with psycopg.connect(database.dsn, autocommit=True) as conn:
        name = conn.execute("SELECT current_database()").fetchone()
        assert name is not None
        conn.execute(f"ALTER DATABASE {name[0]} SET citus.multi_task_query_log_level = 'error'")
        # a statement Citus splits into sub-plans (a CTE, a sub-select it cannot send
        # along) runs each on its own and collects their rows on the coordinator
        conn.execute(f"ALTER DATABASE {name[0]} SET citus.max_intermediate_result_size = 0")
    return database.dsn


@pytest.fixture(scope="module")
def dsn(citus_module_db: CitusDatabase) -> str:
    return distributed_and_guarded(citus_module_db)


def test_the_guard_refuses_a_statement_on_many_shards(dsn: str) -> None:
    refused = pytest.raises(psycopg.Error, match=r"multi-task|multi-shard")
    with psycopg.connect(dsn) as conn, refused:
        conn.execute("UPDATE outbox_effects SET updated_at = now() WHERE kind = 'nothing'")


def _pay(tx: StepTransaction, key: str) -> str:
    tx.intend(KIND, {"n": 1})
    return str(tx.intend(KIND, {"n": 2}, key=key).id)


def _three(tx: StepTransaction, n: int) -> None:
    for j in range(3):
        tx.intend(STREAMED, {"n": n, "j": j})


#: What Citus says when it refuses a statement: spanning shards, locking rows of
#: several, a STABLE function over a column in an UPDATE, a distributed table
#: joined with a local one.
CITUS_REFUSALS = (
    "multi-task",
    "distributed query",
    "column references",
    "not supported",
    "intermediate result size",
)


def _refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What the daemon's, the relay's or the worker's rounds logged as refused by Citus
    (they log and go on), in the message or in the exception logged with it.

    The metrics gauges' counts (the stats round) read every shard at once on
    purpose: one parallel read of all shards every few seconds, not a hot path.
    """
    found = []
    for r in caplog.records:
        text = r.getMessage()
        if r.exc_info:
            text += logging.Formatter().formatException(r.exc_info)
        if any(s in text for s in CITUS_REFUSALS) and not text.startswith("stats round failed"):
            found.append(text)
    return found


def test_steps_and_their_delivery_stay_on_one_shard_each(
    ob: Outbox, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    runs = [ob.start_run("single", "1", {"i": i}) for i in range(4)]
    keyed = ob.start_run("single", "1", key=f"order-{uuid.uuid4().hex[:8]}")
    for run in [*runs, keyed]:
        key = f"pay-{uuid.uuid4().hex[:8]}"
        run.transaction("pay", partial(_pay, key=key))
        assert run.transaction("pay", partial(_pay, key=key)), "replayed"
    deliverer = RecordingDeliverer(KIND)
    with DaemonThread(dsn, {KIND: deliverer}, batch_size=3, poll_seconds=0.1, lease_seconds=2):
        wait_for(lambda: len(deliverer.deliveries) >= 10, timeout=60, message="all delivered")
    with psycopg.connect(dsn) as conn:
        for run in [*runs, keyed]:
            row = conn.execute(
                "SELECT count(*) FILTER (WHERE status = 'succeeded'), count(*)"
                " FROM outbox_effects WHERE run_id = %s AND shard = %s",
                [run.id, shard_of(run.id)],
            ).fetchone()
            assert row == (2, 2)
    assert _refusals(caplog) == []


def _two_phase_commits(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) FROM pg_dist_transaction").fetchone()
    assert row is not None
    return int(row[0])


def test_a_drain_over_both_workers_commits_each_transaction_in_one_phase(
    ob: Outbox, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A deliverer's batches hold effects of shards on both workers: each outcome, claim
    and heartbeat commits on its own node, and so does each shard's part of a reconcile
    round, so no transaction of the drain or of the idle rounds after it takes two
    phases (Citus records each one that does in ``pg_dist_transaction``)."""
    kind = "k.one-phase"
    runs = [ob.start_run("one-phase", "1", {"i": i}) for i in range(12)]
    ids = {
        run.id: run.transaction(
            "s", lambda tx: [str(tx.intend(kind, {"n": n}).id) for n in range(4)]
        )
        for run in runs
    }
    with psycopg.connect(dsn, autocommit=True) as conn:
        # the coordinator's recovery would remove the records this counts
        conn.execute("ALTER SYSTEM SET citus.recover_2pc_interval = -1")
        conn.execute("SELECT pg_reload_conf()")
        try:
            time.sleep(0.5)
            before = _two_phase_commits(conn)
            deliverer = RecordingDeliverer(kind)
            settings = DeliverySettings(batch_size=16, poll_seconds=0.1, lease_seconds=2)
            with DaemonThread(dsn, {kind: deliverer}, settings=settings):
                wait_for(
                    lambda: (
                        [_status_of(dsn, run, e) for run in runs for e in ids[run.id]]
                        == ["succeeded"] * 48
                    ),
                    timeout=60,
                    message="every outcome written",
                )
                time.sleep(2)  # idle rounds: the reconcile round asks every shard
            assert _two_phase_commits(conn) == before
        finally:
            conn.execute("ALTER SYSTEM RESET citus.recover_2pc_interval")
            conn.execute("SELECT pg_reload_conf()")
    with psycopg.connect(dsn) as conn:
        nodes = {node_port_of(conn, "outbox_runs", shard_of(run.id)) for run in runs}
    assert len(nodes) == 2, "the runs lie on both workers"
    assert _refusals(caplog) == []


def test_intents_of_no_run_with_callers_keys_are_kept_once_on_their_own_shards(
    ob: Outbox, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A run-less intent's key is taken before it is written, as a step's are."""
    kind, key = "k.plain", f"plain-{uuid.uuid4().hex[:8]}"
    with ob.transaction() as tx:
        first = tx.intend(kind, {"n": 1}, key=key)
    with ob.transaction() as tx:
        assert tx.intend(kind, {"n": 1}, key=key).id == first.id
    with pytest.raises(IdempotencyConflict), ob.transaction() as tx:
        tx.intend(kind, {"n": 2}, key=key)
    deliverer = RecordingDeliverer(kind)
    with DaemonThread(dsn, {kind: deliverer}, poll_seconds=0.1):
        wait_for(lambda: key in deliverer.keys, timeout=60, message="the intent delivered")
    assert deliverer.keys == [key]
    assert _refusals(caplog) == []


@pytest.mark.kafka
@pytest.mark.slow
def test_stream_mode_relays_and_claims_on_one_shard_each(
    ob: Outbox, dsn: str, kafka_broker: TansuBroker, caplog: pytest.LogCaptureFixture
) -> None:
    """The relay's claim into dispatched, and the stream deliverer's claim by the records' ids,
    each name one shard: the records carry their run's id, so the shard is known."""
    runs = [ob.start_run("streamed", "1", {"i": i}) for i in range(6)]
    for i, run in enumerate(runs):
        run.transaction("s", partial(_three, n=i))
    with ob.transaction() as tx:  # of no run: on its key's shard
        tx.intend(STREAMED, {"n": 100}, key=f"runless-{uuid.uuid4().hex[:8]}")
    deliverer = RecordingDeliverer(STREAMED)
    with stream_daemon(dsn, kafka_broker, {STREAMED: deliverer}):
        wait_for(lambda: len(deliverer.deliveries) >= 19, timeout=120, message="all delivered")
        wait_for(
            lambda: all({e.status for e in ob.effects(run_id=r.id)} == {"succeeded"} for r in runs),
            timeout=60,
            message="every outcome recorded",
        )
    assert len(set(deliverer.keys)) == len(deliverer.keys) == 19
    assert _refusals(caplog) == []


def test_workers_pause_resume_signal_and_timers_stay_on_one_shard_each(
    ob: Outbox, caplog: pytest.LogCaptureFixture
) -> None:
    def handler(run: Run) -> str:
        run.transaction("first", lambda tx: None)
        run.sleep("nap", 0.2)
        got = run.wait_signal("go", name="go", timeout=60)
        return str(got)

    runs = [ob.start_run("steady", "1") for _ in range(3)]
    held = runs[0]
    assert ob.pause(held.id, "hold") == RunStatus.PAUSED
    with WorkerThread(ob, "steady", "1", handler):
        for run in runs[1:]:

            def waiting(run: Run = run) -> bool:
                return ob.run(run.id).status == RunStatus.WAITING

            wait_for(waiting, timeout=60)
            ob.signal(run.id, "go", {"ok": True})
        assert ob.resume(held.id) == RunStatus.RUNNABLE
        wait_for(lambda: ob.run(held.id).status == RunStatus.WAITING, timeout=60)
        ob.signal(held.id, "go", {"ok": True})
        for run in runs:

            def completed(run: Run = run) -> bool:
                return ob.run(run.id).status == RunStatus.COMPLETED

            wait_for(completed, timeout=60)
    assert _refusals(caplog) == []


def test_cancel_and_compensation_stay_on_one_shard_each(
    ob: Outbox, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The stopping sweep (every deliverer's and worker's duty) reads a shard at a time."""
    runs = [ob.start_run("stopping", "1", {"i": i}) for i in range(4)]
    for run in runs:
        run.transaction(
            "book",
            lambda tx: tx.intend(KIND, {"n": 1}, compensate=(KIND, {"undo": 1})) and None,
        )
    deliverer = RecordingDeliverer(KIND)
    with DaemonThread(dsn, {KIND: deliverer}, batch_size=4, poll_seconds=0.1, lease_seconds=2):

        def succeeded() -> bool:
            with psycopg.connect(dsn) as conn:
                return all(
                    conn.execute(
                        "SELECT bool_and(status = 'succeeded') FROM outbox_effects"
                        " WHERE run_id = %s AND shard = %s",
                        [run.id, shard_of(run.id)],
                    ).fetchone()
                    == (True,)
                    for run in runs
                )

        wait_for(succeeded, timeout=60, message="booked")
        for run in runs:
            assert ob.cancel(run.id, "changed my mind", by="test") == RunStatus.COMPENSATING
        ob.advance_stopping_runs()  # the sweep, once by hand, beside the daemon's own

        def compensated() -> bool:
            ob.advance_stopping_runs()
            return all(ob.run(r.id).status == RunStatus.COMPENSATED for r in runs)

        wait_for(compensated, timeout=60, message="every run compensated")

    paused = ob.start_run("stopping", "1", {"i": "paused"})
    paused.transaction("book", lambda tx: tx.intend(KIND, {"n": 2}) and None)
    ob.pause(paused.id, "hold on")
    first = {run.id: ob.effects(run_id=run.id)[0].id for run in (*runs, paused)}

    async def holds() -> list[bool]:  # asked before an attempt that waited is called
        store = AsyncStore(make_async_engine(dsn))
        try:
            return [await store.run_holds(run.id, first[run.id]) for run in (*runs, paused)]
        finally:
            await store.engine.dispose()

    assert asyncio.run(holds()) == [False] * 4 + [True], "the compensated runs; the paused one"
    assert sorted(d.payload.get("undo", 0) for d in deliverer.deliveries) == [0] * 4 + [1] * 4
    assert _refusals(caplog) == []
    # A run's effects, as a person lists them, are read from the run's shard alone.
    for run in runs:
        listed = ob.effects(run_id=run.id)
        assert len(listed) == 2 and {e.status for e in listed} == {"compensated", "succeeded"}
        assert [e.id for e in ob.run(run.id).effects()] == [e.id for e in listed]


def shards_sent_a_claim(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The shards each deliverer's claim statement goes to, in order, from now on."""
    sent: list[int] = []
    claim_partition = AsyncStore._claim_partition

    async def one_shard(
        store: AsyncStore, conn: Any, spec: Any, partition: Any, *a: Any, **kw: Any
    ) -> Any:
        sent.append(int(partition["shard"]))
        return await claim_partition(store, conn, spec, partition, *a, **kw)

    monkeypatch.setattr(AsyncStore, "_claim_partition", one_shard)
    return sent


def _status_of(dsn: str, run: Run, effect_id: uuid.UUID | str, column: str = "status") -> str:
    """An effect's status read from its run's shard (the guard refuses a read of every shard)."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            f"SELECT {column} FROM outbox_effects WHERE id = %s AND shard = %s",
            [effect_id, shard_of(run.id)],
        ).fetchone()
    assert row is not None, effect_id
    return str(row[0])


def test_expiry_approval_and_a_cancel_log_their_attempts_on_one_shard_each(
    ob: Outbox, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The statements that change effects and log the attempt (a lease run out, an
    approval, a rejection, a cancel of what never started) each go to one node, the
    log rows with them: no sub-plan, no rows collected on the coordinator."""
    kind = "k.logged"
    lapsed = [ob.start_run("logged", "1", {"i": i}) for i in range(3)]
    ids = [uuid.UUID(r.transaction("s", lambda tx: str(tx.intend(kind, {}).id))) for r in lapsed]
    with psycopg.connect(dsn, autocommit=True) as conn:
        for run, effect_id in zip(lapsed, ids, strict=True):
            conn.execute(
                "UPDATE outbox_effects SET status = 'in_flight', attempt = 1, lease_owner = 'gone',"
                " lease_expires_at = now() - interval '1 minute' WHERE id = %s AND shard = %s",
                [effect_id, shard_of(run.id)],
            )
    held, asked = [], []
    for verdict in ("approve", "reject"):
        asked.append(ob.start_run("logged", "1", {"verdict": verdict}))
        held.append(asked[-1].transaction("s", lambda tx: str(tx.intend(kind, {}, approval={}).id)))
    waiting = ob.start_run("logged", "1", {"cancel": True})
    never = waiting.transaction("s", lambda tx: str(tx.intend("k.nobody", {}).id))
    status = partial(_status_of, dsn)
    assert [status(r, e) for r, e in zip(asked, held, strict=True)] == ["awaiting_approval"] * 2
    digest = status(asked[0], held[0], "payload_hash")  # what Effect.digest is
    # The effect's id names its shard: the approval reads and changes it there alone.
    ob.approve_effect(held[0], digest=digest, note="ok", by="cfo")
    ob.reject_effect(held[1], note="no", by="cfo")
    assert ob.cancel(waiting.id, "not needed", by="test") == RunStatus.CANCELLED
    deliverer = RecordingDeliverer(kind)
    with DaemonThread(dsn, {kind: deliverer}, poll_seconds=0.1, lease_seconds=5):
        wait_for(lambda: len(deliverer.deliveries) == 4, timeout=60, message="redone, approved")
    pairs = [*zip(lapsed, ids, strict=True), *zip(asked, held, strict=True), (waiting, never)]
    assert [status(r, e) for r, e in pairs] == [*["succeeded"] * 4, "rejected", "cancelled"]
    with psycopg.connect(dsn) as conn:
        logged = sorted(
            row[0]
            for run, effect_id in pairs
            for row in conn.execute(
                "SELECT outcome FROM outbox_effect_attempts WHERE effect_id = %s AND shard = %s",
                [effect_id, shard_of(run.id)],
            )
        )
    assert logged == ["approved", "cancelled", *["expired"] * 3, "rejected", *["succeeded"] * 4]
    # every row chained as on one server: each run's record verifies
    assert [ob.verify_run(run.id) for run, _ in pairs] == [[]] * len(pairs)
    assert _refusals(caplog) == []


def test_a_run_awaits_its_own_effect_and_another_runs_a_shard_a_statement(
    ob: Outbox, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An effect's id names its shard: awaiting it (and reading it by id) goes there alone."""
    kind = "k.awaited"
    mine = ob.start_run("awaits", "1")
    theirs = ob.start_run("awaits", "1")
    while shard_of(theirs.id) == shard_of(mine.id):
        theirs = ob.start_run("awaits", "1")
    own = uuid.UUID(mine.transaction("s", lambda tx: str(tx.intend(kind, {"n": 1}).id)))
    other = uuid.UUID(theirs.transaction("s", lambda tx: str(tx.intend(kind, {"n": 2}).id)))
    assert [shard_of(own), shard_of(other)] == [shard_of(mine.id), shard_of(theirs.id)]
    deliverer = RecordingDeliverer(kind)
    with DaemonThread(dsn, {kind: deliverer}, poll_seconds=0.1):
        assert "recorded" in mine.await_effect(own, timeout=60)
        assert "recorded" in mine.await_effect(other, timeout=60)
    assert [ob.effect(e).status.value for e in (own, other)] == ["succeeded"] * 2
    with psycopg.connect(dsn) as conn:  # the SQL API's read, as another language sends it
        status = conn.execute("SELECT status FROM outbox_effect_status(%s)", [other]).fetchone()
    assert status == ("succeeded",)
    assert _refusals(caplog) == []


def test_a_wait_on_an_effect_another_transaction_holds_goes_to_its_shard_alone(
    ob: Outbox, dsn: str
) -> None:
    """A wait's check steps aside from an effect row another transaction holds (a
    completion holds it, then takes the run's lock to wake it): it finds the row on
    the shard its id names, lets go of the run, waits for that row there and checks
    again. None of it reads every shard (CI once saw the check look the row up on
    all of them: a multi-task query)."""
    run = ob.start_run("awaits", "1")
    effect_id = uuid.UUID(run.transaction("s", lambda tx: str(tx.intend("k.held", {}).id)))
    shard = shard_of(effect_id)
    got: dict[str, Any] = {}

    def wait() -> None:
        try:
            got["result"] = run.await_effect(effect_id, timeout=60)
        except Exception as error:
            got["result"] = error

    def waiting_for_a_lock() -> bool:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SET citus.multi_task_query_log_level = 'off'")  # the test's own read
            row = conn.execute(
                "SELECT count(*) FROM citus_stat_activity WHERE wait_event_type = 'Lock'"
            ).fetchone()
        return row is not None and row[0] > 0

    with psycopg.connect(dsn) as holder:
        holder.execute(
            "SELECT 1 FROM outbox_effects WHERE id = %s AND shard = %s FOR UPDATE",
            [effect_id, shard],
        )
        waiter = threading.Thread(target=wait)
        waiter.start()
        wait_for(
            lambda: "result" in got or waiting_for_a_lock(),
            timeout=30,
            message="the wait to wait for the effect's row",
        )
        holder.execute(
            "UPDATE outbox_effects SET status = 'succeeded', result = '{\"done\": 1}',"
            " completed_at = now() WHERE id = %s AND shard = %s",
            [effect_id, shard],
        )
    waiter.join(30)
    assert got == {"result": {"done": 1}}


def test_an_operators_resolve_and_retry_change_one_shard_and_log_there(
    dsn: str, ob: Outbox, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator closes an unknown effect and retries a failed one: each read, the
    change and its log row go to the effect's node alone (its id names its shard)."""
    kind = "k.operator"
    runs = [ob.start_run("operator", "1", {"i": i}) for i in range(2)]
    ids = [r.transaction("s", lambda tx: str(tx.intend(kind, {}).id)) for r in runs]
    with psycopg.connect(dsn, autocommit=True) as conn:
        for run, effect_id, was in zip(runs, ids, ("unknown", "failed"), strict=True):
            conn.execute(
                "UPDATE outbox_effects SET status = %s, attempt = 1, max_attempts = 1,"
                " completed_at = now() WHERE id = %s AND shard = %s",
                [was, effect_id, shard_of(run.id)],
            )
    ob.resolve_effect(ids[0], outcome="succeeded", note="in the ledger", operator="ops")
    assert ob.retry_effect(ids[1], operator="ops", note="sink fixed").max_attempts == 4
    assert [a.outcome for i in ids for a in ob.store.attempts(uuid.UUID(i))] == [
        "resolved",
        "retried",
    ]
    status = partial(_status_of, dsn)
    assert [status(r, e) for r, e in zip(runs, ids, strict=True)] == ["succeeded", "pending"]
    with psycopg.connect(dsn) as conn:
        logged = [
            conn.execute(
                "SELECT outcome, worker, detail->>'note' FROM outbox_effect_attempts"
                " WHERE effect_id = %s AND shard = %s",
                [effect_id, shard_of(run.id)],
            ).fetchall()
            for run, effect_id in zip(runs, ids, strict=True)
        ]
    assert logged == [[("resolved", "ops", "in the ledger")], [("retried", "ops", "sink fixed")]]
    assert _refusals(caplog) == []


def test_an_idle_run_claim_reads_each_shard_and_claims_only_where_a_run_is_ready(
    ob: Outbox, dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run worker's claim that finds nothing costs a cheap read a shard, not a claim a shard."""
    sent: list[int] = []
    claim_runs_on = Store._claim_runs_on

    def one_shard(store: Store, conn: Any, spec: Any, partition: Any, *a: Any) -> Any:
        sent.append(int(partition["shard"]))
        return claim_runs_on(store, conn, spec, partition, *a)

    monkeypatch.setattr(Store, "_claim_runs_on", one_shard)
    store = Store(make_engine(dsn))
    quota = [({"agent": "idle-runs", "agent_version": "1"}, 5)]
    try:
        assert store.claim_runs(quota, owner="w", lease_seconds=30) == []
        assert sent == [], "no shard had a runnable run: no claim statement"
        run = ob.start_run("idle-runs", "1")
        claimed = store.claim_runs(quota, owner="w", lease_seconds=30)
        assert [r.id for r in claimed] == [run.id]
        assert sent == [shard_of(run.id)], "the one shard with a runnable run was claimed from"
    finally:
        store.engine.dispose()


def test_a_steps_wake_up_names_its_shard_and_an_idle_deliverer_asks_that_shard_alone(
    ob: Outbox, dsn: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Without the name, the claim a wake-up starts asks the shards in turn, a statement each."""
    claims: list[tuple[list[int], list[uuid.UUID]]] = []  # per claim: shards asked, rows taken
    asking = shards_sent_a_claim(monkeypatch)
    claim_on = AsyncStore._claim_on

    async def one_claim(store: AsyncStore, *args: Any, **kwargs: Any) -> Any:
        asking.clear()
        rows = await claim_on(store, *args, **kwargs)
        claims.append((list(asking), [r.id for r in rows]))
        return rows

    monkeypatch.setattr(AsyncStore, "_claim_on", one_claim)
    deliverer = RecordingDeliverer("k.named")
    with DaemonThread(dsn, {"k.named": deliverer}, poll_seconds=60):
        run = ob.start_run("named", "1")
        with psycopg.connect(dsn, autocommit=True) as listener:
            listener.execute("LISTEN outbox_effects")
            # An idle deliverer's claims back off (0.01 s doubling); a few seconds in,
            # just after one of them, the next is over a second away: the commit's
            # wake-up, not a backoff claim, starts the claim that finds the intent.
            time.sleep(3)
            seen = len(claims)
            wait_for(lambda: len(claims) > seen, timeout=60, message="an idle claim")
            run.transaction("s", lambda tx: tx.intend("k.named", {"n": 1}) and None)
            payloads = [n.payload for n in listener.notifies(timeout=10, stop_after=1)]
        wait_for(lambda: deliverer.deliveries, timeout=30, message="the delivery")
    assert payloads == [str(shard_of(run.id))]
    effect_id = deliverer.deliveries[0].effect_id
    assert [asked for asked, taken in claims if effect_id in taken] == [[shard_of(run.id)]]
    assert _refusals(caplog) == []


def test_an_idle_claim_reads_each_shard_and_claims_only_where_a_row_is_ready(
    ob: Outbox, dsn: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A claim that finds nothing costs a cheap read a shard, not a claim statement a shard."""
    asked = shards_sent_a_claim(monkeypatch)

    async def claim(store: AsyncStore) -> list[uuid.UUID]:
        quota = [({"kind": "k.idle"}, 10)]
        rows = await store.claim_many(EFFECT_QUEUE, quota, owner="idle", lease_seconds=30)
        return [r.id for r in rows]

    async def claims() -> tuple[list[uuid.UUID], list[int], list[uuid.UUID], list[int]]:
        store = AsyncStore(make_async_engine(dsn))
        try:
            nothing = await claim(store)
            idle_asks = list(asked)
            run = ob.start_run("idle", "1")
            run.transaction("s", lambda tx: tx.intend("k.idle", {"n": 1}) and None)
            asked.clear()
            return nothing, idle_asks, await claim(store), [shard_of(run.id)]
        finally:
            await store.dispose()

    nothing, idle_asks, taken, shard = asyncio.run(claims())
    assert (nothing, idle_asks) == ([], []), "no shard had a ready row: no claim statement"
    assert len(taken) == 1 and asked == shard, "the one shard with a ready row was claimed from"
    assert _refusals(caplog) == []


def test_gc_goes_a_shard_at_a_time_and_archives_every_row_it_deletes(
    citus_db: CitusDatabase, tmp_path: Path
) -> None:
    """One server's retention test on the cluster: the same history, gc, archive and checks.

    gc runs under the guard (every statement on one shard); the history is built and
    the tables read whole by a session without it. A database of its own: the
    history's checks count every row of every table.
    """
    dsn = distributed_and_guarded(citus_db)
    reader = Outbox.connect(f"{dsn}?options=-c%20citus.multi_task_query_log_level%3Doff")
    try:
        history = build_history(reader, dsn)
        archive_holds_every_deleted_row(reader, dsn, tmp_path, history)
    finally:
        reader.close()
    # the old run's key went with it (from the key's own shard): it names a new run now
    ob = Outbox.connect(dsn)
    try:
        inputs = {"order": 7, "notes": "n" * 20_000}
        again = ob.start_run("a", "1", inputs, budget=100, key="order-7")
        assert again.id != history["old"].id
    finally:
        ob.close()


def test_a_gone_relays_dispatches_are_cut_a_shard_at_a_time(ob: Outbox, dsn: str) -> None:
    """A relay killed between its claim and its publish, on a cluster: its owner and lock
    live on the coordinator, its dispatched effects on the shards of their runs. The lock is
    checked on the coordinator, then each shard's dispatches are cut to the orphan TTL
    in a statement on that shard alone (the guard refuses any other); the reconciler's
    next round puts them back to ``pending``. A relay whose lock is held keeps its own."""
    dead, alive = RELAY_OWNER_PREFIX + "host:1:dead", RELAY_OWNER_PREFIX + "host:2:alive"
    for i in range(4):
        ob.start_run("relayed", "1", {"i": i}).transaction("s", partial(_three, n=i))

    async def main() -> dict[str, int]:
        store = AsyncStore(make_async_engine(dsn))
        lock = OwnerLock(store.dsn, alive)
        try:
            lock.start()
            assert await lock.wait_held(10)
            for owner in (dead, alive):
                await store.claim_many(
                    DISPATCH_QUEUE, [({"kind": STREAMED}, 6)], owner=owner, lease_seconds=300
                )
            async with store.engine.begin() as conn:  # it died: registered, its lock free
                await conn.exec_driver_sql(
                    "INSERT INTO outbox_owners (owner) VALUES (%(o)s)", {"o": dead}
                )
            cut = {
                owner: await store.end_relay_dispatches(
                    owner, ttl=0, gone_only=True, restart_grace=0
                )
                for owner in (dead, alive)
            }
            await asyncio.sleep(0.01)
            cut["redispatched"] = (await store.expired(100, redispatch_as="reconciler:t"))[0]
            return cut
        finally:
            await lock.close()
            await store.dispose()

    assert asyncio.run(main()) == {dead: 6, alive: 0, "redispatched": 6}
    with psycopg.connect(dsn) as conn:
        conn.execute("SET citus.multi_task_query_log_level = 'off'")  # the test's own read
        held = conn.execute(
            "SELECT status, lease_owner, count(*) FROM outbox_effects"
            " WHERE kind = %s AND status IN ('dispatched', 'pending')"
            " GROUP BY status, lease_owner ORDER BY status",
            [STREAMED],
        ).fetchall()
    assert held == [("dispatched", alive, 6), ("pending", None, 6)]


def test_a_statement_that_names_its_shard_by_id_stays_on_it_when_its_session_repeats_it(
    dsn: str,
) -> None:
    """One connection, the same statements again and again: PostgreSQL would switch a
    prepared statement to a generic plan, and Citus cannot route ``shard =
    outbox_shard_of($1)`` without the value (it ran on every shard; a ``FOR
    UPDATE`` one is refused)."""
    with Outbox.connect(dsn, pool_size=1) as ob:
        run = ob.start_run("repeat", "1")
        for n in range(15):
            assert ob.run(run.id).id == run.id  # read by id, routed by the id's shard
            assert ob.pause(run.id, "hold") == RunStatus.PAUSED  # locks and marks the run
            assert ob.resume(run.id) == RunStatus.RUNNABLE
            run.transaction(f"s{n}", lambda tx: None)
        assert len(ob.run(run.id).completed_steps) == 15
