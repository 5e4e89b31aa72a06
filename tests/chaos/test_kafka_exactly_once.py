"""Transactional ``kafka.publish``: a deliverer ``kill -9``ed at each point of the protocol,
then resumed by ANOTHER deliverer (another transactional id), leaves every intent
committed in the topic exactly once.

The committed view is read from the log with its transaction markers
(``deliverers.kafka_txn.committed_records``), which is what a ``read_committed``
consumer of a broker that reports aborted transactions sees. Tansu 0.6 writes
the markers but reports no aborted transactions, so kafka-python's own
``read_committed`` consumer there shows aborted records too; the plain
``read_uncommitted`` consumer below proves the test can see such a duplicate at
all (the killed transaction's record stays in the log, aborted).
"""

from __future__ import annotations

import collections
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from kafka import KafkaConsumer, TopicPartition

from deliverers.kafka_txn import committed_records, scan_partition
from outbox import EffectStatus, Outbox
from outbox.check.processes import start_deliverer
from tests.support import wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.chaos]

CONFIG = """
[kinds."kafka.publish"]
bootstrap_servers = "{bootstrap}"
max_block_ms = 3000
request_timeout_ms = 3000
transactional = true
instance = "{instance}"
"""
INTENTS = 6


def keys_seen(items: list[Any]) -> collections.Counter[str]:
    seen: collections.Counter[str] = collections.Counter()
    for record in items:
        for name, value in record.headers:
            if name == "idempotency-key":
                seen[value.decode()] += 1
    return seen


def uncommitted_keys(bootstrap: str, topic: str) -> collections.Counter[str]:
    """Every data record in the log, committed or not, by a plain read_uncommitted consumer."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False)
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        end = consumer.end_offsets([tp])[tp]
        consumer.seek_to_beginning(tp)
        records: list[Any] = []
        while consumer.position(tp) < end:
            records.extend(consumer.poll(timeout_ms=1000).get(tp, []))
        return keys_seen(records)
    finally:
        consumer.close()


def committed_keys(bootstrap: str, topic: str) -> collections.Counter[str]:
    tp = TopicPartition(topic, 0)
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None)
    try:
        end = consumer.end_offsets([tp])[tp]
    finally:
        consumer.close()
    visible, open_left = committed_records(scan_partition(bootstrap, tp, 0, end))
    assert not open_left, "no transaction is left open"
    return keys_seen(visible)


@pytest.mark.parametrize(
    "crash_at",
    ["after_note", "after_send", "after_call", "after_completion"],
    ids=["before-send", "sent-not-committed", "committed-not-recorded", "recorded"],
)
def test_transactional_publish_survives_kill_at_each_point_exactly_once(
    ob: Outbox, sub_env: dict[str, str], tmp_path: Path, kafka_broker: Any, crash_at: str
) -> None:
    topic = f"ledger-{uuid.uuid4().hex[:8]}"
    kafka_broker.create_topic(topic, 1)
    configs = {}
    for instance in ("doomed", "survivor"):
        configs[instance] = tmp_path / f"{instance}.toml"
        configs[instance].write_text(
            CONFIG.format(bootstrap=kafka_broker.bootstrap, instance=instance)
        )
    run = ob.start_run("agent", "1")
    ids = run.transaction(
        "s",
        lambda tx: [
            str(tx.intend("kafka.publish", {"topic": topic, "value": {"n": n}}).id)
            for n in range(INTENTS)
        ],
    )
    keys = {ob.effect(i).idempotency_key for i in ids}

    doomed_log = tmp_path / "doomed.log"
    if crash_at == "after_completion":
        doomed = start_deliverer(sub_env, configs["doomed"], doomed_log)
        wait_for(
            lambda: all(ob.effect(i).status == EffectStatus.SUCCEEDED for i in ids),
            timeout=60,
            message="delivered before the kill",
        )
        doomed.send_signal(signal.SIGKILL)
        assert doomed.wait(timeout=30) == -signal.SIGKILL
    else:
        doomed = start_deliverer(sub_env, configs["doomed"], doomed_log, crash_at=crash_at)
        assert doomed.wait(timeout=60) == -signal.SIGKILL, doomed_log.read_text()
        assert any(ob.effect(i).status == EffectStatus.IN_FLIGHT for i in ids)

    survivor_log = tmp_path / "survivor.log"
    survivor = start_deliverer(
        sub_env, configs["survivor"], survivor_log, "--reconcile-every", "0.2"
    )
    try:
        wait_for(
            lambda: "delivering kinds" in survivor_log.read_text(),
            timeout=60,
            message="the survivor is up",
        )
        wait_for(
            lambda: all(ob.effect(i).status == EffectStatus.SUCCEEDED for i in ids),
            timeout=90,
            message="every intent settled by the survivor",
        )
        # A few lease lengths and reconcile rounds: time enough to resend wrongly.
        time.sleep(3)
    finally:
        survivor.send_signal(signal.SIGTERM)
        assert survivor.wait(timeout=60) == 0, survivor_log.read_text()

    committed = committed_keys(kafka_broker.bootstrap, topic)
    assert committed == collections.Counter(dict.fromkeys(keys, 1)), "each intent once, committed"
    for effect_id in ids:
        effect = ob.effect(effect_id)
        assert "unknown" not in [a.outcome for a in ob.store.attempts(effect.id)], "no operator"
    everything = uncommitted_keys(kafka_broker.bootstrap, topic)
    if crash_at == "after_send":
        # The killed transaction's record is in the log, aborted: a read_uncommitted
        # consumer sees that intent twice, so the committed view above could have too.
        assert max(everything.values()) == 2, everything
    elif crash_at == "after_completion":
        assert everything == committed, "nothing was sent twice"
    else:
        # Another thread's transaction may have been open at the kill: aborted copies
        # may sit in the log, but no record outside the intents.
        assert set(everything) == keys
