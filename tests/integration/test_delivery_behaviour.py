"""Daemon behaviour: per-key order, per-kind limits and rate limits, unknown kinds, metrics."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import psycopg
import pytest

from deliverers.testing import RecordingDeliverer
from outbox import EffectStatus, Outbox, StepTransaction
from outbox.delivery import Delivery, Outcome, Succeeded
from outbox.shards import shard_of
from outbox.storage.dsn import libpq_dsn
from tests.support import DaemonThread, wait_for


def _all(ob: Outbox, status: str, n: int) -> bool:
    return len(ob.effects(status=status, limit=10_000)) == n


def test_effects_sharing_an_ordering_key_are_delivered_one_at_a_time_in_order(
    ob: Outbox, dsn: str
) -> None:
    run = ob.start_run("agent", "1")

    def step(tx: StepTransaction) -> None:
        for i in range(30):
            tx.intend("k.ordered", {"account": i % 3, "n": i}, ordering_key=f"acct-{i % 3}")
        for i in range(30):
            tx.intend("k.ordered", {"free": i})

    run.transaction("s", step)
    active: dict[str, int] = {}
    overlaps: list[str] = []
    lock = threading.Lock()

    def slow(delivery: Delivery) -> Outcome:
        key = delivery.ordering_key
        if key is not None:
            with lock:
                active[key] = active.get(key, 0) + 1
                if active[key] > 1:
                    overlaps.append(key)
            time.sleep(0.01)
            with lock:
                active[key] -= 1
        return Succeeded()

    recorder = RecordingDeliverer("k.ordered", outcome=slow)
    with DaemonThread(dsn, {"k.ordered": recorder}, concurrency=16):
        wait_for(lambda: _all(ob, "succeeded", 60), timeout=60)
    assert overlaps == [], "never two effects of one ordering key at once"
    for account in range(3):
        seen = [d.payload["n"] for d in recorder.deliveries if d.ordering_key == f"acct-{account}"]
        assert seen == sorted(seen) and len(seen) == 10, "intent order within a key"


def test_an_ordering_key_orders_the_effects_of_runs_on_other_shards_and_of_no_run(
    ob: Outbox, dsn: str
) -> None:
    # a run's effects live on its logical shard: the key spans them all the same
    runs = [ob.start_run("agent", "1")]
    while len(runs) < 3:
        run = ob.start_run("agent", "1")
        if shard_of(run.id) not in {shard_of(r.id) for r in runs}:
            runs.append(run)
    for n, run in enumerate(runs):

        def step(tx: StepTransaction, n: int = n) -> None:
            tx.intend("k.o", {"n": n}, ordering_key="c-42")

        run.transaction("s", step)
    with ob.transaction() as tx:
        tx.intend("k.o", {"n": 3}, ordering_key="c-42")
    calls: list[tuple[str, int]] = []

    def slow(delivery: Delivery) -> Outcome:
        calls.append(("start", delivery.payload["n"]))
        time.sleep(0.05)
        calls.append(("end", delivery.payload["n"]))
        return Succeeded()

    with DaemonThread(dsn, {"k.o": RecordingDeliverer("k.o", outcome=slow)}, concurrency=8):
        wait_for(lambda: _all(ob, "succeeded", 4))
    assert calls == [(edge, n) for n in range(4) for edge in ("start", "end")]


@pytest.mark.parametrize("second_writer", ["step", "no run"])
def test_two_transactions_writing_one_ordering_key_at_once_are_delivered_in_commit_order(
    ob: Outbox, dsn: str, second_writer: str
) -> None:
    """An effect's seq is drawn at insert: the writer that inserted first and has
    not committed yet is still delivered first. Its key is locked until it commits,
    so a second writer of the key waits and comes after (before, the second was
    delivered while the first was open: 2 of 2 writers)."""
    first, second = ob.start_run("agent", "1"), ob.start_run("agent", "1")
    recorder = RecordingDeliverer("k.o")
    written = threading.Event()

    def write_second() -> None:
        with Outbox.connect(dsn) as other:
            if second_writer == "step":
                other.run(second.id).transaction(
                    "s", lambda tx: tx.intend("k.o", {"n": 1}, ordering_key="c-7") and None
                )
            else:
                with other.transaction() as tx:
                    tx.intend("k.o", {"n": 1}, ordering_key="c-7")
        written.set()

    with psycopg.connect(libpq_dsn(dsn)) as held:
        # the first writer, through the SQL API: its step written, not committed
        held.execute(
            "SELECT * FROM outbox_commit_step(%s, 's', intents => %s::jsonb)",
            [first.id, json.dumps([{"kind": "k.o", "payload": {"n": 0}, "ordering_key": "c-7"}])],
        )
        writer = threading.Thread(target=write_second)
        writer.start()
        with DaemonThread(dsn, {"k.o": recorder}, poll_seconds=0.05):
            time.sleep(1.0)
            assert not written.is_set(), "the second writer of the key waits for the first"
            held.commit()
            writer.join(timeout=30)
            wait_for(lambda: _all(ob, "succeeded", 2))
    assert [d.payload["n"] for d in recorder.deliveries] == [0, 1]


def test_writers_each_locking_two_keys_in_one_call_never_deadlock(ob: Outbox, dsn: str) -> None:
    """The keys' locks are taken in the order of what is locked, their hashes: k1 < k2
    < k3 with hashtext(k1) = hashtext(k3), locked in the keys' own order, had writers
    of {k1, k2} and {k2, k3} take two locks in opposite orders (a deadlock)."""
    k1, k2, k3 = "key-112110", "key-12", "key-19649"  # found by a search of 400,000 keys
    with psycopg.connect(libpq_dsn(dsn)) as conn:
        same = conn.execute("SELECT hashtext(%s) = hashtext(%s)", [k1, k3]).fetchone()
    assert same == (True,) and k1 < k2 < k3
    errors: list[BaseException] = []

    def write(keys: list[str]) -> None:
        try:
            with Outbox.connect(dsn) as other, other.transaction() as tx:
                for key in keys:
                    tx.intend("k.o", {"k": key}, ordering_key=key)
        except BaseException as exc:
            errors.append(exc)

    with psycopg.connect(libpq_dsn(dsn)) as holder:
        # a third writer of k3 (k1's hash), open: the first writer queues behind it
        holder.execute(
            "SELECT * FROM outbox_intend_all(NULL, NULL, %s::jsonb)",
            [json.dumps([{"kind": "k.o", "payload": {}, "ordering_key": k3}])],
        )
        first = threading.Thread(target=write, args=([k1, k2],))
        first.start()
        time.sleep(0.5)
        second = threading.Thread(target=write, args=([k2, k3],))
        second.start()
        time.sleep(0.5)
        holder.commit()
        first.join(30)
        second.join(30)
    assert errors == [], [str(e)[:200] for e in errors]
    assert _all(ob, "pending", 5)


def test_a_failed_effect_does_not_block_its_key_forever(ob: Outbox, dsn: str) -> None:
    run = ob.start_run("agent", "1")
    run.transaction(
        "s", lambda tx: [tx.intend("k.o", {"n": n}, ordering_key="k") for n in range(3)] and None
    )
    from outbox.delivery import Failed

    recorder = RecordingDeliverer(
        "k.o", outcome=lambda d: Failed("bad") if d.payload["n"] == 0 else Succeeded()
    )
    with DaemonThread(dsn, {"k.o": recorder}):
        wait_for(lambda: _all(ob, "succeeded", 2))
    assert [d.payload["n"] for d in recorder.deliveries] == [0, 1, 2]


def test_unknown_kind_stays_pending_with_a_clear_error(ob: Outbox, dsn: str) -> None:
    run = ob.start_run("agent", "1")
    run.transaction("s", lambda tx: tx.intend("crm.update", {"id": 1}) and None)
    with DaemonThread(
        dsn,
        {"k.other": RecordingDeliverer("k.other")},
        reconcile_seconds=0.1,
        unknown_kind_grace_seconds=0,
    ):
        wait_for(lambda: ob.effects()[0].last_error is not None)
    effect = ob.effects()[0]
    assert effect.status == EffectStatus.PENDING and effect.attempt == 0
    assert effect.last_error == "no deliverer is registered for kind crm.update"
    recorder = RecordingDeliverer("crm.update")
    with DaemonThread(dsn, {"crm.update": recorder}):  # a later deploy knows the kind
        wait_for(lambda: _all(ob, "succeeded", 1))
    assert ob.effects()[0].last_error is None


def test_unknown_payload_schema_version_is_left_pending(ob: Outbox, dsn: str) -> None:
    run = ob.start_run("agent", "1")
    run.transaction("s", lambda tx: tx.intend("k.v", {"v2": True}, schema_version=2) and None)
    recorder = RecordingDeliverer("k.v")
    with DaemonThread(dsn, {"k.v": recorder}):
        wait_for(lambda: ob.effects()[0].last_error is not None)
    effect = ob.effects()[0]
    assert effect.status == EffectStatus.PENDING
    assert "payload schema version 2 of kind 'k.v' is not understood" in (effect.last_error or "")
    assert recorder.deliveries == [], "never guessed"


def test_metrics_are_served(ob: Outbox, dsn: str) -> None:
    import socket

    run = ob.start_run("agent", "1")
    run.transaction("s", lambda tx: [tx.intend("k.m", {"n": n}) for n in range(3)] and None)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with DaemonThread(dsn, {"k.m": RecordingDeliverer("k.m")}, stats_seconds=0.1) as daemon:
        wait_for(lambda: _all(ob, "succeeded", 3))
        assert daemon.daemon is not None
        daemon.daemon.metrics.serve(port)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    assert 'outbox_attempts_total{kind="k.m",outcome="succeeded"} 3.0' in body
    assert 'outbox_delivery_latency_seconds_count{kind="k.m"} 3.0' in body
    assert "outbox_oldest_pending_age_seconds" in body
