"""kafka.publish against a real Kafka-protocol broker (Tansu): headers, refusals, outages, dedup.

Never a mock: every test starts its own broker (``kafka_broker``), delivers
with the real delivery daemon (``DaemonThread``) and reads the topic back with
kafka-python's consumer.
"""

from __future__ import annotations

import base64
import gc
import json
import threading
import time
import uuid
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from sqlalchemy import Connection, func, select, text

from deliverers.kafka import KafkaDeliverer
from deliverers.kafka_dedup import DedupConsumer, DedupStats
from deliverers.testing import TANSU_CONSUMER_TUNING
from outbox import Outbox, StepTransaction, ValidationError
from outbox.models import Effect
from outbox.storage.schema import consumed_keys
from tests.support import DaemonThread, wait_for

pytestmark = [
    pytest.mark.kafka,
    pytest.mark.slow,
    # kafka-python 3.0 does not close a socket whose connect() was refused or timed out
    # (kafka/net/inet.py sock_connect); the garbage collector closes it later, with a
    # ResourceWarning. Outage tests refuse connections on purpose.
    pytest.mark.filterwarnings("ignore:unclosed <socket.socket:ResourceWarning"),
]


@pytest.fixture(autouse=True)
def _collect_leaked_sockets() -> Iterator[None]:
    """Collect those sockets inside this module's tests, not during someone else's test."""
    yield
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "unclosed <socket.socket", ResourceWarning)
        gc.collect()


TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
# Short timeouts so an outage costs seconds: the producer gives up on a record after 1 s.
FAST = {"request_timeout_ms": 1000, "max_block_ms": 1000, "max_attempts": 200}
FAST_RETRIES: dict[str, Any] = {"retry_base_seconds": 0.05, "retry_cap_seconds": 0.5}


def unique_topic(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def deliverer_for(broker: Any, **config: Any) -> KafkaDeliverer:
    made = KafkaDeliverer.from_config(
        "kafka.publish", {"bootstrap_servers": broker.bootstrap, **config}
    )
    assert isinstance(made, KafkaDeliverer)
    return made


def intend(ob: Outbox, payloads: list[dict[str, Any]], step: str = "publish") -> uuid.UUID:
    run = ob.start_run("publisher", "1")

    def publish(tx: StepTransaction) -> list[str]:
        return [tx.intend("kafka.publish", payload).idempotency_key for payload in payloads]

    run.transaction(step, publish)
    return run.id


def effects(ob: Outbox) -> list[Effect]:
    return ob.effects(kind="kafka.publish", limit=100_000)


def all_status(ob: Outbox, status: str, count: int) -> bool:
    found = effects(ob)
    return len(found) == count and all(e.status.value == status for e in found)


@contextmanager
def consumer_for(broker: Any, *topics: str, **settings: Any) -> Iterator[KafkaConsumer]:
    options: dict[str, Any] = {
        "auto_offset_reset": "earliest",
        "enable_auto_commit": False,
        **TANSU_CONSUMER_TUNING,
        **settings,
    }
    consumer = KafkaConsumer(*topics, bootstrap_servers=broker.bootstrap, **options)
    try:
        yield consumer
    finally:
        consumer.close()


def read_topic(broker: Any, topic: str, count: int, timeout: float = 30.0) -> list[Any]:
    """At least ``count`` records of ``topic`` (all partitions, no consumer group)."""
    records: list[Any] = []
    with consumer_for(broker, topic, group_id=None) as consumer:

        def enough() -> bool:
            for batch in consumer.poll(timeout_ms=200).values():
                records.extend(batch)
            return len(records) >= count

        wait_for(enough, timeout=timeout, message=f"{count} records in {topic}")
        # Anything beyond ``count`` (a duplicate) would arrive in the same polls.
        for batch in consumer.poll(timeout_ms=500).values():
            records.extend(batch)
    return records


def partition_end_offsets(broker: Any, topic: str) -> dict[int, int]:
    with consumer_for(broker, group_id=None) as consumer:
        partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)]
        return {tp.partition: end for tp, end in consumer.end_offsets(partitions).items()}


def end_offsets(broker: Any, topic: str) -> int:
    return sum(partition_end_offsets(broker, topic).values())


def header_map(record: Any) -> dict[str, bytes]:
    return dict(record.headers)


def create_scratch_table(ob: Outbox, name: str) -> None:
    with ob.engine.begin() as conn:
        conn.exec_driver_sql(
            f"CREATE TABLE {name} (key TEXT, value TEXT, part INT, kafka_offset BIGINT)"
        )


def recorder(table: str) -> Callable[[Any, Connection], None]:
    """A ``handle`` that writes one row per record into ``table`` (no unique constraint)."""

    def handle(record: Any, connection: Connection) -> None:
        key = header_map(record).get("idempotency-key")
        connection.execute(
            text(f"INSERT INTO {table} (key, value, part, kafka_offset) VALUES (:k, :v, :p, :o)"),
            {
                "k": None if key is None else key.decode(),
                "v": record.value.decode(),
                "p": record.partition,
                "o": record.offset,
            },
        )

    return handle


def rows(ob: Outbox, table: str) -> list[tuple[Any, ...]]:
    with ob.engine.connect() as conn:
        return [
            tuple(r) for r in conn.execute(text(f"SELECT key, value FROM {table} ORDER BY 1, 2"))
        ]


def marked(ob: Outbox, group: str) -> set[str]:
    with ob.engine.connect() as conn:
        query = select(consumed_keys.c.idempotency_key).where(
            consumed_keys.c.consumer_group == group
        )
        return set(conn.execute(query).scalars())


def drain(
    dedup: DedupConsumer,
    handle: Callable[[Any, Connection], object],
    records: int,
    timeout: float = 60.0,
) -> DedupStats:
    """Call ``process`` until ``records`` records were polled; the summed stats."""
    total = DedupStats()

    def done() -> bool:
        stats = dedup.process(handle, timeout_ms=200)
        total.polled += stats.polled
        total.processed += stats.processed
        total.duplicates += stats.duplicates
        total.unkeyed += stats.unkeyed
        total.committed = total.committed or stats.committed
        return total.polled >= records

    wait_for(done, timeout=timeout, message=f"{records} records polled")
    return total


# -- publishing --------------------------------------------------------------------------


def test_records_carry_value_key_and_the_effect_ids(
    ob: Outbox, dsn: str, kafka_broker: Any
) -> None:
    topic = unique_topic("orders")
    kafka_broker.create_topic(topic, 3)
    raw = bytes(range(256))
    payloads: list[dict[str, Any]] = [
        {"topic": topic, "key": f"order-{i % 2}", "value": {"order": i, "note": "café"}}
        for i in range(6)
    ]
    payloads.append({"topic": topic, "value_b64": base64.b64encode(raw).decode()})
    payloads.append(
        {
            "topic": topic,
            "key": "traced",
            "value": [1, None, "x"],
            "headers": {"tenant": "acme", "schema": "v2"},
            "traceparent": TRACEPARENT,
            "partition": 2,
        }
    )
    run_id = intend(ob, payloads)
    deliverer = deliverer_for(kafka_broker, allowed_topics=["orders-*"])
    with DaemonThread(dsn, {"kafka.publish": deliverer}):
        wait_for(lambda: all_status(ob, "succeeded", len(payloads)), message="all published")

    published = effects(ob)
    records = read_topic(kafka_broker, topic, len(payloads))
    assert len(records) == len(payloads), "each effect is published exactly once"
    by_position = {(r.partition, r.offset): r for r in records}
    for effect in published:
        assert set(effect.result) == {"topic", "partition", "offset"}
        assert effect.result["topic"] == topic
        record = by_position[(effect.result["partition"], effect.result["offset"])]
        headers = header_map(record)
        assert headers["idempotency-key"] == effect.idempotency_key.encode()
        assert headers["run-id"] == str(run_id).encode()
        assert headers["effect-id"] == str(effect.id).encode()
        payload = effect.payload
        assert record.key == (None if payload.get("key") is None else payload["key"].encode())
        if "value_b64" in payload:
            assert record.value == raw
        else:
            assert json.loads(record.value) == payload["value"]
        if payload.get("traceparent"):
            assert headers["traceparent"] == TRACEPARENT.encode()
            assert headers["tenant"] == b"acme" and headers["schema"] == b"v2"
            assert record.partition == 2
        else:
            assert set(headers) == {"idempotency-key", "run-id", "effect-id"}
    # Records with the same key (three each) land in one partition, as Kafka promises.
    for key in (b"order-0", b"order-1"):
        assert len([r for r in records if r.key == key]) == 3
        assert len({r.partition for r in records if r.key == key}) == 1


def test_bad_records_fail_with_a_clear_reason(ob: Outbox, dsn: str, kafka_broker: Any) -> None:
    topic = unique_topic("allowed")
    kafka_broker.create_topic(topic, 1)
    payloads: dict[str, dict[str, Any]] = {
        "ok": {"topic": topic, "value": {"fine": True}},
        "run-id": {"topic": topic, "value": 1, "headers": {"run-id": "forged"}},
        "elsewhere": {"topic": unique_topic("secret"), "value": 1},
        "both": {"topic": topic, "value": 1, "value_b64": "AAEC"},
        "neither": {"topic": topic},
        "bad-topic": {"topic": "no spaces allowed", "value": 1},
        "too-large": {"topic": topic, "value": "x" * 4000},
    }
    # A forged idempotency key never gets this far: intend refuses it
    # (outbox.governance.intent_rules).
    with pytest.raises(ValidationError, match="set by the deliverer"):
        intend(ob, [{"topic": topic, "value": 1, "headers": {"Idempotency-Key": "forged"}}])
    intend(ob, list(payloads.values()))
    deliverer = deliverer_for(
        kafka_broker, allowed_topics=["allowed-*"], producer={"max_request_size": 2048}
    )
    with DaemonThread(dsn, {"kafka.publish": deliverer}):
        wait_for(
            lambda: all(e.terminal for e in effects(ob)) and len(effects(ob)) == len(payloads),
            message="every effect terminal",
        )
    by_name = dict(zip(payloads, effects(ob), strict=True))  # effects come in intent order
    assert by_name["ok"].status.value == "succeeded"
    expected = {
        "run-id": "header 'run-id' is reserved",
        "elsewhere": "is not in allowed_topics",
        "both": "not both",
        "neither": "set exactly one of value (JSON) or value_b64",
        "bad-topic": "not a Kafka topic name",
        "too-large": "MessageSizeTooLargeError",
    }
    for name, reason in expected.items():
        effect = by_name[name]
        assert effect.status.value == "failed", name
        assert effect.last_error is not None and reason in effect.last_error, (name, effect)
        assert effect.attempt == 1, f"{name}: a refusal is not retried"
    # Nothing but the good record reached the topic.
    assert [json.loads(r.value) for r in read_topic(kafka_broker, topic, 1)] == [{"fine": True}]


def test_an_unacknowledged_record_is_unknown_when_consumers_do_not_dedup(
    ob: Outbox, dsn: str, kafka_broker: Any
) -> None:
    """Default ``idempotent = false``: a send whose ack never came is not resent blindly.

    (With ``read_back``, the default, the reconciler then reads the partition back:
    ``test_kafka_read_back``; here it is off, so the effect waits for an operator.)
    """
    topic = unique_topic("ledger")
    kafka_broker.create_topic(topic, 1)
    deliverer = deliverer_for(kafka_broker, read_back=False, **FAST)
    assert deliverer.idempotent is False
    intend(ob, [{"topic": topic, "value": "warm-up"}], step="warm-up")
    with DaemonThread(dsn, {"kafka.publish": deliverer}, **FAST_RETRIES):
        wait_for(lambda: all_status(ob, "succeeded", 1), message="producer connected")
        kafka_broker.pause()
        try:
            intend(ob, [{"topic": topic, "value": "in-doubt"}], step="in-doubt")
            try:
                wait_for(
                    lambda: sorted(e.status.value for e in effects(ob)) == ["succeeded", "unknown"],
                    message="the unacknowledged effect is unknown",
                )
            except AssertionError as timed_out:
                # CI timed out here once (not reproduced): say where each effect stood
                seen = [(e.status.value, e.attempt, e.last_error) for e in effects(ob)]
                raise AssertionError(f"{timed_out}; the effects: {seen}") from None
        finally:
            kafka_broker.resume()
    doubtful = next(e for e in effects(ob) if e.status.value == "unknown")
    assert doubtful.attempt == 1
    assert doubtful.last_error is not None and "may have been written" in doubtful.last_error


# -- outages -----------------------------------------------------------------------------


def test_broker_paused_mid_publish_every_key_reaches_the_consumer_once(
    ob: Outbox, dsn: str, kafka_broker: Any
) -> None:
    """Consumers dedup (``idempotent = true``): ambiguous sends are retried, copies skipped."""
    topic = unique_topic("stream")
    kafka_broker.create_topic(topic, 3)
    total = 50
    deliverer = deliverer_for(kafka_broker, idempotent=True, **FAST)
    writer_error: list[BaseException] = []

    def writer() -> None:
        try:
            for i in range(total):
                intend(ob, [{"topic": topic, "key": f"k{i % 7}", "value": {"i": i}}], f"s{i}")
                time.sleep(0.04)  # a steady stream of intents across the outage
        except BaseException as exc:
            writer_error.append(exc)

    def retried() -> bool:
        return any(e.attempt >= 2 for e in effects(ob))

    with DaemonThread(dsn, {"kafka.publish": deliverer}, **FAST_RETRIES):
        thread = threading.Thread(target=writer)
        thread.start()
        try:
            wait_for(
                lambda: sum(e.status.value == "succeeded" for e in effects(ob)) >= 10,
                message="publishing under way",
            )
            kafka_broker.pause()
            paused = time.monotonic()
            try:
                wait_for(
                    lambda: time.monotonic() - paused > 3 and retried(),
                    message="deliveries failing while the broker is frozen",
                )
            finally:
                kafka_broker.resume()
        finally:
            thread.join(60)
        assert not writer_error, writer_error
        wait_for(lambda: all_status(ob, "succeeded", total), timeout=90, message="all succeeded")

    published = effects(ob)
    keys = {e.idempotency_key for e in published}
    assert len(keys) == total
    # Each succeeded effect holds the broker's acknowledgement: its partition and offset.
    # The broker's word is not ours to keep: a thawed Tansu has acknowledged two
    # records at one offset (and kept both, or one), and records at offsets past
    # where a partition then ended for good (48 records for 50 distinct offsets in
    # CI). A record whose acknowledgement is ambiguous so may be missing; every other
    # must be in the topic, and every record there must reach the consumer once.
    acked = Counter((e.result["partition"], e.result["offset"]) for e in published)
    distinct = len(acked)
    lost: set[tuple[int, int]] = set()
    try:
        # Under CI load one first read came back one short (49 of 50): read again.
        in_topic = wait_for(
            lambda: (n := end_offsets(kafka_broker, topic)) >= distinct and n,
            timeout=15,
            message=f"the topic's end offsets to cover the {distinct} acknowledged offsets",
        )
    except AssertionError:
        ends = partition_end_offsets(kafka_broker, topic)
        lost = {(part, offset) for part, offset in acked if offset >= ends.get(part, 0)}
        in_topic = sum(ends.values())
    ambiguous = {
        e.idempotency_key
        for e in published
        if acked[pair := (e.result["partition"], e.result["offset"])] > 1 or pair in lost
    }
    held = {
        header_map(r)["idempotency-key"].decode() for r in read_topic(kafka_broker, topic, in_topic)
    }
    assert keys - held <= ambiguous, "every record acknowledged at an offset of its own is kept"

    table = "pause_seen"
    create_scratch_table(ob, table)
    group = "pause-consumer"
    with consumer_for(kafka_broker, topic, group_id=group) as consumer:
        stats = drain(DedupConsumer(consumer, ob.engine, group), recorder(table), in_topic)
    handled = [key for key, _ in rows(ob, table)]
    assert len(handled) == len(set(handled)), "each key handled once"
    assert set(handled) == held, "every key the topic holds handled, and no other"
    assert stats.processed == len(held) and stats.unkeyed == 0
    # Every record polled was handled once or skipped as a copy (the copies come from sends
    # the frozen broker wrote although their acknowledgement never arrived).
    assert stats.polled >= in_topic
    assert stats.duplicates == stats.polled - len(held), (stats, in_topic)
    assert stats.committed
    assert marked(ob, group) == set(handled)


def test_broker_restart_effects_intended_while_it_is_down_are_delivered_after(
    ob: Outbox, dsn: str, kafka_broker: Any
) -> None:
    """Tansu keeps data in memory only: a restarted broker comes back EMPTY.

    So this checks that publishing recovers after a restart (the producer's
    state on the broker is gone, the producer is replaced) and that effects
    intended while the broker is down are retried and delivered once it is
    back; it does not (cannot) check that records written before survive.
    """
    topic = unique_topic("restart")
    kafka_broker.create_topic(topic, 2)
    deliverer = deliverer_for(kafka_broker, idempotent=True, **FAST)
    with DaemonThread(dsn, {"kafka.publish": deliverer}, **FAST_RETRIES):
        intend(ob, [{"topic": topic, "value": f"before-{i}"} for i in range(5)], "before")
        wait_for(lambda: all_status(ob, "succeeded", 5), message="published before the restart")

        # 1. Restart under a connected producer: the broker forgot its producer id.
        kafka_broker.restart()
        intend(ob, [{"topic": topic, "value": f"restarted-{i}"} for i in range(5)], "restarted")
        wait_for(
            lambda: all_status(ob, "succeeded", 10),
            timeout=60,
            message="published after the restart",
        )

        # 2. Down for a while: intents are retried until the broker is back.
        kafka_broker.stop()
        intend(ob, [{"topic": topic, "value": f"down-{i}"} for i in range(5)], "down")

        def down_effects() -> list[Effect]:
            return [e for e in effects(ob) if e.payload["value"].startswith("down-")]

        wait_for(
            lambda: len(down_effects()) == 5 and all(e.attempt >= 2 for e in down_effects()),
            timeout=60,
            message="every intent failed at least once while the broker was down",
        )
        kafka_broker.start()
        wait_for(lambda: all_status(ob, "succeeded", 15), timeout=60, message="delivered once back")

    for effect in down_effects():
        attempts = [a.outcome for a in ob.store.attempts(effect.id)]
        assert attempts[-1] == "succeeded" and "retry" in attempts, attempts
    # Only what was written since the broker came back is there (memory storage).
    values = {json.loads(r.value) for r in read_topic(kafka_broker, topic, 5)}
    assert {f"down-{i}" for i in range(5)} <= values


# -- the consumer side -------------------------------------------------------------------


def test_dedup_consumer_handles_each_key_once_and_atomically(ob: Outbox, kafka_broker: Any) -> None:
    topic = unique_topic("dedup")
    kafka_broker.create_topic(topic, 1)
    sent = [("k1", "a"), ("k2", "b"), ("k1", "a-again"), ("k3", "boom"), ("k4", "d"), (None, "e")]
    producer = KafkaProducer(bootstrap_servers=kafka_broker.bootstrap)
    try:
        for key, value in sent:
            headers = [] if key is None else [("idempotency-key", key.encode())]
            producer.send(topic, value=value.encode(), headers=headers)
        producer.flush(10)
    finally:
        producer.close(10)

    table = "dedup_seen"
    create_scratch_table(ob, table)
    record_row = recorder(table)
    failing = {"boom"}

    def handle(record: Any, connection: Connection) -> None:
        record_row(record, connection)  # written first: must roll back with the failure
        if record.value.decode() in failing:
            raise RuntimeError("the consumer cannot process this one yet")

    group = "billing"
    with consumer_for(kafka_broker, topic, group_id=group) as consumer:
        dedup = DedupConsumer(consumer, ob.engine, group)

        def until_failure() -> bool:
            try:
                dedup.process(handle, timeout_ms=200)
            except RuntimeError:
                return True
            return False

        wait_for(until_failure, message="the failing record")
        # Before the failure: k1 once (its copy skipped), k2; nothing of k3.
        assert rows(ob, table) == [("k1", "a"), ("k2", "b")]
        assert marked(ob, group) == {"k1", "k2"}
        assert consumer.committed(TopicPartition(topic, 0)) is None, "no offset committed yet"

        failing.clear()
        stats = drain(dedup, handle, 3)  # k3 again (rewound to it), k4, the unkeyed record
        assert rows(ob, table) == [
            ("k1", "a"),
            ("k2", "b"),
            ("k3", "boom"),
            ("k4", "d"),
            (None, "e"),
        ]
        assert (stats.processed, stats.duplicates, stats.unkeyed) == (3, 0, 1)
        assert marked(ob, group) == {"k1", "k2", "k3", "k4"}
        assert consumer.committed(TopicPartition(topic, 0)) == len(sent)

    # The whole topic delivered again (as after a crash before the offset commit):
    # every keyed record is skipped; only the unkeyed one is processed again.
    with consumer_for(kafka_broker, topic, group_id="billing-replay") as consumer:
        stats = drain(DedupConsumer(consumer, ob.engine, group), handle, len(sent))
    assert (stats.processed, stats.duplicates, stats.unkeyed) == (1, 5, 1)
    with ob.engine.connect() as conn:
        counted = conn.execute(
            text(f"SELECT key, count(*) FROM {table} GROUP BY key ORDER BY 1")
        ).all()
    assert [tuple(r) for r in counted] == [("k1", 1), ("k2", 1), ("k3", 1), ("k4", 1), (None, 2)]
    with ob.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(consumed_keys)).scalar() == 4


def test_dedup_consumer_refuses_auto_commit(ob: Outbox, kafka_broker: Any) -> None:
    with (
        consumer_for(kafka_broker, group_id="g", enable_auto_commit=True) as consumer,
        pytest.raises(ValueError, match="enable_auto_commit=False"),
    ):
        DedupConsumer(consumer, ob.engine, "g")
