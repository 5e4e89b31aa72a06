"""Read-back before retry: a non-idempotent effect whose deliverer was ``kill -9``ed mid-call
is settled by asking the sink, never by an operator and never by a blind resend.

For ``http.request`` the deliverer is killed while the sink holds the request: after
applying it (found -> succeeded, sent once) or without applying it (not found ->
retried, applied once). For ``kafka.publish`` it is killed after the broker
acknowledged the record (found -> succeeded, one record in the topic) or after it
noted the partition's offset but before sending (not found -> retried, one record).
"""

from __future__ import annotations

import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deliverers.testing import Fault, IdempotentHttpSink
from outbox import EffectStatus, Outbox
from outbox.check.processes import start_deliverer
from tests.support import wait_for

HTTP_CONFIG = """
[kinds."http.blind"]
type = "http.request"
idempotent = false
allow_private = ["127.0.0.1"]
lookup_url = "{sink}/idempotency/{{key}}"
"""

KAFKA_CONFIG = """
[kinds."kafka.publish"]
bootstrap_servers = "{bootstrap}"
max_block_ms = 3000
request_timeout_ms = 3000
"""


def one_intent(ob: Outbox, kind: str, payload: dict[str, Any]) -> Any:
    run = ob.start_run("agent", "1")
    effect_id = run.transaction("s", lambda tx: str(tx.intend(kind, payload).id))
    return ob.effect(effect_id)


def killed(proc: subprocess.Popen[bytes], log: Path) -> None:
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL, log.read_text()


def recover(ob: Outbox, env: dict[str, str], config: Path, log: Path, effect_id: Any) -> None:
    survivor = start_deliverer(env, config, log, "--reconcile-every", "0.2")
    try:
        wait_for(
            lambda: ob.effect(effect_id).status == EffectStatus.SUCCEEDED,
            timeout=60,
            message="settled by read-back",
        )
    finally:
        survivor.send_signal(signal.SIGTERM)
        assert survivor.wait(timeout=60) == 0, log.read_text()


def lookups(ob: Outbox, effect_id: Any) -> list[Any]:
    return [a.detail for a in ob.store.attempts(effect_id) if a.outcome == "looked_up"]


@pytest.fixture
def sink() -> Iterator[IdempotentHttpSink]:
    with IdempotentHttpSink() as running:
        yield running


@pytest.mark.parametrize("applied", [True, False], ids=["found", "not-found"])
def test_http_request_killed_mid_call_is_settled_by_lookup(
    ob: Outbox, sub_env: dict[str, str], tmp_path: Path, sink: IdempotentHttpSink, applied: bool
) -> None:
    config = tmp_path / "deliverers.toml"
    config.write_text(HTTP_CONFIG.format(sink=sink.url))
    sink.inject(Fault("hang_after_apply" if applied else "drop", times=1, hang_seconds=20))
    effect = one_intent(ob, "http.blind", {"url": f"{sink.url}/pay", "json": {"operation": "p1"}})
    key = effect.idempotency_key
    doomed = start_deliverer(sub_env, config, tmp_path / "doomed.log")
    wait_for(lambda: sink.state.received[key] == 1, timeout=30, message="the request was sent")
    if applied:
        wait_for(lambda: key in sink.state.applied, timeout=30, message="the sink applied it")
    killed(doomed, tmp_path / "doomed.log")
    assert ob.effect(effect.id).status == EffectStatus.IN_FLIGHT

    recover(ob, sub_env, config, tmp_path / "survivor.log", effect.id)
    settled = ob.effect(effect.id)
    assert lookups(ob, effect.id) == [
        {"lookup": "applied" if applied else "not_applied", "asked": "before any resend"}
    ]
    assert sink.state.applied_count[key] == 1, "applied exactly once"
    assert sink.state.received[key] == (1 if applied else 2), "resent only when not found"
    if applied:
        assert settled.result["looked_up"] is True
    assert "unknown" not in [a.outcome for a in ob.store.attempts(effect.id)], "no operator"


def records_with_key(bootstrap: str, topic: str, key: str) -> list[int]:
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False)
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        end = consumer.end_offsets([tp])[tp]
        consumer.seek_to_beginning(tp)
        found: list[int] = []
        while consumer.position(tp) < end:
            for record in consumer.poll(timeout_ms=1000).get(tp, []):
                if ("idempotency-key", key.encode()) in list(record.headers or []):
                    found.append(record.offset)
        return found
    finally:
        consumer.close()


@pytest.mark.kafka
@pytest.mark.parametrize(
    ("crash_at", "applied"),
    [("after_call", True), ("after_note", False)],
    ids=["found", "not-found"],
)
def test_kafka_publish_killed_mid_call_is_settled_by_reading_the_partition_back(
    ob: Outbox,
    sub_env: dict[str, str],
    tmp_path: Path,
    kafka_broker: Any,
    crash_at: str,
    applied: bool,
) -> None:
    topic = f"ledger-{uuid.uuid4().hex[:8]}"
    kafka_broker.create_topic(topic, 1)
    config = tmp_path / "deliverers.toml"
    config.write_text(KAFKA_CONFIG.format(bootstrap=kafka_broker.bootstrap))
    # Another record first, so that the noted offset is not the start of the log.
    one_intent(ob, "kafka.publish", {"topic": topic, "value": "earlier"})
    warm = start_deliverer(sub_env, config, tmp_path / "warm.log")
    wait_for(lambda: all(e.status == "succeeded" for e in ob.effects()), timeout=60)
    warm.send_signal(signal.SIGTERM)
    assert warm.wait(timeout=60) == 0

    effect = one_intent(ob, "kafka.publish", {"topic": topic, "value": {"amount": 7}})
    doomed = start_deliverer(sub_env, config, tmp_path / "doomed.log", crash_at=crash_at)
    assert doomed.wait(timeout=60) == -signal.SIGKILL, (tmp_path / "doomed.log").read_text()
    assert ob.effect(effect.id).status == EffectStatus.IN_FLIGHT
    before = records_with_key(kafka_broker.bootstrap, topic, effect.idempotency_key)
    assert len(before) == (1 if applied else 0)

    recover(ob, sub_env, config, tmp_path / "survivor.log", effect.id)
    after = records_with_key(kafka_broker.bootstrap, topic, effect.idempotency_key)
    assert len(after) == 1, "exactly one record with the key"
    assert lookups(ob, effect.id) == [
        {"lookup": "applied" if applied else "not_applied", "asked": "before any resend"}
    ]
    settled = ob.effect(effect.id)
    assert settled.result["offset"] == after[0]
    if applied:
        assert settled.result["looked_up"] is True
