"""Stream mode through a real Kafka-protocol broker: relay -> Kafka -> stream deliverers.

Every test runs the real `outbox relay` and `outbox deliver --from-kafka`
processes against a Tansu broker and a real HTTP sink. Expected: every intent
is delivered, each applied once at the sink; crashes of a relay or a stream
deliverer lose nothing; effects sharing an ordering key arrive in intent order.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from deliverers.testing import TANSU_CONSUMER_TUNING, IdempotentHttpSink, TansuBroker
from outbox import Outbox, StepTransaction
from tests.support import wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

TOPIC = "outbox.http.request"


@pytest.fixture
def sink(tmp_path: Path) -> Iterator[IdempotentHttpSink]:
    with IdempotentHttpSink(log_path=tmp_path / "sink.jsonl") as running:
        yield running


@pytest.fixture
def slow_sink(tmp_path: Path) -> Iterator[IdempotentHttpSink]:
    with IdempotentHttpSink(log_path=tmp_path / "slow-sink.jsonl", latency=1.5) as running:
        yield running


def config(tmp_path: Path) -> Path:
    path = tmp_path / "deliverers.toml"
    path.write_text('[kinds."http.request"]\nallow_private = ["127.0.0.1"]\n')
    return path


def spawn(
    args: list[str], env: dict[str, str], log: Path, crash_at: str | None = None
) -> subprocess.Popen[bytes]:
    child = {k: v for k, v in env.items() if k != "OUTBOX_TEST_CRASH_AT"}
    if crash_at:
        child["OUTBOX_TEST_CRASH_AT"] = crash_at
    with log.open("ab") as handle:
        return subprocess.Popen(
            [sys.executable, "-m", "outbox", *args],
            env=child,
            stdout=handle,
            stderr=subprocess.STDOUT,
        )


def relay(
    broker: TansuBroker, env: dict[str, str], tmp_path: Path, name: str, crash_at: str | None = None
) -> subprocess.Popen[bytes]:
    return spawn(
        [
            "relay",
            "--kafka",
            broker.bootstrap,
            "--config",
            str(config(tmp_path)),
            "--dispatch-ttl",
            "30",
        ],
        env,
        tmp_path / f"{name}.log",
        crash_at,
    )


def stream_deliverer(
    broker: TansuBroker, env: dict[str, str], tmp_path: Path, name: str, *extra: str
) -> subprocess.Popen[bytes]:
    tuning = [a for k, v in TANSU_CONSUMER_TUNING.items() for a in ("--kafka-option", f"{k}={v}")]
    return spawn(
        [
            "deliver",
            "--from-kafka",
            broker.bootstrap,
            "--group",
            "stream-test",
            "--config",
            str(config(tmp_path)),
            "--lease",
            "2",
            *tuning,
            *extra,
        ],
        env,
        tmp_path / f"{name}.log",
    )


def stop(*procs: subprocess.Popen[bytes]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def intend(ob: Outbox, url: str, n: int, ordering: int = 0, first: int = 0) -> None:
    run = ob.start_run("agent", "1")

    def step(tx: StepTransaction) -> None:
        for i in range(first, first + n):
            extra: dict[str, Any] = {}
            if ordering:
                extra["ordering_key"] = f"acct-{i % ordering}"
            tx.intend(
                "http.request",
                {
                    "url": url,
                    "json": {"operation": f"op-{i}", "n": i, "key": extra.get("ordering_key")},
                },
                **extra,
            )

    run.transaction(f"s-{n}-{ordering}", step)


def settled(ob: Outbox, n: int, tmp_path: Path, timeout: float) -> None:
    """Wait until all n effects succeeded; on failure, show the processes' logs."""
    try:
        wait_for(lambda: statuses(ob) == {"succeeded": n}, timeout=timeout, message="delivery")
    except AssertionError as exc:
        tails = "\n".join(
            f"--- {log.name}\n" + "\n".join(log.read_text().splitlines()[-25:])
            for log in sorted(tmp_path.glob("*.log"))
        )
        raise AssertionError(f"{exc}; statuses {statuses(ob)}\n{tails}") from None


def statuses(ob: Outbox) -> dict[str, int]:
    counts: dict[str, int] = {}
    for e in ob.effects(limit=100_000):
        counts[e.status.value] = counts.get(e.status.value, 0) + 1
    return counts


def assert_applied_once(ob: Outbox, sink: IdempotentHttpSink, n: int) -> None:
    assert statuses(ob) == {"succeeded": n}
    stats = sink.stats()
    assert stats["keys_applied"] == n
    assert stats["duplicate_keys_applied"] == [] and stats["duplicate_operations"] == []


def test_relay_and_stream_deliverer_deliver_every_effect_once(
    ob: Outbox,
    sub_env: dict[str, str],
    tmp_path: Path,
    kafka_broker: TansuBroker,
    sink: IdempotentHttpSink,
) -> None:
    kafka_broker.create_topic(TOPIC, partitions=3)
    intend(ob, f"{sink.url}/ledger", 40)
    procs = [
        relay(kafka_broker, sub_env, tmp_path, "relay"),
        stream_deliverer(kafka_broker, sub_env, tmp_path, "stream"),
    ]
    try:
        settled(ob, 40, tmp_path, timeout=90)
    finally:
        stop(*procs)
    assert_applied_once(ob, sink, 40)
    effect = ob.effects(limit=1)[0]
    outcomes = [a.outcome for a in ob.store.attempts(effect.id)]
    # The relay's claim is not an outcome: one row, the deliverer's
    assert outcomes == ["succeeded"]
    assert effect.run_id is not None and ob.verify_run(effect.run_id) == []


def test_kill_9_of_a_stream_deliverer_mid_batch_loses_nothing(
    ob: Outbox,
    sub_env: dict[str, str],
    tmp_path: Path,
    kafka_broker: TansuBroker,
) -> None:
    kafka_broker.create_topic(TOPIC, partitions=3)
    with IdempotentHttpSink(latency=0.3) as slow_sink:
        intend(ob, f"{slow_sink.url}/ledger", 30)
        the_relay = relay(kafka_broker, sub_env, tmp_path, "relay")
        doomed = stream_deliverer(kafka_broker, sub_env, tmp_path, "doomed")
        try:
            wait_for(lambda: slow_sink.in_progress > 0, timeout=60, message="calls in flight")
            doomed.send_signal(signal.SIGKILL)
            doomed.wait(10)
            survivor = stream_deliverer(kafka_broker, sub_env, tmp_path, "survivor")
            try:
                settled(ob, 30, tmp_path, timeout=120)
            finally:
                stop(survivor)
        finally:
            stop(the_relay)
        assert_applied_once(ob, slow_sink, 30)


def test_relay_crash_right_after_publishing(
    ob: Outbox,
    sub_env: dict[str, str],
    tmp_path: Path,
    kafka_broker: TansuBroker,
    sink: IdempotentHttpSink,
) -> None:
    """A relay killed once Kafka has its records: every effect is applied once.

    Its claim made the rows ``dispatched`` before it published, so nothing is
    left for it to do: the stream deliverer takes each effect from its record,
    with the dead relay's attempt.
    """
    kafka_broker.create_topic(TOPIC, partitions=1)
    intend(ob, f"{sink.url}/ledger", 10)
    doomed = relay(kafka_broker, sub_env, tmp_path, "doomed", crash_at="after_publish")
    assert doomed.wait(timeout=60) == -signal.SIGKILL
    assert statuses(ob) == {"dispatched": 10}, "dispatched by the claim, before the publish"
    procs = [
        stream_deliverer(kafka_broker, sub_env, tmp_path, "stream"),
        relay(kafka_broker, sub_env, tmp_path, "relay"),
    ]
    try:
        settled(ob, 10, tmp_path, timeout=120)
    finally:
        stop(*procs)
    assert_applied_once(ob, sink, 10)
    for effect in ob.effects(limit=10):
        log = [(a.attempt, a.outcome) for a in ob.store.attempts(effect.id)]
        assert log == [(1, "succeeded")], "taken from the dead relay's record, delivered once"


def test_order_per_key_with_three_partitions_and_two_consumers(
    ob: Outbox,
    sub_env: dict[str, str],
    tmp_path: Path,
    kafka_broker: TansuBroker,
    sink: IdempotentHttpSink,
) -> None:
    kafka_broker.create_topic(TOPIC, partitions=3)
    intend(ob, f"{sink.url}/ledger", 40, ordering=4)
    procs = [
        relay(kafka_broker, sub_env, tmp_path, "relay"),
        stream_deliverer(kafka_broker, sub_env, tmp_path, "c1"),
        stream_deliverer(kafka_broker, sub_env, tmp_path, "c2"),
    ]
    try:
        settled(ob, 40, tmp_path, timeout=120)
    finally:
        stop(*procs)
    assert_applied_once(ob, sink, 40)
    arrivals: dict[str, list[int]] = {}
    for line in (tmp_path / "sink.jsonl").read_text().splitlines():
        body = json.loads(json.loads(line)["body"])
        arrivals.setdefault(body["key"], []).append(body["n"])
    assert len(arrivals) == 4
    for key, seen in arrivals.items():
        assert seen == sorted(seen), f"{key} delivered out of intent order: {seen}"


def held_by_stream(ob: Outbox) -> bool:
    with ob.engine.connect() as conn:
        return bool(
            conn.exec_driver_sql(
                "SELECT count(*) FROM outbox_effects WHERE status = 'in_flight'"
                " AND lease_owner NOT LIKE 'relay:%%'"
            ).scalar_one()
        )


def test_relay_and_stream_deliverer_survive_losing_their_database_connections(
    ob: Outbox,
    dsn: str,
    sub_env: dict[str, str],
    tmp_path: Path,
    kafka_broker: TansuBroker,
    slow_sink: IdempotentHttpSink,
) -> None:
    """Expected: neither daemon dies when PostgreSQL drops its connections; nothing is lost.

    Three times, while the stream deliverer is inside calls to a slow sink, every
    pooled connection of the relay and the stream deliverer is ended with
    ``pg_terminate_backend``. Both keep running (the pool replaces the dead
    connections; a batch whose recording still fails is read again, or left to
    its lease by the relay), and the sink applies each of the 60 keys once.
    """
    kafka_broker.create_topic(TOPIC, partitions=3)
    sink = slow_sink
    procs = [
        relay(kafka_broker, sub_env, tmp_path, "relay"),
        stream_deliverer(kafka_broker, sub_env, tmp_path, "stream"),
    ]
    ended = []
    try:
        for round_ in range(3):
            intend(ob, f"{sink.url}/ledger", 20, first=20 * round_)
            # Earlier rounds are delivered, and the stream deliverer is inside this
            # round's calls (it has reconnected since the last round's kill).

            def delivered(before: int = 20 * round_) -> bool:
                return statuses(ob).get("succeeded", 0) >= before and held_by_stream(ob)

            wait_for(delivered, timeout=120)
            with psycopg.connect(dsn, autocommit=True) as admin:
                ended.append(
                    len(
                        admin.execute(
                            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                            " AND application_name = 'outbox-deliver'"
                        ).fetchall()
                    )
                )
        settled(ob, 60, tmp_path, timeout=180)
        assert [p.poll() for p in procs] == [None, None], "both daemons are still running"
    finally:
        stop(*procs)
    assert all(n >= 1 for n in ended), f"each round ended connections: {ended}"
    assert_applied_once(ob, sink, 60)


def test_a_held_effect_is_not_relayed_until_approved_then_delivered_once(
    ob: Outbox,
    sub_env: dict[str, str],
    tmp_path: Path,
    kafka_broker: TansuBroker,
    sink: IdempotentHttpSink,
) -> None:
    """Stream mode honours approval gates: the relay publishes only what was approved."""
    kafka_broker.create_topic(TOPIC, partitions=3)
    run = ob.start_run("agent", "1")

    def step(tx: StepTransaction) -> None:
        tx.intend("http.request", {"url": f"{sink.url}/ledger", "json": {"operation": "free"}})
        tx.intend(
            "http.request",
            {"url": f"{sink.url}/ledger", "json": {"operation": "held"}},
            approval={"timeout": 3600},
        )

    run.transaction("pay", step)
    free, held = sorted(ob.effects(run_id=run.id), key=lambda e: e.step_index or 0)
    procs = [
        relay(kafka_broker, sub_env, tmp_path, "relay"),
        stream_deliverer(kafka_broker, sub_env, tmp_path, "stream"),
    ]
    try:
        wait_for(lambda: ob.effect(free.id).status == "succeeded", timeout=90, message="free")
        assert ob.effect(held.id).status == "awaiting_approval"
        assert sink.stats()["keys_applied"] == 1, "the held effect was not published"
        ob.approve_effect(held.id, digest=held.digest, note="ok", by="cfo")
        settled(ob, 2, tmp_path, timeout=90)
    finally:
        stop(*procs)
    assert_applied_once(ob, sink, 2)
    outcomes = [a.outcome for a in ob.store.attempts(held.id)]
    assert outcomes == ["approved", "succeeded"]
