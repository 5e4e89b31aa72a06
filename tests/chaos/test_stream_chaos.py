"""Stream mode under faults: real `outbox relay` and `outbox deliver --from-kafka` processes.

Each test runs the processes against a Tansu broker and a real HTTP sink and
hurts them: a stream deliverer killed with SIGKILL while copies of records
(dispatches expired and published again) are in the topic; a consumer group
rebalancing while batches are in flight (a deliverer joining, another
leaving); relays killed with SIGKILL right after publishing, several relays
at once, and between claiming a batch and publishing it. Expected: no
committed offset passes the record an effect was claimed through while its
outcome is not recorded; every effect is delivered, none skipped; an
idempotent sink applies each key once and a sink that cannot dedup is never
called twice for one effect.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kafka import KafkaConsumer, TopicPartition

from deliverers.testing import TANSU_CONSUMER_TUNING, IdempotentHttpSink, TansuBroker
from outbox import Outbox, StepTransaction
from tests.support import wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.chaos, pytest.mark.slow]

TOPIC = "outbox.http.request"
GROUP = "chaos"
PARTITIONS = 3
RECORD = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ [A-Z]+ (?P<logger>[\w.]+): ")


class Procs:
    """The test's processes, each logging to its own file; all stopped at the end."""

    def __init__(self, env: dict[str, str], tmp_path: Path, broker: TansuBroker, config: Path):
        self.env = env
        self.tmp_path = tmp_path
        self.broker = broker
        self.config = config
        self.running: list[subprocess.Popen[bytes]] = []

    def spawn(self, name: str, *args: str, crash_at: str | None = None) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in self.env.items() if k != "OUTBOX_TEST_CRASH_AT"}
        if crash_at:
            env["OUTBOX_TEST_CRASH_AT"] = crash_at
        with (self.tmp_path / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "outbox", *args, "--config", str(self.config)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.running.append(proc)
        return proc

    def relay(self, name: str, *extra: str, crash_at: str | None = None) -> subprocess.Popen[bytes]:
        return self.spawn(
            name, "relay", "--kafka", self.broker.bootstrap, *extra, crash_at=crash_at
        )

    def deliverer(self, name: str, *extra: str) -> subprocess.Popen[bytes]:
        tuning = [
            a for k, v in TANSU_CONSUMER_TUNING.items() for a in ("--kafka-option", f"{k}={v}")
        ]
        return self.spawn(
            name,
            "deliver",
            "--from-kafka",
            self.broker.bootstrap,
            "--group",
            GROUP,
            "--lease",
            "2",
            *tuning,
            *extra,
        )

    def logs(self) -> str:
        return "\n".join(
            f"--- {log.name}\n" + "\n".join(log.read_text().splitlines()[-30:])
            for log in sorted(self.tmp_path.glob("*.log"))
        )

    def our_tracebacks(self) -> list[str]:
        """Tracebacks logged by anything but the Kafka client's own I/O loop.

        kafka-python 3.0 logs one from its transport when a socket closes under a
        read at shutdown (``'NoneType' object has no attribute 'recv'``); that is
        the library's race, not ours. A traceback belongs to the record above it.
        """
        found: list[str] = []
        for log in sorted(self.tmp_path.glob("*.log")):
            logger = ""
            for line in log.read_text().splitlines():
                record = RECORD.match(line)
                if record:
                    logger = record["logger"]
                elif line.startswith("Traceback") and not logger.startswith("kafka."):
                    found.append(f"{log.name}: after a record of {logger or 'no logger'}")
        return found

    def stop_all(self) -> None:
        for proc in self.running:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.running:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def make_config(tmp_path: Path, *, idempotent: bool = True) -> Path:
    path = tmp_path / "deliverers.toml"
    lines = ['[kinds."http.request"]', 'allow_private = ["127.0.0.1"]']
    if not idempotent:
        lines.append("idempotent = false")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def broker(kafka_broker: TansuBroker) -> Iterator[TansuBroker]:
    kafka_broker.create_topic(TOPIC, partitions=PARTITIONS)
    yield kafka_broker


def intend(ob: Outbox, url: str, runs: int, per_run: int) -> int:
    """``runs`` runs (records are keyed by run: they spread over the partitions)."""
    for r in range(runs):
        run = ob.start_run("agent", "1")

        def step(tx: StepTransaction, r: int = r) -> None:
            for i in range(per_run):
                tx.intend("http.request", {"url": url, "json": {"operation": f"op-{r}-{i}"}})

        run.transaction("s", step)
    return runs * per_run


def statuses(ob: Outbox) -> dict[str, int]:
    counts: dict[str, int] = {}
    for e in ob.effects(limit=100_000):
        counts[e.status.value] = counts.get(e.status.value, 0) + 1
    return counts


def settled(ob: Outbox, n: int, procs: Procs, timeout: float) -> None:
    try:
        wait_for(lambda: statuses(ob) == {"succeeded": n}, timeout=timeout, message="delivery")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; statuses {statuses(ob)}\n{procs.logs()}") from None


def assert_sent_once(stats: dict[str, Any], n: int) -> None:
    """A sink that cannot dedup saw each of the ``n`` effects once, and no call twice."""
    assert stats["redeliveries"] == 0, "no effect was sent twice"
    assert stats["duplicate_keys_applied"] == [] and stats["keys_applied"] == n


def committed(broker: TansuBroker) -> dict[int, int]:
    reader = KafkaConsumer(
        bootstrap_servers=broker.bootstrap, group_id=GROUP, enable_auto_commit=False
    )
    try:
        found = {p: reader.committed(TopicPartition(TOPIC, p)) for p in range(PARTITIONS)}
    finally:
        reader.close()
    return {p: offset for p, offset in found.items() if offset is not None}


def records(broker: TansuBroker) -> dict[str, list[tuple[int, int]]]:
    """Every record in the topic: effect id -> [(partition, offset)]."""
    reader = KafkaConsumer(bootstrap_servers=broker.bootstrap, enable_auto_commit=False)
    try:
        parts = [TopicPartition(TOPIC, p) for p in range(PARTITIONS)]
        reader.assign(parts)
        reader.seek_to_beginning(*parts)
        ends = reader.end_offsets(parts)
        found: dict[str, list[tuple[int, int]]] = {}
        deadline = time.monotonic() + 30
        while any(reader.position(tp) < ends[tp] for tp in parts):
            assert time.monotonic() < deadline, "could not read the topic back"
            for tp, batch in reader.poll(timeout_ms=500).items():
                for record in batch:
                    effect_id = json.loads(record.value)["effect_id"]
                    found.setdefault(effect_id, []).append((tp.partition, record.offset))
        return found
    finally:
        reader.close()


def in_flight_under_deliverers(ob: Outbox) -> set[str]:
    with ob.engine.connect() as conn:
        rows = conn.exec_driver_sql(
            "SELECT id FROM outbox_effects WHERE status = 'in_flight'"
            " AND lease_owner NOT LIKE 'relay:%%'"
        ).all()
    return {str(row[0]) for row in rows}


def topic_size(broker: TansuBroker) -> int:
    reader = KafkaConsumer(bootstrap_servers=broker.bootstrap)
    try:
        ends = reader.end_offsets([TopicPartition(TOPIC, p) for p in range(PARTITIONS)])
        return sum(ends.values())
    finally:
        reader.close()


def test_sigkill_of_a_stream_deliverer_with_copies_in_the_topic(
    ob: Outbox, sub_env: dict[str, str], tmp_path: Path, broker: TansuBroker
) -> None:
    """Kill -9 after commits, with copies of every record in the topic.

    The relay publishes every effect, and publishes it again each second
    nobody delivers it (``--dispatch-ttl 1``); the deliverer starts once the
    topic holds two copies of each, so it reads copies of effects it is still
    delivering. At the kill, no effect the dead deliverer holds has had every
    record of it committed past (its claim's record waits for its outcome).
    Then a second deliverer delivers everything: none skipped, each key
    applied once.
    """
    procs = Procs(sub_env, tmp_path, broker, make_config(tmp_path))
    with IdempotentHttpSink(latency=1.0) as sink:
        n = intend(ob, f"{sink.url}/ledger", runs=6, per_run=10)
        try:
            procs.relay("relay", "--dispatch-ttl", "1")
            wait_for(lambda: topic_size(broker) >= 2 * n, timeout=60, message="copies")
            doomed = procs.deliverer("doomed", "--concurrency", "10")
            wait_for(
                lambda: statuses(ob).get("succeeded", 0) >= 20 and sum(committed(broker).values()),
                timeout=120,
                message="commits after some deliveries",
            )
            doomed.send_signal(signal.SIGKILL)
            doomed.wait(10)
            offsets = committed(broker)
            held = in_flight_under_deliverers(ob)
            copies = records(broker)
            for effect_id in held:
                partition = copies[effect_id][0][0]
                newest = max(offset for _, offset in copies[effect_id])
                assert newest >= offsets.get(partition, 0), (
                    f"effect {effect_id} is in flight under the dead deliverer, yet every "
                    f"record of it {copies[effect_id]} is below the committed {offsets}"
                )
            procs.deliverer("survivor", "--concurrency", "10")
            settled(ob, n, procs, timeout=180)
        finally:
            procs.stop_all()
        stats = sink.stats()
    assert stats["keys_applied"] == n and stats["duplicate_keys_applied"] == []
    assert stats["duplicate_operations"] == []


def test_a_rebalance_while_batches_are_in_flight_calls_no_sink_twice(
    ob: Outbox, sub_env: dict[str, str], tmp_path: Path, broker: TansuBroker
) -> None:
    """A second deliverer joins mid-stream, then the first leaves (SIGTERM) mid-stream.

    The sink does not dedup and the kind is declared not idempotent: a record
    read again by the partition's new owner must find its effect claimed or
    finished. Every effect is applied exactly once; none is left behind.
    """
    procs = Procs(sub_env, tmp_path, broker, make_config(tmp_path, idempotent=False))
    with IdempotentHttpSink(latency=0.2, honour_keys=False) as sink:
        n = intend(ob, f"{sink.url}/ledger", runs=6, per_run=10)
        try:
            procs.relay("relay")
            first = procs.deliverer("first", "--concurrency", "4")
            wait_for(lambda: statuses(ob).get("succeeded", 0) >= 10, timeout=120)
            procs.deliverer("second", "--concurrency", "4")
            wait_for(lambda: statuses(ob).get("succeeded", 0) >= 30, timeout=120)
            # Leave once the second's join has completed (it holds partitions): Tansu
            # 0.6 never finishes a rebalance whose leader leaves between JoinGroup and
            # SyncGroup (the survivor rejoins generation 2 forever), which a Kafka
            # broker settles by the session timeout. The first still leaves mid-stream.
            second_log = tmp_path / "second.log"
            wait_for(
                lambda: "Updated partition assignment: [TopicPartition" in second_log.read_text(),
                timeout=120,
                message="the second deliverer holds partitions",
            )
            first.send_signal(signal.SIGTERM)
            assert first.wait(60) == 0
            settled(ob, n, procs, timeout=180)
        finally:
            procs.stop_all()
        stats = sink.stats()
    assert_sent_once(stats, n)
    assert procs.our_tracebacks() == [], procs.logs()


def test_relays_killed_right_after_publishing_with_others_running(
    ob: Outbox, sub_env: dict[str, str], tmp_path: Path, broker: TansuBroker
) -> None:
    """Three relays at once; two die (SIGKILL) after publishing a batch, before going on.

    Their published effects are ``dispatched`` under their names; the stream
    deliverer takes them from the records, the rest are dispatched by the
    living relay. A sink that cannot dedup is called once per effect.
    """
    procs = Procs(sub_env, tmp_path, broker, make_config(tmp_path, idempotent=False))
    with IdempotentHttpSink(honour_keys=False) as sink:
        n = intend(ob, f"{sink.url}/ledger", runs=10, per_run=20)
        try:
            first = procs.relay("doomed-1", "--batch-size", "5", crash_at="after_publish:1")
            later = procs.relay("doomed-2", "--batch-size", "5", crash_at="after_publish:3")
            # The living one starts once the first died: a relay dispatches 200
            # effects in well under a second, and one that found nothing never dies.
            assert first.wait(60) == -signal.SIGKILL
            procs.relay("living", "--batch-size", "5")
            procs.deliverer("stream", "--concurrency", "16")
            settled(ob, n, procs, timeout=180)
        finally:
            procs.stop_all()
        stats = sink.stats()
    assert later.returncode in (0, -signal.SIGKILL)
    assert_sent_once(stats, n)
    for effect in ob.effects(limit=n):
        outcomes = [a.outcome for a in ob.store.attempts(effect.id)]
        assert outcomes.count("succeeded") == 1, outcomes


def test_a_relay_killed_between_its_claim_and_its_publish_loses_nothing(
    ob: Outbox, sub_env: dict[str, str], tmp_path: Path, broker: TansuBroker
) -> None:
    """A relay dies (SIGKILL) with a batch claimed into ``dispatched`` and never published.

    No record of those effects exists. Its session lock went with it: the next
    relay's reconcile round finds it gone and cuts its dispatches to the orphan
    TTL (1 s here; the dispatch TTL, 300 s by default, had most of its time to
    run); then they go back to ``pending`` (logged as ``expired``) and are
    dispatched again. Every effect is delivered once, within a minute.
    """
    procs = Procs(sub_env, tmp_path, broker, make_config(tmp_path, idempotent=False))
    with IdempotentHttpSink(honour_keys=False) as sink:
        n = intend(ob, f"{sink.url}/ledger", runs=4, per_run=10)
        try:
            doomed = procs.relay("doomed", "--batch-size", "7", crash_at="after_dispatch_claim:1")
            assert doomed.wait(60) == -signal.SIGKILL
            assert statuses(ob) == {"dispatched": 7, "pending": n - 7}
            assert topic_size(broker) == 0, "nothing was published"
            stranded = {e.id for e in ob.effects(limit=n) if e.status == "dispatched"}
            procs.deliverer("stream", "--concurrency", "16")
            procs.relay("living", "--batch-size", "7", "--orphan-ttl", "1")
            settled(ob, n, procs, timeout=60)
        finally:
            procs.stop_all()
        stats = sink.stats()
    assert_sent_once(stats, n)
    for effect in ob.effects(limit=n):
        outcomes = [a.outcome for a in ob.store.attempts(effect.id)]
        assert outcomes.count("succeeded") == 1, outcomes
        if effect.id in stranded:  # (others may expire too, while the group settles)
            assert outcomes[0] == "expired", outcomes
    # the attempt chains hold with the expiries in them
    runs = {effect.run_id for effect in ob.effects(limit=n)}
    assert [ob.verify_run(run_id) for run_id in runs if run_id] == [[]] * len(runs)
