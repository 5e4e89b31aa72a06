"""``outbox check`` with the real deliverers config: a transactional ``kafka.publish``.

Its deliverer reaches the crash points a recording sink never does: ``after_note``
(where the attempt will land is noted, before the send) and ``after_send`` (the
record acknowledged inside the open Kafka transaction, before its commit). The
check kills the deliverer at each; every intent of every trial is then in the
topic's committed view exactly once.
"""

from __future__ import annotations

import collections
import uuid
from pathlib import Path
from typing import Any

import pytest

from outbox.check.plugin import OutboxCheck
from tests.chaos import broken_agents
from tests.chaos.test_kafka_exactly_once import committed_keys, uncommitted_keys

pytestmark = [pytest.mark.kafka, pytest.mark.slow, pytest.mark.chaos]

CONFIG = """
[kinds."kafka.publish"]
bootstrap_servers = "{bootstrap}"
max_block_ms = 3000
request_timeout_ms = 3000
transactional = true
instance = "check"
"""


def test_the_check_kills_a_transactional_publish_after_its_note_and_its_send(
    outbox_check: OutboxCheck, tmp_path: Path, kafka_broker: Any
) -> None:
    topic = f"ledger-{uuid.uuid4().hex[:8]}"
    kafka_broker.create_topic(topic, 1)
    config = tmp_path / "deliverers.toml"
    config.write_text(CONFIG.format(bootstrap=kafka_broker.bootstrap))
    report = outbox_check(
        broken_agents.publishes_a_ledger,
        inputs={"topic": topic},
        sink="real",
        config=config,
        only=["after_note", "after_send", "after_call"],
        # one deliverer at a time: they share the config's transactional id
        jobs=1,
    )
    assert report.ok
    rows = {(r.point, r.where): r for r in report.rows()}
    for point in ("after_note", "after_send", "after_call"):
        assert rows[(point, "first time")].outcome == "ok", rows[(point, "first time")]
    committed = committed_keys(kafka_broker.bootstrap, topic)
    # the uninterrupted run and the three trials: three entries each, each read once
    assert len(committed) >= 12 and set(committed.values()) == {1}, committed
    # the killed transactions' records are in the log, aborted (so a duplicate would show)
    everything = uncommitted_keys(kafka_broker.bootstrap, topic)
    assert sum(everything.values()) > sum(committed.values())
    assert collections.Counter(set(everything)) == collections.Counter(set(committed))
