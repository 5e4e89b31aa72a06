"""The Kafka source on its own: which offsets it commits, and what it does when a part fails.

Each test drives a real :class:`~outbox.delivery.stream.KafkaSource` (its
``take``, ``recorded`` and ``close``, as the delivery daemon calls them) over a
real Tansu broker and a real PostgreSQL, with records written to chosen
partitions, and reads the consumer group's committed offsets back from the
broker. Expected: a partition's committed offset never passes a record whose
effect is claimed here and not yet recorded, nor a record not yet decided (its
claim failed); a failed claim or a frozen broker never ends ``take`` with an
error; every call into Kafka, ``close`` included, ends within its time.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import psycopg
import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from deliverers.testing import TANSU_CONSUMER_TUNING, RecordingDeliverer, TansuBroker
from outbox import EffectStatus, Outbox
from outbox.delivery.leases import Leases
from outbox.delivery.metrics import DeliveryMetrics
from outbox.delivery.relay import _envelope
from outbox.delivery.settings import StreamSettings
from outbox.delivery.stream import KafkaSource
from outbox.ids import RELAY_OWNER_PREFIX
from outbox.storage.async_store import AsyncStore, ClaimedEffect, Completion
from outbox.storage.attempts import ClaimCutShort
from outbox.storage.engine import make_async_engine
from outbox.storage.sql.dispatch import DISPATCH_QUEUE
from tests.support import limited_role

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

KIND = "k.src"
TOPIC = f"outbox.{KIND}"
GROUP = "source-test"
RELAY = RELAY_OWNER_PREFIX + "test:1:src"
T = TypeVar("T")


@pytest.fixture
def broker(kafka_broker: TansuBroker) -> Iterator[TansuBroker]:
    kafka_broker.create_topic(TOPIC, partitions=2)
    yield kafka_broker
    kafka_broker.resume()  # a test that froze it must not leave it frozen for the fixture


def intend(ob: Outbox, n: int) -> None:
    run = ob.start_run("agent", "1")
    run.transaction("s", lambda tx: [tx.intend(KIND, {"i": i}) for i in range(n)] and None)


async def dispatch(store: AsyncStore, n: int) -> list[ClaimedEffect]:
    """What a relay does before publishing: claim into ``dispatched``."""
    held = await store.claim_many(
        DISPATCH_QUEUE, [({"kind": KIND}, n)], owner=RELAY, lease_seconds=600
    )
    return sorted(held, key=lambda e: e.payload["i"])


def publish(broker: TansuBroker, records: list[tuple[int, ClaimedEffect | bytes]]) -> None:
    """Write (partition, effect or raw bytes) records in order; the broker assigns offsets."""
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap, acks="all")
    try:
        for partition, what in records:
            value = what if isinstance(what, bytes) else _envelope(what)
            producer.send(TOPIC, value=value, partition=partition).get(timeout=30)
    finally:
        producer.close()


def committed(broker: TansuBroker) -> dict[int, int | None]:
    """The group's committed offset per partition, as the broker has it."""
    reader = KafkaConsumer(
        bootstrap_servers=broker.bootstrap, group_id=GROUP, enable_auto_commit=False
    )
    try:
        return {p: reader.committed(TopicPartition(TOPIC, p)) for p in (0, 1)}
    finally:
        reader.close()


def settings(broker: TansuBroker, **fields: Any) -> StreamSettings:
    return StreamSettings(
        bootstrap_servers=broker.bootstrap,
        group=GROUP,
        consumer=dict(TANSU_CONSUMER_TUNING),
        poll_seconds=0.2,
        **fields,
    )


def leases(concurrency: int = 100) -> Leases:
    return Leases({KIND: RecordingDeliverer(KIND)}, concurrency, DeliveryMetrics())


async def take_until(
    source: KafkaSource,
    room: Leases,
    done: Callable[[list[ClaimedEffect]], bool],
    timeout: float = 60,
) -> list[ClaimedEffect]:
    """Take until ``done(everything claimed so far)``; the group join takes a few seconds."""
    claimed: list[ClaimedEffect] = []
    deadline = time.monotonic() + timeout
    while not done(claimed):
        assert time.monotonic() < deadline, f"claimed only {[e.payload for e in claimed]}"
        claimed += await source.take(room)
    return claimed


def succeeded(effects: list[ClaimedEffect]) -> list[Completion]:
    return [Completion(e.id, e.attempt, EffectStatus.SUCCEEDED, "succeeded") for e in effects]


async def within(seconds: float, work: Awaitable[T]) -> tuple[T, float]:
    started = time.monotonic()
    result = await asyncio.wait_for(work, seconds)
    return result, time.monotonic() - started


def run(main: Callable[[AsyncStore], Awaitable[T]], dsn: str) -> T:
    async def wrapper() -> T:
        store = AsyncStore(make_async_engine(dsn))
        try:
            return await main(store)
        finally:
            await store.dispose()

    return asyncio.run(wrapper())


def test_a_duplicate_record_of_an_effect_in_flight_does_not_release_the_first(
    ob: Outbox, dsn: str, broker: TansuBroker
) -> None:
    """x is claimed through offset 0; its copy at offset 2 (a later batch) is skipped.

    The commit may pass neither while x's outcome is not recorded, though y's
    (offset 1) is; once x's is, the whole partition is committed.
    """
    intend(ob, 2)

    async def main(store: AsyncStore) -> None:
        x, y = await dispatch(store, 2)
        publish(broker, [(0, x), (0, y), (0, x)])
        source = KafkaSource(store, [KIND], settings(broker, batch_size=2))
        await source.open()
        try:
            room = leases()
            first = await take_until(source, room, lambda got: len(got) == 2)
            assert {e.id for e in first} == {x.id, y.id}
            # The copy of x comes in a later batch: not claimed again, and not a reason
            # to commit past the record x was claimed through.
            await take_until(source, room, lambda got: source.skipped >= 1)
            await source.recorded([y.id])
            await source.take(room)  # the source commits when it next reads
            assert committed(broker)[0] in (None, 0), "committed past x, still in flight"
            await source.recorded([x.id])
            await source.take(room)
            assert committed(broker)[0] == 3
        finally:
            await source.close(5)

    run(main, dsn)


def test_a_failed_claim_keeps_its_records_until_they_are_claimed(
    ob: Outbox, dsn: str, broker: TansuBroker, caplog: pytest.LogCaptureFixture
) -> None:
    """PostgreSQL refuses the claim (a role without UPDATE): ``take`` says so and retries.

    Nothing is committed past the records whose claim failed; once the claim
    works they are claimed (not lost behind a commit), then committed.
    """
    intend(ob, 2)

    async def main(store: AsyncStore) -> None:
        x, y = await dispatch(store, 2)
        publish(broker, [(0, x), (1, y)])
        with limited_role(dsn, "UPDATE ON outbox_effects"):
            refused = AsyncStore(make_async_engine(dsn))
            source = KafkaSource(refused, [KIND], settings(broker))
            await source.open()
            room = leases()
            deadline = time.monotonic() + 60
            while "claim" not in caplog.text:
                assert time.monotonic() < deadline, "the claim was never tried"
                assert await source.take(room) == []
            assert await source.take(room) == []  # tried again, refused again
            assert committed(broker) == {0: None, 1: None}
            await refused.dispose()  # its sessions carried the limited role
        try:
            claimed = await take_until(source, room, lambda got: len(got) == 2)
            assert {e.id for e in claimed} == {x.id, y.id}
            await source.recorded([x.id, y.id])
            await source.take(room)
            assert committed(broker) == {0: 1, 1: 1}
        finally:
            await source.close(5)
            await refused.dispose()

    with caplog.at_level("WARNING", logger="outbox.delivery.stream"):
        run(main, dsn)


class _CutShortOnce(AsyncStore):
    """A store whose first claim of several effects commits the first alone, then fails.

    What a claim on Citus does when one shard's statement fails after another's
    committed (``tests/citus/test_lost_session.py`` cuts one there).
    """

    cut = False

    async def claim_dispatched(self, ids: Any, **kwargs: Any) -> list[ClaimedEffect]:
        if self.cut or len(ids) < 2:
            return await super().claim_dispatched(ids, **kwargs)
        self.cut = True
        rows = await super().claim_dispatched(ids[:1], **kwargs)
        error = psycopg.OperationalError("the node of the next shard did not answer")
        raise ClaimCutShort(rows, error, 7, lost=False, left=ids[1:])


def test_a_claim_cut_short_keeps_what_it_claimed_and_claims_the_rest_next(
    ob: Outbox, dsn: str, broker: TansuBroker
) -> None:
    """The effects a cut claim committed are taken (not left in flight, uncalled,
    until their leases run out); the records it did not settle stay open, so no
    offset passes them, and are claimed by the next ``take`` before any read."""
    intend(ob, 2)

    async def main(_: AsyncStore) -> None:
        store = _CutShortOnce(make_async_engine(dsn))
        try:
            x, y = await dispatch(store, 2)
            publish(broker, [(0, x), (0, y)])
            source = KafkaSource(store, [KIND], settings(broker))
            await source.open()
            try:
                room = leases()
                first = await take_until(source, room, lambda got: len(got) > 0)
                assert [e.id for e in first] == [x.id] and store.cut
                await source.recorded([x.id])
                second = await source.take(room)
                assert [e.id for e in second] == [y.id], "the record left is claimed next"
                assert committed(broker)[0] in (None, 1), "committed past y, undecided"
                await source.recorded([y.id])
                await source.take(room)
                assert committed(broker)[0] == 2
            finally:
                await source.close(5)
        finally:
            await store.dispose()

    run(main, dsn)


def test_a_frozen_broker_neither_fails_nor_blocks_take_recorded_or_close(
    ob: Outbox, dsn: str, broker: TansuBroker
) -> None:
    """With the broker stopped (SIGSTOP), every call returns in its time without an error.

    ``take`` comes back empty within about its poll time, ``recorded`` at once
    (the commit waits for the broker), and the commit lands once the broker
    is back; ``close(1)`` ends within about a second with the broker frozen.
    """
    intend(ob, 2)

    async def main(store: AsyncStore) -> None:
        x, y = await dispatch(store, 2)
        publish(broker, [(0, x), (1, y)])
        source = KafkaSource(store, [KIND], settings(broker))
        await source.open()
        room = leases()
        await take_until(source, room, lambda got: len(got) == 2)
        broker.pause()
        _, took = await within(5, source.recorded([x.id]))
        assert took < 0.5
        for _ in range(3):
            found, took = await within(5, source.take(room))
            assert found == [] and took < 3
        broker.resume()
        deadline = time.monotonic() + 60
        while committed(broker)[0] != 1:
            assert time.monotonic() < deadline, "the commit never landed"
            await source.take(room)
        assert committed(broker)[1] in (None, 0), "y is not recorded"
        broker.pause()
        await source.recorded([y.id])
        _, took = await within(10, source.close(1))
        assert took < 2
        broker.resume()

    run(main, dsn)


def test_a_broker_out_of_reach_is_tried_again_without_leaking_threads(dsn: str) -> None:
    """Nothing listens at the bootstrap address: ``open`` and ``take`` say so and go on.

    Each attempt to join fails after its bootstrap timeout (0.3 s here);
    kafka-python leaves an I/O thread behind each failed attempt unless it is
    closed, so after five attempts there is still at most one.
    """
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: connections are refused

    async def main(store: AsyncStore) -> None:
        source = KafkaSource(
            store,
            [KIND],
            StreamSettings(
                bootstrap_servers=f"127.0.0.1:{port}",
                group=GROUP,
                poll_seconds=0.05,
                consumer={"bootstrap_timeout_ms": 300},
            ),
        )
        await source.open()
        for _ in range(4):
            assert await source.take(leases()) == []
        io_threads = [t for t in threading.enumerate() if t.name.startswith("kafka-io")]
        assert len(io_threads) <= 1, io_threads
        _, took = await within(5, source.close(1))
        assert took < 2

    run(main, dsn)


#: Raises PostgreSQL's deadlock error (SQLSTATE 40P01) on the first three claims of a
#: dispatched effect: the error a claim meets when a relay's mark or another
#: deliverer's claim holds the rows it waits for and waits for one it holds.
DEADLOCK_FIRST_CLAIMS = """
CREATE SEQUENCE deadlocks;
CREATE FUNCTION deadlock_first_claims() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF OLD.status = 'dispatched' AND NEW.status = 'in_flight' AND nextval('deadlocks') <= 3 THEN
    RAISE EXCEPTION 'deadlock detected' USING ERRCODE = '40P01';
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER deadlock_first_claims BEFORE UPDATE ON outbox_effects
  FOR EACH ROW EXECUTE FUNCTION deadlock_first_claims();
"""


def test_a_deadlock_on_claim_is_retried_with_backoff_never_raised(
    ob: Outbox, dsn: str, broker: TansuBroker, caplog: pytest.LogCaptureFixture
) -> None:
    """Three claims in a row end in a deadlock: ``take`` never raises, pauses 0.2, 0.4, 0.8 s.

    The fourth claim takes both effects, and the count of failures starts afresh.
    """
    intend(ob, 2)

    async def main(store: AsyncStore) -> None:
        x, y = await dispatch(store, 2)
        publish(broker, [(0, x), (1, y)])
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(DEADLOCK_FIRST_CLAIMS)
        source = KafkaSource(store, [KIND], settings(broker))
        await source.open()
        room, pauses = leases(), {}
        claimed: list[ClaimedEffect] = []
        try:
            deadline = time.monotonic() + 60
            while len(claimed) < 2:
                assert time.monotonic() < deadline, f"claimed {claimed}"
                failures, started = source._claim_failures, time.monotonic()
                claimed += await source.take(room)
                if source._claim_failures > failures:
                    pauses[source._claim_failures] = time.monotonic() - started
            assert {e.id for e in claimed} == {x.id, y.id}
            assert sorted(pauses) == [1, 2, 3]
            assert pauses[3] >= 0.75 and pauses[2] >= 0.35, pauses  # doubled each time
            assert source._claim_failures == 0
            assert "deadlock detected" in caplog.text and "3 failures in a row" in caplog.text
        finally:
            await source.close(5)

    with caplog.at_level("WARNING", logger="outbox.delivery.stream"):
        run(main, dsn)
