"""Stream mode: a relay carries pending effects to Kafka; a Kafka source feeds the delivery daemon.

``outbox relay`` claims pending effects with the same claim machinery as the
poll deliverer (so per-key order holds: the next effect of an ordering key is
not claimed while one is undecided), publishes each to the topic
``<prefix><kind>``, keyed by ordering key (else run id), and marks them
``dispatched`` with the same fencing as a completion. Several relays may run.
A relay also re-dispatches what nobody delivered within ``dispatch_ttl`` and
rescues the claims of a relay that died, so a relay alone keeps its promises.

``outbox deliver --from-kafka`` is the one :class:`~outbox.delivery.daemon.DeliveryDaemon`
with a :class:`KafkaSource`: for each batch of records it claims the named
effects that are still ``dispatched`` (a record for an effect already claimed
or finished is a redelivery: skipped), delivers them exactly as poll mode does
(same leases, per-kind caps, rate-limit pauses, retry policy, grace period and
metrics), and commits a partition's offset only once every record up to it
has its outcome in PostgreSQL. A consumer killed with ``kill -9`` loses
nothing: its records come again to the group, and its claimed attempts are
resolved by the reconciler like any lost attempt.

Needs the ``kafka`` extra (kafka-python).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka import errors as kafka_errors
from kafka.structs import OffsetAndMetadata

from outbox.delivery.attempt import released
from outbox.delivery.leases import Leases
from outbox.delivery.maintenance import every
from outbox.delivery.reconcile import reconcile
from outbox.delivery.settings import RelaySettings, StreamSettings
from outbox.delivery.sources import wait_or_wake
from outbox.faults import crash_point
from outbox.retry import IdleBackoff
from outbox.storage.async_store import AsyncStore, ClaimedEffect
from outbox.storage.notify import listen
from outbox.storage.sql.common import EFFECTS_CHANNEL
from outbox.storage.sql.queue import EFFECT_QUEUE

__all__ = ["KafkaSource", "Relay", "close_producer", "topic_for"]

log = logging.getLogger(__name__)

T = TypeVar("T")


def topic_for(prefix: str, kind: str) -> str:
    """The topic that carries effects of ``kind``."""
    return f"{prefix}{kind}"


def close_producer(producer: Any, timeout: float) -> None:
    """Flush and close; force the close when records are still pending after ``timeout``.

    kafka-python 3.0's ``close(timeout)`` raises from its flush when records are
    still pending and then leaves the producer open (its sender thread keeps
    running); stop the sender, which fails the pending records, and close again.
    """
    try:
        producer.close(timeout=timeout)
        return
    except Exception as exc:
        log.warning("Kafka producer did not flush within %gs (%s): closing it anyway", timeout, exc)
    sender = getattr(producer, "_sender", None)
    if sender is not None:
        sender.force_close()
        sender.join(10)
    try:
        producer.close(timeout=0)
    except Exception:
        log.exception("closing the Kafka producer failed")


class _Offsets:
    """Per partition, which read records are not yet recorded: commits never pass the oldest."""

    def __init__(self) -> None:
        self._open: dict[TopicPartition, dict[int, int]] = defaultdict(dict)  # offset -> refs
        self._next: dict[TopicPartition, int] = {}
        self._by_effect: dict[uuid.UUID, list[tuple[TopicPartition, int]]] = defaultdict(list)

    def read(self, tp: TopicPartition, offset: int, effect_id: uuid.UUID | None) -> None:
        """A record was read; it stays open until its effect is recorded (``None``: never opens)."""
        self._next[tp] = max(self._next.get(tp, 0), offset + 1)
        if effect_id is not None:
            self._open[tp][offset] = self._open[tp].get(offset, 0) + 1
            self._by_effect[effect_id].append((tp, offset))

    def done(self, effect_id: uuid.UUID) -> None:
        """Every record naming ``effect_id`` is recorded."""
        for tp, offset in self._by_effect.pop(effect_id, []):
            refs = self._open[tp].get(offset, 0) - 1
            if refs <= 0:
                self._open[tp].pop(offset, None)
            else:
                self._open[tp][offset] = refs

    def committable(self) -> dict[TopicPartition, int]:
        """The offset each partition may commit: its oldest open record, or all it read."""
        return {tp: min(self._open[tp], default=nxt) for tp, nxt in self._next.items()}

    def forget(self, keep: set[TopicPartition]) -> None:
        """Drop partitions this consumer no longer owns (a rebalance moved them)."""
        for tp in [tp for tp in self._next if tp not in keep]:
            self._next.pop(tp, None)
            self._open.pop(tp, None)


def _effect_id(value: bytes) -> uuid.UUID | None:
    try:
        return uuid.UUID(json.loads(value)["effect_id"])
    except (ValueError, KeyError, TypeError):
        return None


class KafkaSource:
    """Claims the effects named by a consumer group's records (see the module docstring)."""

    name = "kafka"

    def __init__(self, store: AsyncStore, kinds: Sequence[str], settings: StreamSettings) -> None:
        self.store = store
        self.kinds = list(kinds)
        self.settings = settings
        self.skipped = 0
        self._offsets = _Offsets()
        self._committed: dict[TopicPartition, int] = {}
        # kafka-python's consumer is not thread-safe: every call goes through this one thread.
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="outbox-kafka-consumer")
        self._consumer: KafkaConsumer | None = None

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, lambda: fn(*args, **kwargs))

    async def open(self) -> None:
        """Join the consumer group on the kinds' topics."""
        topics = [topic_for(self.settings.topic_prefix, kind) for kind in self.kinds]
        self._consumer = await self._call(
            KafkaConsumer,
            *topics,
            bootstrap_servers=self.settings.bootstrap_servers,
            group_id=self.settings.group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            **self.settings.consumer,
        )

    def wake(self) -> None:
        """Nothing to interrupt: a poll returns within ``poll_seconds``."""

    async def take(self, leases: Leases) -> list[ClaimedEffect]:
        """Read up to the room there is, then claim the records' effects still dispatched."""
        assert self._consumer is not None
        room = min(leases.free, self.settings.batch_size)
        batch = await self._call(
            self._consumer.poll,
            timeout_ms=int(self.settings.poll_seconds * 1000),
            max_records=room,
        )
        named: list[uuid.UUID] = []
        for tp, records in batch.items():
            for record in records:
                effect_id = _effect_id(record.value)
                if effect_id is None:
                    log.warning(
                        "skipping a record that is not an outbox envelope at %s:%d:%d",
                        record.topic,
                        record.partition,
                        record.offset,
                    )
                else:
                    named.append(effect_id)
                self._offsets.read(tp, record.offset, effect_id)
        if not named:
            await self._commit()
            return []
        try:
            claimed = await self.store.claim_dispatched(
                sorted(set(named)),
                owner=self.settings.owner,
                lease_seconds=self.settings.lease_seconds,
            )
        except Exception:
            # Not committed, read again: each record's effect is checked in
            # PostgreSQL again, so what was recorded meanwhile is skipped.
            for tp, records in batch.items():
                await self._call(self._consumer.seek, tp, records[0].offset)
            for effect_id in set(named):
                self._offsets.done(effect_id)
            raise
        ours = {effect.id for effect in claimed}
        skipped = set(named) - ours
        self.skipped += len(skipped)
        for effect_id in skipped:  # finished already, or claimed through another copy
            self._offsets.done(effect_id)
        return claimed

    async def recorded(self, effect_ids: Sequence[uuid.UUID]) -> None:
        """Outcomes are durable: commit every partition up to its oldest unrecorded record."""
        for effect_id in effect_ids:
            self._offsets.done(effect_id)
        await self._commit()

    async def _commit(self) -> None:
        assert self._consumer is not None
        due = {
            tp: offset
            for tp, offset in self._offsets.committable().items()
            if offset > self._committed.get(tp, -1)
        }
        if not due:
            return
        offsets = {tp: OffsetAndMetadata(offset, "", -1) for tp, offset in due.items()}
        try:
            await self._call(self._consumer.commit, offsets)
        except kafka_errors.CommitFailedError as exc:
            # The group rebalanced: the partitions' new owner reads these records
            # again and skips the effects already recorded.
            log.warning("offsets not committed: %s", exc)
            self._offsets.forget(await self._call(self._consumer.assignment))
            return
        self._committed.update(due)

    async def close(self) -> None:
        """Commit what is recorded and leave the group."""
        if self._consumer is not None:
            try:
                await self._commit()
            except Exception as exc:
                log.warning("final offset commit failed: %s", exc)
            await self._call(self._consumer.close)
        self._thread.shutdown(wait=False)


def _envelope(effect: ClaimedEffect) -> bytes:
    return json.dumps(
        {
            "effect_id": str(effect.id),
            "run_id": None if effect.run_id is None else str(effect.run_id),
            "kind": effect.kind,
            "idempotency_key": effect.idempotency_key,
            "attempt": effect.attempt,
            "schema_version": effect.schema_version,
            "ordering_key": effect.ordering_key,
            "payload": effect.payload,
        }
    ).encode()


def _partition_key(effect: ClaimedEffect) -> bytes:
    return str(effect.ordering_key or effect.run_id or effect.id).encode()


class Relay:
    """Publishes pending effects of ``kinds`` to Kafka until :meth:`stop`."""

    def __init__(self, store: AsyncStore, kinds: Sequence[str], settings: RelaySettings) -> None:
        self.store = store
        self.kinds = list(kinds)
        self.settings = settings
        self.owner = settings.owner
        self.dispatched = 0
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._producer: KafkaProducer | None = None

    def stop(self) -> None:
        """Stop after the current batch."""
        self._stopping.set()
        self._wake.set()

    async def run(self) -> None:
        """Relay until stopped."""
        self._producer = await asyncio.to_thread(self._make_producer)
        background = [
            asyncio.create_task(listen(self.store.dsn, EFFECTS_CHANNEL, self._wake)),
            asyncio.create_task(every(self.settings.reconcile_seconds, self._reconcile, "relay")),
        ]
        idle = IdleBackoff(self.settings.poll_seconds)
        try:
            while not self._stopping.is_set():
                self._wake.clear()
                try:
                    sent = await self._relay_batch()
                except Exception as exc:
                    # Whatever it claimed stays leased to this relay; when the lease
                    # runs out a reconciler dispatches it again (same key).
                    log.warning("relay batch failed (%s); retrying after the poll interval", exc)
                    await wait_or_wake(self._wake, self.settings.poll_seconds)
                    continue
                if sent < self.settings.batch_size:
                    await wait_or_wake(self._wake, idle.found(sent > 0))
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            producer, self._producer = self._producer, None
            if producer is not None:
                await asyncio.to_thread(close_producer, producer, 10)

    async def _reconcile(self) -> None:
        # Needs no deliverer: a relay's own expired claims and stale dispatches.
        await reconcile(self.store, {}, worker=f"reconciler:{self.owner}", report_skipped=False)

    async def _relay_batch(self) -> int:
        quotas = [({"kind": kind}, self.settings.batch_size) for kind in self.kinds]
        effects = await self.store.claim_many(
            EFFECT_QUEUE, quotas, owner=self.owner, lease_seconds=self.settings.lease_seconds
        )
        if not effects:
            return 0
        published, failed = await asyncio.to_thread(self._publish, effects)
        crash_point("after_publish")
        if failed:
            # kafka-python's idempotent producer can stay wedged after a timed-out
            # batch or a broker restart: start a fresh one for the next batch.
            await asyncio.to_thread(self._replace_producer)
            await self.store.complete(
                self.owner,
                [
                    released(effect, f"publishing to Kafka failed: {error}", delay=1.0)
                    for effect, error in failed
                ],
            )
        kept = await self.store.mark_dispatched(
            self.owner,
            [(effect.id, effect.attempt) for effect in published],
            dispatch_ttl=self.settings.dispatch_ttl_seconds,
        )
        self.dispatched += len(kept)
        return len(effects)

    def _make_producer(self) -> KafkaProducer:
        return KafkaProducer(
            bootstrap_servers=self.settings.bootstrap_servers,
            acks="all",
            enable_idempotence=True,
            linger_ms=5,
            **self.settings.producer,
        )

    def _replace_producer(self) -> None:
        old, self._producer = self._producer, None
        if old is not None:
            close_producer(old, 5)
        try:
            self._producer = self._make_producer()
        except Exception as exc:  # no broker now: the next batch tries again
            log.warning("Kafka producer could not be recreated: %s", exc)

    def _publish(
        self, effects: list[ClaimedEffect]
    ) -> tuple[list[ClaimedEffect], list[tuple[ClaimedEffect, str]]]:
        if self._producer is None:
            self._replace_producer()
        if self._producer is None:
            return [], [(effect, "no Kafka broker reachable") for effect in effects]
        futures = []
        for effect in effects:
            headers = [
                ("idempotency-key", effect.idempotency_key.encode()),
                ("effect-id", str(effect.id).encode()),
                ("attempt", str(effect.attempt).encode()),
            ]
            if effect.run_id is not None:
                headers.append(("run-id", str(effect.run_id).encode()))
            topic = topic_for(self.settings.topic_prefix, effect.kind)
            future = self._producer.send(
                topic, key=_partition_key(effect), value=_envelope(effect), headers=headers
            )
            futures.append((effect, future))
        try:
            self._producer.flush(timeout=30)
        except Exception as exc:  # the futures below say which records were acknowledged
            log.warning("Kafka flush did not finish: %s", exc)
        published, failed = [], []
        for effect, future in futures:
            # flush() has waited already; waiting again per record could outlast the lease.
            if not future.is_done:
                failed.append((effect, "not acknowledged within the flush timeout"))
                continue
            try:
                future.get(timeout=0)
                published.append(effect)
            except Exception as exc:  # not acknowledged: released, dispatched again later
                failed.append((effect, f"{type(exc).__name__}: {exc}"))
        return published, failed
