"""Stream mode: the relay carries pending effects to Kafka; stream deliverers consume and deliver.

``outbox relay`` claims pending effects with the same claim machinery as the
poll deliverer (so per-key order holds: the next effect of an ordering key is
not claimed while one is undecided), publishes each to the topic
``<prefix><kind>``, keyed by ordering key (else run id), and marks them
``dispatched`` with the same fencing as a completion. Several relays may run.

``outbox deliver --from-kafka`` runs a consumer group. For each batch of
records it claims the named effects that are still ``dispatched`` (a record
for an effect already claimed or finished is a redelivery: skipped), delivers
them through the same deliverer registry and retry policy as poll mode,
records the outcomes fenced, and only then commits the offsets. A consumer
killed with ``kill -9`` loses nothing: its records come again to the group,
and its claimed attempts are resolved by the reconciler like any lost attempt.
A dispatch nobody delivers within its TTL is re-dispatched with the same key.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from kafka import KafkaConsumer, KafkaProducer
from kafka import errors as kafka_errors
from pydantic import BaseModel, ConfigDict, Field

from deliverers.kafka import close_producer
from outbox.delivery import Deliverer
from outbox.delivery.attempt import perform_attempt
from outbox.delivery.daemon import default_owner
from outbox.delivery.reconcile import reconcile
from outbox.faults import crash_point
from outbox.retry import RetryPolicy
from outbox.storage.async_store import AsyncDeliveryStore, Completion
from outbox.storage.notify import listen
from outbox.storage.sql.queue import EFFECT_QUEUE, RELAY_OWNER_PREFIX
from outbox.storage.sql.steps import EFFECTS_CHANNEL

__all__ = ["Relay", "RelaySettings", "StreamDeliverer", "StreamSettings", "topic_for"]

log = logging.getLogger(__name__)


def topic_for(prefix: str, kind: str) -> str:
    """The topic that carries effects of ``kind``."""
    return f"{prefix}{kind}"


class RelaySettings(BaseModel):
    """How a relay behaves."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bootstrap_servers: str
    topic_prefix: str = "outbox."
    batch_size: int = Field(default=500, ge=1)
    lease_seconds: float = Field(default=30.0, gt=0)
    #: A dispatched effect not delivered within this long is dispatched again.
    dispatch_ttl_seconds: float = Field(default=300.0, gt=0)
    poll_seconds: float = Field(default=1.0, gt=0)
    owner: str = Field(default_factory=lambda: RELAY_OWNER_PREFIX + default_owner())
    producer: dict[str, Any] = Field(default_factory=dict)


def _envelope(row: Any) -> bytes:
    return json.dumps(
        {
            "effect_id": str(row["id"]),
            "run_id": None if row["run_id"] is None else str(row["run_id"]),
            "kind": row["kind"],
            "idempotency_key": row["idempotency_key"],
            "attempt": row["attempt"],
            "schema_version": row["schema_version"],
            "ordering_key": row["ordering_key"],
            "payload": row["payload"],
        }
    ).encode()


def _partition_key(row: Any) -> bytes:
    key = row["ordering_key"] or row["run_id"] or row["id"]
    return str(key).encode()


class Relay:
    """Publishes pending effects of ``kinds`` to Kafka until :meth:`stop`."""

    def __init__(
        self, store: AsyncDeliveryStore, dsn: str, kinds: Sequence[str], settings: RelaySettings
    ) -> None:
        self.store = store
        self.dsn = dsn
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
        listener = asyncio.create_task(listen(self.dsn, EFFECTS_CHANNEL, self._wake))
        idle = 0.01
        try:
            while not self._stopping.is_set():
                self._wake.clear()
                try:
                    sent = await self._relay_batch()
                except Exception:
                    # Whatever it claimed stays leased to this relay; when the lease
                    # runs out the reconciler dispatches it again (same key).
                    log.exception("relay batch failed; retrying after the poll interval")
                    await asyncio.sleep(self.settings.poll_seconds)
                    continue
                if sent:
                    idle = 0.01
                    continue
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=idle)
                except TimeoutError:
                    idle = min(self.settings.poll_seconds, idle * 2)
        finally:
            listener.cancel()
            await asyncio.gather(listener, return_exceptions=True)
            producer, self._producer = self._producer, None
            if producer is not None:
                await asyncio.to_thread(close_producer, producer, 10)

    async def _relay_batch(self) -> int:
        quotas = [({"kind": kind}, self.settings.batch_size) for kind in self.kinds]
        try:
            rows = await self.store.claim_many(
                EFFECT_QUEUE, quotas, owner=self.owner, lease_seconds=self.settings.lease_seconds
            )
        except Exception:
            log.exception("relay claim failed")
            await asyncio.sleep(self.settings.poll_seconds)
            return 0
        if not rows:
            return 0
        published, failed = await asyncio.to_thread(self._publish, rows)
        crash_point("after_publish")
        if failed:
            # kafka-python's idempotent producer can stay wedged after a timed-out
            # batch or a broker restart: start a fresh one for the next batch.
            await asyncio.to_thread(self._replace_producer)
            await self.store.complete(
                self.owner,
                [
                    Completion(
                        row["id"],
                        row["attempt"],
                        "pending",
                        "released",
                        delay=1.0,
                        error=f"publishing to Kafka failed: {error}",
                    )
                    for row, error in failed
                ],
            )
        kept = await self.store.mark_dispatched(
            self.owner,
            [(row["id"], row["attempt"]) for row in published],
            dispatch_ttl=self.settings.dispatch_ttl_seconds,
        )
        self.dispatched += len(kept)
        return len(rows)

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

    def _publish(self, rows: list[Any]) -> tuple[list[Any], list[tuple[Any, str]]]:
        if self._producer is None:
            self._replace_producer()
        if self._producer is None:
            return [], [(row, "no Kafka broker reachable") for row in rows]
        futures = []
        for row in rows:
            headers = [
                ("idempotency-key", row["idempotency_key"].encode()),
                ("effect-id", str(row["id"]).encode()),
                ("attempt", str(row["attempt"]).encode()),
            ]
            if row["run_id"] is not None:
                headers.append(("run-id", str(row["run_id"]).encode()))
            topic = topic_for(self.settings.topic_prefix, row["kind"])
            futures.append(
                (
                    row,
                    self._producer.send(
                        topic, key=_partition_key(row), value=_envelope(row), headers=headers
                    ),
                )
            )
        try:
            self._producer.flush(timeout=30)
        except Exception as exc:  # the futures below say which records were acknowledged
            log.warning("Kafka flush did not finish: %s", exc)
        published, failed = [], []
        for row, future in futures:
            # flush() has waited already; waiting again per record could outlast the lease.
            if not future.is_done:
                failed.append((row, "not acknowledged within the flush timeout"))
                continue
            try:
                future.get(timeout=0)
                published.append(row)
            except Exception as exc:  # not acknowledged: released, dispatched again later
                failed.append((row, f"{type(exc).__name__}: {exc}"))
        return published, failed


class StreamSettings(BaseModel):
    """How a stream deliverer behaves."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bootstrap_servers: str
    group: str
    topic_prefix: str = "outbox."
    max_records: int = Field(default=200, ge=1)
    lease_seconds: float = Field(default=30.0, gt=0)
    reconcile_seconds: float = Field(default=2.0, gt=0)
    owner: str = Field(default_factory=default_owner)
    retry_base_seconds: float = Field(default=0.5, ge=0)
    retry_cap_seconds: float = Field(default=300.0, ge=0)
    max_attempts: int = Field(default=10, ge=1)
    consumer: dict[str, Any] = Field(default_factory=dict)


class StreamDeliverer:
    """A member of a consumer group delivering the effects the relay dispatched."""

    def __init__(
        self,
        store: AsyncDeliveryStore,
        deliverers: Mapping[str, Deliverer],
        settings: StreamSettings,
    ) -> None:
        self.store = store
        self.deliverers = dict(deliverers)
        self.settings = settings
        self.owner = settings.owner
        self.policy = RetryPolicy(
            settings.retry_base_seconds, settings.retry_cap_seconds, settings.max_attempts
        )
        self.delivered = 0
        self.skipped = 0
        self._stopping = asyncio.Event()
        self._held: dict[uuid.UUID, int] = {}

    def stop(self) -> None:
        """Stop after the current batch (its offsets are committed once it is recorded)."""
        self._stopping.set()

    async def run(self) -> None:
        """Consume and deliver until stopped."""
        topics = [topic_for(self.settings.topic_prefix, kind) for kind in self.deliverers]
        consumer = await asyncio.to_thread(
            KafkaConsumer,
            *topics,
            bootstrap_servers=self.settings.bootstrap_servers,
            group_id=self.settings.group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_poll_records=self.settings.max_records,
            **self.settings.consumer,
        )
        background = [
            asyncio.create_task(self._heartbeat()),
            asyncio.create_task(self._reconcile_loop()),
        ]
        try:
            while not self._stopping.is_set():
                batch = await asyncio.to_thread(consumer.poll, timeout_ms=500)
                records = [r for part in batch.values() for r in part]
                if not records:
                    continue
                try:
                    await self._deliver_batch(records)
                except Exception:
                    log.exception("delivering a batch failed; reading it again")
                    # Uncommitted and re-read: each record's effect is checked in
                    # PostgreSQL again, so what was recorded is skipped.
                    for partition, part in batch.items():
                        consumer.seek(partition, part[0].offset)
                    await asyncio.sleep(1.0)
                    continue
                try:
                    await asyncio.to_thread(consumer.commit)
                except kafka_errors.CommitFailedError as exc:
                    # The group rebalanced: the partitions' new owner reads these
                    # records again and skips the effects already recorded.
                    log.warning("offsets not committed: %s", exc)
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await asyncio.to_thread(consumer.close)
            for deliverer in self.deliverers.values():
                await deliverer.aclose()

    async def _deliver_batch(self, records: list[Any]) -> None:
        ids = []
        for record in records:
            try:
                ids.append(uuid.UUID(json.loads(record.value)["effect_id"]))
            except (ValueError, KeyError, TypeError):
                log.warning(
                    "skipping a record that is not an outbox envelope at %s:%d:%d",
                    record.topic,
                    record.partition,
                    record.offset,
                )
        rows = await self.store.claim_dispatched(
            sorted(set(ids)), owner=self.owner, lease_seconds=self.settings.lease_seconds
        )
        self.skipped += len(ids) - len(rows)
        for row in rows:
            self._held[row["id"]] = row["attempt"]
        try:
            results = await asyncio.gather(
                *(
                    perform_attempt(
                        self.deliverers[row["kind"]],
                        row,
                        policy=self.policy,
                        default_max_attempts=self.settings.max_attempts,
                        schema_retry_seconds=300.0,
                    )
                    for row in rows
                    if row["kind"] in self.deliverers
                )
            )
            completions = [completion for completion, _ in results]
            if completions:
                await self.store.complete(self.owner, completions)
            self.delivered += sum(c.status != "pending" for c in completions)
        finally:
            for row in rows:
                self._held.pop(row["id"], None)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.settings.lease_seconds / 3)
            try:
                await self.store.extend(
                    EFFECT_QUEUE,
                    list(self._held.items()),
                    owner=self.owner,
                    lease_seconds=self.settings.lease_seconds,
                )
            except Exception as exc:
                log.warning("heartbeat failed: %s", exc)

    async def _reconcile_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.reconcile_seconds)
            try:
                await reconcile(
                    self.store,
                    self.deliverers,
                    worker=f"reconciler:{self.owner}",
                    lease_seconds=self.settings.lease_seconds,
                    default_max_attempts=self.settings.max_attempts,
                )
                # As in poll mode: cancelled runs move on as their effects finish,
                # even where no worker of their agent runs.
                await self.store.advance_stopping_runs()
            except Exception:
                log.exception("reconcile round failed")
