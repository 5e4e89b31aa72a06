"""Stream mode is the same delivery daemon as poll mode, fed by a Kafka source.

Each test runs a real relay and a real DeliveryDaemon with a KafkaSource
against a Tansu broker, and checks one behaviour poll mode has and stream mode
once lacked: per-kind concurrency caps, rate-limit pauses, the schema-version
retry delay, lost-lease reports, and the command line's options (metrics,
grace, concurrency) acting with --from-kafka.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update

from deliverers.testing import (
    TANSU_CONSUMER_TUNING,
    IdempotentHttpSink,
    RecordingDeliverer,
    TansuBroker,
)
from outbox import EffectStatus, Outbox, StepTransaction
from outbox.delivery import Deliverer, Delivery, Failed, Outcome, Retry, Succeeded
from outbox.delivery.daemon import DeliveryDaemon
from outbox.delivery.relay import Relay
from outbox.delivery.settings import RelaySettings, StreamSettings
from outbox.delivery.stream import KafkaSource
from outbox.storage.async_store import AsyncStore
from outbox.storage.schema import effects
from tests.support import DaemonThread, wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def stream_daemon(
    dsn: str, broker: TansuBroker, deliverers: dict[str, Deliverer], **fields: Any
) -> DaemonThread:
    """A relay and a stream deliverer on one loop, as `outbox relay` and `deliver --from-kafka`."""
    for kind in deliverers:
        broker.create_topic(f"outbox.{kind}", partitions=2)
    producer = fields.pop("producer", {})
    settings = StreamSettings(
        bootstrap_servers=broker.bootstrap,
        group="drift",
        consumer={**TANSU_CONSUMER_TUNING, **fields.pop("consumer", {})},
        **fields,
    )
    relay_settings = RelaySettings(
        bootstrap_servers=broker.bootstrap, poll_seconds=0.2, producer=producer
    )

    def source(store: AsyncStore) -> KafkaSource:
        return KafkaSource(store, sorted(deliverers), settings)

    def relay(store: AsyncStore) -> list[Relay]:
        return [Relay(store, sorted(deliverers), relay_settings)]

    return DaemonThread(dsn, deliverers, settings=settings, source=source, companions=relay)


def intend(ob: Outbox, kind: str, n: int, step: str = "", **options: Any) -> None:
    run = ob.start_run("agent", "1")
    run.transaction(
        step or f"{kind}-{n}",
        lambda tx: [tx.intend(kind, {"n": i}, **options) for i in range(n)] and None,
    )


def blocking_the_first(release: threading.Event, first: list[int]) -> Callable[[Delivery], Outcome]:
    """An outcome that blocks the first record called until ``release`` (its ``n`` goes
    into ``first``): records of several partitions may come in either order."""

    def outcome(delivery: Delivery) -> Outcome:
        if not first:
            first.append(delivery.payload["n"])
        if delivery.payload["n"] == first[0]:
            release.wait(60)
        return Succeeded()

    return outcome


def all_succeeded(ob: Outbox, n: int) -> Callable[[], bool]:
    def check() -> bool:
        found = ob.effects(limit=10_000)
        return len(found) == n and all(e.status == EffectStatus.SUCCEEDED for e in found)

    return check


def test_stream_mode_honours_a_kinds_concurrency_cap(
    ob: Outbox, dsn: str, kafka_broker: TansuBroker
) -> None:
    intend(ob, "k.limited", 12)
    peak, current = [0], [0]
    lock = threading.Lock()

    def count(delivery: Delivery) -> Outcome:
        with lock:
            current[0] += 1
            peak[0] = max(peak[0], current[0])
        time.sleep(0.05)
        with lock:
            current[0] -= 1
        return Succeeded()

    limited = RecordingDeliverer("k.limited", outcome=count)
    limited.concurrency = 2
    with stream_daemon(dsn, kafka_broker, {"k.limited": limited}, concurrency=32):
        wait_for(all_succeeded(ob, 12), timeout=60, message="delivery")
    assert peak[0] == 2


def test_stream_mode_pauses_a_rate_limited_kind(
    ob: Outbox, dsn: str, kafka_broker: TansuBroker
) -> None:
    intend(ob, "k.slow", 3)
    calls: list[float] = []

    def limited(delivery: Delivery) -> Outcome:
        calls.append(time.monotonic())
        if len(calls) == 1:
            return Retry("HTTP 429", after=1.5, rate_limited=True)
        return Succeeded()

    slow = RecordingDeliverer("k.slow", outcome=limited)
    with stream_daemon(dsn, kafka_broker, {"k.slow": slow}, concurrency=1, retry_base_seconds=0.01):
        wait_for(all_succeeded(ob, 3), timeout=60, message="delivery")
    assert all(t - calls[0] >= 1.5 for t in calls[1:]), "k.slow waited out its pause"


def test_a_relays_producer_options_override_its_defaults(
    ob: Outbox, dsn: str, kafka_broker: TansuBroker
) -> None:
    # linger_ms is one of the relay's own defaults: given again it was a second
    # keyword argument to KafkaProducer, and the relay never started publishing
    intend(ob, "k.tuned", 40)
    recorder = RecordingDeliverer("k.tuned")
    producer = {"linger_ms": 0, "batch_size": 1024}  # a round spans many produce batches
    with stream_daemon(dsn, kafka_broker, {"k.tuned": recorder}, producer=producer):
        wait_for(all_succeeded(ob, 40), timeout=60, message="40 effects delivered")
    assert sorted(d.payload["n"] for d in recorder.deliveries) == list(range(40))


def test_stream_mode_uses_the_schema_retry_setting(
    ob: Outbox, dsn: str, kafka_broker: TansuBroker
) -> None:
    intend(ob, "k.v", 1, schema_version=2)
    recorder = RecordingDeliverer("k.v")
    with stream_daemon(dsn, kafka_broker, {"k.v": recorder}, schema_retry_seconds=123):
        wait_for(lambda: ob.effects()[0].last_error is not None, timeout=60, message="released")
    effect = ob.effects()[0]
    assert effect.status == EffectStatus.PENDING and recorder.deliveries == []
    assert effect.available_at is not None and effect.attempt_started_at is not None
    delay = (effect.available_at - effect.attempt_started_at).total_seconds()
    assert 120 < delay < 130, delay


def test_stream_mode_reports_a_lost_lease(ob: Outbox, dsn: str, kafka_broker: TansuBroker) -> None:
    intend(ob, "k.block", 1)
    release = threading.Event()

    def block(delivery: Delivery) -> Outcome:
        return Succeeded() if release.wait(60) else Failed("not released within 60 s")

    blocked = RecordingDeliverer("k.block", outcome=block)
    with stream_daemon(
        dsn, kafka_broker, {"k.block": blocked}, lease_seconds=0.6, reconcile_seconds=3600
    ) as daemon:
        wait_for(lambda: blocked.deliveries, timeout=60, message="the call started")
        with ob.engine.begin() as conn:  # another process took the attempt over
            conn.execute(update(effects).values(lease_owner="someone-else"))
        assert daemon.daemon is not None
        lost = daemon.daemon.metrics.leases_lost.labels(kind="k.block")
        wait_for(lambda: lost._value.get() >= 1, message="the heartbeat noticed")
        release.set()
        wait_for(lambda: any(a.outcome == "stale" for a in ob.store.attempts(ob.effects()[0].id)))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.2", 0))
        return int(probe.getsockname()[1])


def test_deliver_from_kafka_honours_metrics_port_and_host_concurrency_and_grace(
    ob: Outbox, sub_env: dict[str, str], tmp_path: Path, kafka_broker: TansuBroker
) -> None:
    kafka_broker.create_topic("outbox.http.request", partitions=2)
    config = tmp_path / "deliverers.toml"
    config.write_text('[kinds."http.request"]\nallow_private = ["127.0.0.1"]\n')
    port = _free_port()
    tuning = [a for k, v in TANSU_CONSUMER_TUNING.items() for a in ("--kafka-option", f"{k}={v}")]
    with IdempotentHttpSink(latency=3.0) as sink:
        run = ob.start_run("agent", "1")
        run.transaction(
            "s",
            lambda tx: (
                [
                    tx.intend("http.request", {"url": f"{sink.url}/x", "json": {"n": i}})
                    for i in range(4)
                ]
                and None
            ),
        )
        logs = tmp_path / "procs.log"
        with logs.open("ab") as log:
            common = ["--config", str(config)]
            relay = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "outbox",
                    "relay",
                    "--kafka",
                    kafka_broker.bootstrap,
                    *common,
                ],
                env=sub_env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            stream = subprocess.Popen(
                [
                    sys.executable, "-m", "outbox", "deliver", "--from-kafka",
                    kafka_broker.bootstrap, *common, *tuning,
                    "--concurrency", "1", "--grace", "1", "--metrics-port", str(port),
                    "--metrics-host", "127.0.0.2",
                ],
                env=sub_env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            wait_for(lambda: sink.in_progress > 0, timeout=60, message="a call in flight")
            # Served on --metrics-host (another loopback address than the default).
            body = urllib.request.urlopen(f"http://127.0.0.2:{port}/metrics").read().decode()
            assert "outbox_in_flight 1.0" in body, body
            time.sleep(1.0)
            assert sink.in_progress == 1, "--concurrency 1 allows one call at a time"
            started = time.monotonic()
            stream.send_signal(signal.SIGTERM)
            stream.wait(30)
            # The call takes 3 s; the grace period is 1 s: the daemon leaves it to its lease.
            assert time.monotonic() - started < 2.9, "exited within --grace"
            assert stream.returncode == 0
        finally:
            for proc in (relay, stream):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
    assert "grace period over: abandoning 1 calls" in logs.read_text()


def test_a_broker_frozen_mid_stream_ends_nothing_and_loses_nothing(
    ob: Outbox, dsn: str, kafka_broker: TansuBroker
) -> None:
    """The broker stops (SIGSTOP) for 15 s while both calls are in flight.

    Their outcomes are recorded during the freeze; the commits time out (5 s
    here) and reads come back empty. The daemon goes on, and once the broker
    is back the rest is delivered, each effect once.
    """
    intend(ob, "k.frozen", 2)

    def slow(delivery: Delivery) -> Outcome:
        time.sleep(1.5)
        return Succeeded()

    recorder = RecordingDeliverer("k.frozen", outcome=slow)
    with stream_daemon(
        dsn,
        kafka_broker,
        {"k.frozen": recorder},
        poll_seconds=0.2,
        consumer={"request_timeout_ms": 5000},
    ) as daemon:
        wait_for(lambda: len(recorder.deliveries) == 2, timeout=60, message="both calls")
        kafka_broker.pause()
        try:
            time.sleep(15)
            assert daemon.error is None and daemon._thread.is_alive(), "the daemon is running"
        finally:
            kafka_broker.resume()
        intend(ob, "k.frozen", 2, step="after")
        wait_for(all_succeeded(ob, 4), timeout=90, message="delivery")
    assert sorted(recorder.keys) == sorted(set(recorder.keys)) and len(recorder.keys) == 4


def test_deliver_from_kafka_stops_within_grace_with_the_broker_frozen(
    ob: Outbox, sub_env: dict[str, str], tmp_path: Path, kafka_broker: TansuBroker
) -> None:
    """SIGTERM while the broker is frozen and outcomes wait to be committed: out within --grace.

    The calls in flight finish and are recorded (the sink takes 1 s; --grace
    is 3), the offsets cannot be committed, the process exits 0 within about
    the grace period; later deliverers read those records again and skip
    them: the sink applies each key once and is never asked twice.
    """
    kafka_broker.create_topic("outbox.http.request", partitions=2)
    config = tmp_path / "deliverers.toml"
    config.write_text('[kinds."http.request"]\nallow_private = ["127.0.0.1"]\n')
    tuning = [a for k, v in TANSU_CONSUMER_TUNING.items() for a in ("--kafka-option", f"{k}={v}")]
    with IdempotentHttpSink(latency=1.0) as sink:
        run = ob.start_run("agent", "1")
        run.transaction(
            "s",
            lambda tx: (
                [
                    tx.intend("http.request", {"url": f"{sink.url}/x", "json": {"operation": i}})
                    for i in range(8)
                ]
                and None
            ),
        )
        logs = tmp_path / "procs.log"

        def spawn(*args: str) -> subprocess.Popen[bytes]:
            with logs.open("ab") as log:
                return subprocess.Popen(
                    [sys.executable, "-m", "outbox", *args, "--config", str(config)],
                    env=sub_env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )

        relay = spawn("relay", "--kafka", kafka_broker.bootstrap)
        deliver = [
            "deliver", "--from-kafka", kafka_broker.bootstrap, *tuning, "--concurrency", "2",
        ]  # fmt: skip
        first = spawn(*deliver, "--grace", "3")
        later = None
        try:
            wait_for(
                lambda: ob.effects(status="succeeded", limit=100), timeout=60, message="a success"
            )
            wait_for(lambda: sink.in_progress > 0, timeout=30, message="calls in flight")
            kafka_broker.pause()
            started = time.monotonic()
            first.send_signal(signal.SIGTERM)
            first.wait(60)
            took = time.monotonic() - started
            assert first.returncode == 0, logs.read_text()[-3000:]
            assert took < 3 + 2, f"exited after {took:.1f}s, --grace 3"
            kafka_broker.resume()
            later = spawn(*deliver)
            wait_for(all_succeeded(ob, 8), timeout=120, message="delivery")
        finally:
            kafka_broker.resume()
            for proc in (relay, first, later):
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
        stats = sink.stats()
    assert stats["keys_applied"] == 8 and stats["duplicate_keys_applied"] == []
    assert stats["redeliveries"] == 0, "no call was made twice"


@pytest.mark.parametrize("mode", ["poll", "stream"])
def test_attempts_waiting_behind_a_kinds_cap_keep_their_leases(
    ob: Outbox, dsn: str, kafka_broker: TansuBroker, mode: str
) -> None:
    """Six attempts of a kind capped at one call, each 0.6 s, leases of 1 s.

    The later ones wait up to 3 s for their turn (stream mode reads them all
    at once); the heartbeat keeps every held lease, started or not, so the
    reconciler (every 0.2 s) never takes one back: each key is delivered once.
    """
    intend(ob, "k.queue", 6)

    def slow(delivery: Delivery) -> Outcome:
        time.sleep(0.6)
        return Succeeded()

    capped = RecordingDeliverer("k.queue", outcome=slow)
    capped.concurrency = 1
    fields: dict[str, Any] = {"lease_seconds": 1.0, "reconcile_seconds": 0.2}
    if mode == "stream":
        running = stream_daemon(dsn, kafka_broker, {"k.queue": capped}, **fields)
    else:
        running = DaemonThread(dsn, {"k.queue": capped}, **fields)
    with running:
        wait_for(all_succeeded(ob, 6), timeout=60, message="delivery")
    assert sorted(capped.keys) == sorted(set(capped.keys)) and len(capped.keys) == 6
    for effect in ob.effects(limit=10):
        assert "expired" not in [a.outcome for a in ob.store.attempts(effect.id)]


def test_a_large_backlog_is_read_no_faster_than_there_is_room(
    ob: Outbox, dsn: str, kafka_broker: TansuBroker
) -> None:
    """2,000 records wait in the topic; the deliverer may hold 8 attempts.

    Sampled on the daemon's own loop while it drains: it never holds more than
    8 attempts nor keeps more than 8 records open; when it is done, nothing is
    left open or claimed in its offset book (nothing leaks).
    """
    run = ob.start_run("agent", "1")
    run.transaction("s", lambda tx: [tx.intend("k.bulk", {"n": i}) for i in range(2000)] and None)
    recorder = RecordingDeliverer("k.bulk")
    peaks = {"held": 0, "open": 0}

    async def sample(daemon: DeliveryDaemon, source: KafkaSource) -> None:
        while True:
            peaks["held"] = max(peaks["held"], len(daemon.leases))
            peaks["open"] = max(peaks["open"], len(source.offsets))
            await asyncio.sleep(0.005)

    with stream_daemon(dsn, kafka_broker, {"k.bulk": recorder}, concurrency=8) as running:
        daemon = running.daemon
        assert daemon is not None and running._loop is not None
        source = daemon.source
        assert isinstance(source, KafkaSource)
        sampler = asyncio.run_coroutine_threadsafe(sample(daemon, source), running._loop)
        wait_for(lambda: len(recorder.deliveries) >= 2000, timeout=180, message="delivery")
        wait_for(all_succeeded(ob, 2000), timeout=60, message="recorded")
        sampler.cancel()
        assert source.offsets.claims == 0 and len(source.offsets) == 0
    assert 0 < peaks["held"] <= 8 and peaks["open"] <= 8, peaks
    assert len(set(recorder.keys)) == 2000


def test_an_attempt_whose_lease_was_taken_while_it_waited_is_not_called(
    ob: Outbox, dsn: str, kafka_broker: TansuBroker
) -> None:
    """An attempt waits behind a kind's cap; meanwhile another process takes its lease over.

    (A reconciler took it over, as it does when a lease ran out, to ask the
    sink; the test writes that take-over.) The heartbeat notices the loss.
    Expected: when its turn comes the attempt is not started (the sink cannot
    dedup: a call now would be a second one beside the new owner's), its slot
    is freed, and what it reports is logged as stale, changing nothing.
    (Stream mode: it reads what its records name, so attempts wait behind caps;
    poll mode claims only what can start.)
    """
    release = threading.Event()
    first: list[int] = []
    first_blocks = blocking_the_first(release, first)

    capped = RecordingDeliverer("k.once", idempotent=False, outcome=first_blocks)
    capped.concurrency = 1
    with stream_daemon(
        dsn, kafka_broker, {"k.once": capped}, lease_seconds=1.5, reconcile_seconds=3600
    ) as daemon:
        assert daemon.daemon is not None
        intend(ob, "k.once", 2)
        wait_for(lambda: capped.deliveries, timeout=60, message="the first call")

        def by_n(n: int) -> Any:
            return next(e for e in ob.effects() if e.payload["n"] == n)

        wait_for(lambda: first, message="the first call blocking")
        other = 1 - first[0]
        wait_for(lambda: by_n(other).status == "in_flight", timeout=90, message="both held")
        waiting = by_n(other)
        with ob.engine.begin() as conn:
            conn.execute(
                update(effects)
                .where(effects.c.id == waiting.id)
                .values(lease_owner="reconciler:elsewhere")
            )
        lost = daemon.daemon.metrics.leases_lost.labels(kind="k.once")
        wait_for(lambda: lost._value.get() >= 1, message="the heartbeat noticed")
        release.set()
        wait_for(lambda: by_n(first[0]).status == EffectStatus.SUCCEEDED, message="the first")
        wait_for(
            lambda: any(a.outcome == "stale" for a in ob.store.attempts(waiting.id)),
            message="the waiting attempt given back",
        )
        assert len(daemon.daemon.leases) == 0
    assert [d.payload["n"] for d in capped.deliveries] == first, "the lost attempt was not called"
    assert ob.effect(waiting.id).status == "in_flight", "left to its new owner"


@pytest.mark.parametrize("stop", ["pause", "cancel"])
def test_an_attempt_waiting_behind_a_cap_is_not_called_after_its_run_is_stopped(
    ob: Outbox, dsn: str, kafka_broker: TansuBroker, stop: str
) -> None:
    """A stream deliverer claims what its records name, so an attempt waits, in flight,
    behind its kind's cap; a pause or a cancel of its run counts it as started. When
    its turn comes it is given back instead of called, and its run keeps it (before:
    called, 2 of 2 stops)."""
    release = threading.Event()
    first: list[int] = []
    capped = RecordingDeliverer("k.stop", outcome=blocking_the_first(release, first))
    capped.concurrency = 1
    run = ob.start_run("agent", "1")
    run.transaction("s", lambda tx: [tx.intend("k.stop", {"n": i}) for i in range(2)] and None)
    with stream_daemon(dsn, kafka_broker, {"k.stop": capped}, reconcile_seconds=0.2):
        wait_for(lambda: first, timeout=60, message="the first call blocking")
        other = next(e for e in ob.effects() if e.payload["n"] != first[0])
        wait_for(lambda: ob.effect(other.id).status == "in_flight", timeout=90, message="held")
        if stop == "pause":
            ob.pause(run.id, "hold on")
        else:
            ob.cancel(run.id, "not needed", by="ops")
        release.set()
        held = {"pause": "paused", "cancel": "cancelled"}[stop]
        wait_for(lambda: ob.effect(other.id).status == held, timeout=30, message=held)
    assert [d.payload["n"] for d in capped.deliveries] == first, "the held attempt was called"
    outcomes = [a.outcome for a in ob.store.attempts(other.id)]
    assert "released" in outcomes and "succeeded" not in outcomes, outcomes


def test_a_compensation_waiting_behind_a_cap_is_called_while_its_run_compensates(
    ob: Outbox, dsn: str, kafka_broker: TansuBroker
) -> None:
    """What a stop sends is not held by it: a compensation that waited behind its
    kind's cap is called when its turn comes (not given back to be relayed again),
    and both runs end compensated."""
    release = threading.Event()
    first: list[int] = []
    undo = RecordingDeliverer("k.undo", outcome=blocking_the_first(release, first))
    undo.concurrency = 1
    runs = [ob.start_run("agent", "1") for _ in range(2)]
    for n, run in enumerate(runs):

        def book_one(tx: StepTransaction, n: int = n) -> None:
            tx.intend("k.book", {"n": n}, compensate=("k.undo", {"n": n}))

        run.transaction("book", book_one)
    book = RecordingDeliverer("k.book")
    with stream_daemon(dsn, kafka_broker, {"k.book": book, "k.undo": undo}, reconcile_seconds=0.2):
        wait_for(lambda: len(book.deliveries) == 2, timeout=60, message="booked")
        wait_for(
            lambda: all(e.status == "succeeded" for e in ob.effects(kind="k.book")),
            message="booked recorded",
        )
        for run in runs:
            ob.cancel(run.id, "changed my mind", by="ops")
        wait_for(lambda: first, timeout=60, message="the first compensation blocking")
        wait_for(
            lambda: (
                [e.status for e in ob.effects(kind="k.undo")].count(EffectStatus.IN_FLIGHT) == 2
            ),
            timeout=60,
            message="the second one waiting",
        )
        release.set()
        wait_for(
            lambda: all(ob.run(r.id).status == "compensated" for r in runs),
            timeout=60,
            message="both runs compensated",
        )
    assert sorted(d.payload["n"] for d in undo.deliveries) == [0, 1]
    for effect in ob.effects(kind="k.undo"):
        assert [a.outcome for a in ob.store.attempts(effect.id)] == ["succeeded"], "not given back"


def test_an_attempt_whose_lease_could_not_be_renewed_while_it_waited_is_not_called(
    ob: Outbox, dsn: str, kafka_broker: TansuBroker
) -> None:
    """An attempt waits behind a kind's cap while its row is locked for longer than a lease.

    The heartbeat cannot extend it (its statement waits on the lock), so by
    the time the lock is gone the lease may have run out and been taken over.
    Expected: when its turn comes it is given back instead of called (before:
    called under attempt 1); it is dispatched again and delivered once, under
    a new attempt.
    """
    release = threading.Event()
    first: list[int] = []
    first_blocks = blocking_the_first(release, first)

    capped = RecordingDeliverer("k.locked", idempotent=False, outcome=first_blocks)
    capped.concurrency = 1
    with stream_daemon(
        dsn, kafka_broker, {"k.locked": capped}, lease_seconds=1.5, reconcile_seconds=3600
    ):
        intend(ob, "k.locked", 2)
        wait_for(lambda: capped.deliveries, timeout=60, message="the first call")

        def by_n(n: int) -> Any:
            return next(e for e in ob.effects() if e.payload["n"] == n)

        wait_for(lambda: first, message="the first call blocking")
        other = 1 - first[0]
        wait_for(lambda: by_n(other).status == "in_flight", timeout=90, message="both held")
        waiting = by_n(other)
        with ob.engine.begin() as conn:
            conn.execute(select(effects.c.id).where(effects.c.id == waiting.id).with_for_update())
            time.sleep(2.0)  # longer than the lease: no heartbeat gets through
            release.set()  # the first call returns: the second's turn
            time.sleep(0.5)
        wait_for(all_succeeded(ob, 2), timeout=60, message="delivered after the lock")
    assert [d.payload["n"] for d in capped.deliveries] == [first[0], 1 - first[0]]
    log = [(a.attempt, a.outcome) for a in ob.store.attempts(waiting.id)]
    assert (1, "released") in log and log[-1][1] == "succeeded" and log[-1][0] > 1, log


def test_a_broker_that_is_not_up_yet_is_waited_for(ob: Outbox, dsn: str, tmp_path: Path) -> None:
    """The relay and the stream deliverer start before the broker (2 s bootstrap timeouts).

    Expected: neither ends (before: the consumer's KafkaTimeoutError ended the
    deliverer, the producer's the relay); they keep trying, and once the broker
    is up every effect is delivered, once.
    """
    broker = TansuBroker(tmp_path / "tansu.log")  # its port refuses connections until start()
    settings = StreamSettings(
        bootstrap_servers=broker.bootstrap,
        group="late",
        consumer={**TANSU_CONSUMER_TUNING, "bootstrap_timeout_ms": 2000},
        poll_seconds=0.2,
    )
    relay_settings = RelaySettings(
        bootstrap_servers=broker.bootstrap, poll_seconds=0.2, producer={"max_block_ms": 2000}
    )
    recorder = RecordingDeliverer("k.late")
    running = DaemonThread(
        dsn,
        {"k.late": recorder},
        settings=settings,
        source=lambda store: KafkaSource(store, ["k.late"], settings),
        companions=lambda store: [Relay(store, ["k.late"], relay_settings)],
    )
    try:
        with running:
            intend(ob, "k.late", 3)
            time.sleep(5)  # two failed attempts to join, and the relay's too
            assert running.error is None and running._thread.is_alive()
            broker.start()
            broker.create_topic("outbox.k.late", partitions=2)
            wait_for(all_succeeded(ob, 3), timeout=90, message="delivery")
    finally:
        broker.stop()
    assert len(recorder.keys) == 3 == len(set(recorder.keys))
