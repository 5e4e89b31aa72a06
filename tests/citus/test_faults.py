"""A worker of the cluster killed mid-delivery: its shards stop, the others go on, nothing twice.

A real cluster (a coordinator and two workers), ``outbox migrate --distribute``,
a real delivery daemon and ``kill -9`` of the worker that holds half the runs
while effects are in flight. The sink applies by idempotency key, as a payment
API does: an effect delivered again after the crash is the same key, applied once.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import Counter
from functools import partial

import psycopg
import pytest
from click.testing import CliRunner

from deliverers.testing import RecordingDeliverer
from outbox import Outbox, Run, RunStatus, StepTransaction
from outbox.cli import cli as cli_main
from outbox.delivery import Delivery, Outcome, Succeeded
from outbox.shards import SHARDS, shard_of
from tests.citus_support import CitusCluster, CitusDatabase, node_port_of
from tests.support import DaemonThread, WorkerThread, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.chaos]

KIND = "k.pay"


class KeyedSink:
    """Applies each idempotency key once (a second request with it is answered, not applied)."""

    def __init__(self) -> None:
        self.applied: Counter[str] = Counter()
        self.requests = 0
        self._lock = threading.Lock()

    def __call__(self, delivery: Delivery) -> Outcome:
        time.sleep(0.02)  # a call to the outside world takes time: some are in flight at the kill
        with self._lock:
            self.requests += 1
            if delivery.idempotency_key not in self.applied:
                self.applied[delivery.idempotency_key] += 1
        return Succeeded({"key": delivery.idempotency_key})


def _intend_fifteen(tx: StepTransaction, run_id: uuid.UUID) -> None:
    for i in range(15):
        tx.intend(KIND, {"run": str(run_id), "n": i})


def _succeeded(dsn: str, run_ids: list[uuid.UUID]) -> int:
    with psycopg.connect(dsn) as conn:
        total = 0
        for run_id in run_ids:
            row = conn.execute(
                "SELECT count(*) FROM outbox_effects"
                " WHERE run_id = %s AND shard = %s AND status = 'succeeded'",
                [run_id, shard_of(run_id)],
            ).fetchone()
            assert row is not None
            total += int(row[0])
    return total


def test_a_worker_killed_mid_delivery_stops_only_its_shards_and_nothing_is_applied_twice(
    citus_cluster: CitusCluster, citus_db: CitusDatabase
) -> None:
    migrated = CliRunner().invoke(
        cli_main, ["migrate", "--distribute", "--json"], env={"OUTBOX_DSN": citus_db.dsn}
    )
    assert migrated.exit_code == 0, migrated.output
    assert "outbox_effects" in json.loads(migrated.output)["distributed"]
    victim, survivor = citus_cluster.workers
    runs: dict[int, list[uuid.UUID]] = {victim.port: [], survivor.port: []}
    with Outbox.connect(citus_db.dsn) as ob, psycopg.connect(citus_db.dsn) as conn:
        while min(len(v) for v in runs.values()) < 3:
            run = ob.start_run("payments", "1")
            port = node_port_of(conn, "outbox_runs", shard_of(run.id))
            if len(runs[port]) >= 3:
                continue
            run.transaction("pay", partial(_intend_fifteen, run_id=run.id))
            runs[port].append(run.id)
        keys = {
            e.idempotency_key for ids in runs.values() for r in ids for e in ob.effects(run_id=r)
        }
    assert len(keys) == 6 * 15

    sink = KeyedSink()
    deliverer = RecordingDeliverer(KIND, outcome=sink)
    with DaemonThread(
        citus_db.dsn, {KIND: deliverer}, batch_size=5, poll_seconds=0.1, lease_seconds=3
    ) as daemon:
        wait_for(lambda: sink.requests >= 10, timeout=60)
        victim.kill9()
        # the survivor's shards are delivered to the end while the victim is down
        wait_for(lambda: _succeeded(citus_db.dsn, runs[survivor.port]) == 45, timeout=90)
        assert victim.pid() is None
        victim.restart_after_kill()
        # the victim's shards resume: claims expired during the outage are taken over
        wait_for(lambda: _succeeded(citus_db.dsn, runs[victim.port]) == 45, timeout=120)
        assert daemon.error is None

    assert set(sink.applied) == keys, "every effect applied"
    assert max(sink.applied.values()) == 1, "none applied twice"
    with psycopg.connect(citus_db.dsn) as conn:
        rows = conn.execute(
            "SELECT effect_id, count(*) FILTER (WHERE outcome = 'succeeded')"
            " FROM outbox_effect_attempts GROUP BY effect_id"
        ).fetchall()
        twice = [r for r, n in rows if n != 1]
        detail = conn.execute(
            "SELECT effect_id, attempt, outcome, worker, started_at, finished_at, detail"
            " FROM outbox_effect_attempts WHERE effect_id = ANY(%s) ORDER BY effect_id, id",
            [twice],
        ).fetchall()
    assert len(rows) == 90
    assert {n for _, n in rows} == {1}, f"each effect recorded as succeeded exactly once: {detail}"


def test_the_coordinator_killed_under_load_loses_nothing_and_applies_nothing_twice(
    citus_cluster: CitusCluster, citus_db: CitusDatabase
) -> None:
    """kill -9 of the coordinator while steps commit and effects are delivered, then a restart."""
    migrated = CliRunner().invoke(
        cli_main, ["migrate", "--distribute", "--json"], env={"OUTBOX_DSN": citus_db.dsn}
    )
    assert migrated.exit_code == 0, migrated.output
    sink = KeyedSink()
    deliverer = RecordingDeliverer(KIND, outcome=sink)
    committed: list[uuid.UUID] = []
    stop = threading.Event()

    def writer() -> None:
        # a step either committed (its run id is kept) or raised: retried as a new run
        while not stop.is_set():
            try:
                with Outbox.connect(citus_db.dsn) as ob:
                    while not stop.is_set():
                        run = ob.start_run("payments", "1")
                        run.transaction("pay", partial(_intend_fifteen, run_id=run.id))
                        committed.append(run.id)
            except Exception:
                time.sleep(0.2)

    thread = threading.Thread(target=writer, daemon=True)
    with DaemonThread(
        citus_db.dsn, {KIND: deliverer}, batch_size=5, poll_seconds=0.1, lease_seconds=3
    ) as daemon:
        thread.start()
        wait_for(lambda: len(committed) >= 3 and sink.requests >= 10, timeout=60)
        citus_cluster.coordinator.kill9()
        time.sleep(1)
        citus_cluster.coordinator.restart_after_kill()
        wait_for(lambda: len(committed) >= 8, timeout=90, message="writes resumed")
        stop.set()
        thread.join(30)
        wait_for(
            lambda: _succeeded(citus_db.dsn, list(committed)) == 15 * len(committed),
            timeout=120,
            message="every committed effect delivered",
        )
        assert daemon.error is None
    with psycopg.connect(citus_db.dsn) as conn:
        keys = {
            row[0]
            for row in conn.execute(
                "SELECT idempotency_key FROM outbox_effects WHERE run_id = ANY(%s)",
                [list(committed)],
            ).fetchall()
        }
        counts = conn.execute(
            "SELECT count(*) FILTER (WHERE outcome = 'succeeded') FROM outbox_effect_attempts"
            " GROUP BY effect_id"
        ).fetchall()
    assert len(keys) == 15 * len(committed), "every committed step kept its intents"
    assert keys <= set(sink.applied), "every committed intent applied"
    assert max(sink.applied.values()) == 1, "none applied twice"
    assert {n for (n,) in counts} <= {0, 1}, "no effect recorded succeeded twice"


def test_a_run_worker_with_a_node_down_drives_the_runs_on_the_other_node(
    citus_cluster: CitusCluster, citus_db: CitusDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    """Runs waiting on both workers; one is killed: the survivor's runs complete, then the rest.

    Each run sleeps on a timer, so the worker's sweeps (timers, rescue, its
    heartbeat) must go on over the shards that answer, as its claims do.
    """
    migrated = CliRunner().invoke(
        cli_main, ["migrate", "--distribute", "--json"], env={"OUTBOX_DSN": citus_db.dsn}
    )
    assert migrated.exit_code == 0, migrated.output
    victim, survivor = citus_cluster.workers
    runs: dict[int, list[uuid.UUID]] = {victim.port: [], survivor.port: []}
    done: list[uuid.UUID] = []
    with Outbox.connect(citus_db.dsn) as ob:
        with psycopg.connect(citus_db.dsn) as conn:
            while min(len(v) for v in runs.values()) < 3:
                run = ob.start_run("errands", "1")
                runs[node_port_of(conn, "outbox_runs", shard_of(run.id))].append(run.id)
        victim.kill9()

        def handler(run: Run) -> str:
            run.transaction("only", lambda tx: None)
            run.sleep("nap", 0.2)
            done.append(run.id)
            return "done"

        with WorkerThread(ob, "errands", "1", handler, poll_seconds=0.1):
            wait_for(
                lambda: set(runs[survivor.port]) <= set(done),
                timeout=60,
                message="the survivor's runs completed while the other node is down",
            )
            assert not set(runs[victim.port]) & set(done)
            failed = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
            assert failed == [], "no sweep or claim failed while a node is down"
            victim.restart_after_kill()
            wait_for(
                lambda: set(runs[victim.port]) <= set(done),
                timeout=90,
                message="the restarted node's runs completed",
            )
        statuses = {ob.run(r).status for ids in runs.values() for r in ids}
    assert statuses == {RunStatus.COMPLETED}
    assert len(done) == len(set(done)), "each run finished once"


def test_gc_with_a_node_down_collects_the_other_nodes_shards_and_names_the_rest(
    citus_cluster: CitusCluster, citus_db: CitusDatabase
) -> None:
    """A worker killed: gc deletes the survivor's finished runs, names the victim's shards, exits 1.

    The runs have no caller's key: a key is registered on its own shard, which may be
    on the other node, and a batch deletes a run with its key or not at all.
    """
    env = {"OUTBOX_DSN": citus_db.dsn}
    migrated = CliRunner().invoke(cli_main, ["migrate", "--distribute", "--json"], env=env)
    assert migrated.exit_code == 0, migrated.output
    victim, survivor = citus_cluster.workers
    finished: dict[int, list[uuid.UUID]] = {victim.port: [], survivor.port: []}
    with Outbox.connect(citus_db.dsn) as ob, psycopg.connect(citus_db.dsn) as conn:
        while min(len(v) for v in finished.values()) < 2:
            run = ob.start_run("tidy", "1")
            run.complete({"ok": True})
            finished[node_port_of(conn, "outbox_runs", shard_of(run.id))].append(run.id)
        on_victim = {
            s for s in range(SHARDS) if node_port_of(conn, "outbox_runs", s) == victim.port
        }
    assert 0 < len(on_victim) < SHARDS

    victim.kill9()
    try:
        down = CliRunner().invoke(cli_main, ["gc", "--older-than", "0s", "--json"], env=env)
        assert down.exit_code == 1, down.output
        report = json.loads(down.stdout)
        assert {int(s) for s in report["unreachable_shards"]} == on_victim
        assert all("remote node" in e for e in report["unreachable_shards"].values()), report
        assert report["deleted"]["outbox_runs"] == len(finished[survivor.port])
        assert "left for the next gc" in down.stderr
    finally:
        victim.restart_after_kill()

    back = CliRunner().invoke(cli_main, ["gc", "--older-than", "0s", "--json"], env=env)
    assert back.exit_code == 0, back.output
    report = json.loads(back.stdout)
    assert report["unreachable_shards"] == {}
    assert report["deleted"]["outbox_runs"] == len(finished[victim.port])
    with Outbox.connect(citus_db.dsn) as ob:
        assert ob.runs(agent="tidy") == []
