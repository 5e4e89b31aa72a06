"""``kafka.publish``: one record per effect to a Kafka topic, the idempotency key in its headers.

Every record carries the headers ``idempotency-key``, ``run-id`` (when the
effect belongs to a run) and ``effect-id``, plus the payload's own headers and
its W3C ``traceparent``. The producer is kafka-python's, with
``enable_idempotence=True`` and ``acks="all"``: its own internal retries never
duplicate a record.

The guarantee. An effect is ``succeeded`` only after the broker acknowledged
the record (all in-sync replicas have it); ``result`` holds its topic,
partition and offset. What happens when no acknowledgement comes:

- nothing was sent (no broker reachable, no topic metadata or no buffer space
  within ``max_block_ms``): ``Retry``, which is always safe;
- the broker refused the record itself (too large, topic not authorized,
  invalid record): ``Failed``, since sending it again cannot help;
- the record was handed to the producer but its acknowledgement timed out or
  the connection broke: the record may or may not be in the log. A Kafka
  broker does not dedup across producer sessions, so resending can write a
  second record. With the default ``idempotent = false`` the effect goes to
  ``unknown`` for an operator. A deployment whose consumers dedup (see
  :class:`~deliverers.kafka_dedup.DedupConsumer`) declares ``idempotent = true`` and the effect is
  retried with the same key.

So a crash or timeout mid-publish may leave a duplicate record in the topic
with the same ``idempotency-key`` header; consumers that must apply each effect
once use :class:`~deliverers.kafka_dedup.DedupConsumer`, which records the keys it has processed in
``outbox_consumed_keys`` in the same PostgreSQL transaction as the consumer's
own writes.

With ``transactional = true``, ``read_committed`` consumers see each effect
once even after a crash at any point (the protocol: :mod:`deliverers.kafka_txn`).

After such an ambiguous failure the producer is replaced by a fresh one: an
idempotent kafka-python 3.0 producer whose sent batch expired stops sending
for good, and one whose broker lost its producer state (a restart of a
broker without durable storage) fails fatally; a new producer recovers both.
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import socket
import threading
import time
from typing import Any, ClassVar

from kafka import KafkaProducer
from kafka import errors as kafka_errors
from pydantic import BaseModel, Field, field_validator, model_validator

from deliverers.kafka_readback import (
    IDEMPOTENCY_HEADER,
    REJECTED_ERRORS,
    choose_partition,
    find_record,
)
from deliverers.kafka_record import TRACEPARENT_HEADER, KafkaRecord
from deliverers.kafka_txn import deliver_in_transaction, read_back_committed
from outbox.delivery import (
    Deliverer,
    DelivererConfig,
    Delivery,
    Failed,
    NotApplied,
    Outcome,
    Retry,
    Succeeded,
    Unknown,
)
from outbox.delivery.relay import close_producer

__all__ = [
    "KafkaConfig",
    "KafkaDeliverer",
    "KafkaRecord",
]

log = logging.getLogger(__name__)

# Producer settings the deliverer owns (the guarantee depends on them) or that have own fields.
OWNED_PRODUCER_SETTINGS = frozenset(
    {
        "bootstrap_servers",
        "client_id",
        "enable_idempotence",
        "acks",
        "transactional_id",
        "key_serializer",
        "value_serializer",
        "request_timeout_ms",
        "linger_ms",
        "max_block_ms",
        "delivery_timeout_ms",
        "transaction_timeout_ms",
    }
)
# How much longer than delivery_timeout_ms a delivery waits for the producer's verdict.
ACK_WAIT_MARGIN_SECONDS = 2.0


class KafkaConfig(DelivererConfig):
    """Where and how to publish."""

    #: ``host:port`` of one or more brokers, comma-separated.
    bootstrap_servers: str = "localhost:9092"
    #: The producer's client id (in broker logs and quotas).
    client_id: str = "agent-outbox"
    #: When set, only these topics (``fnmatch`` patterns, case-sensitive); others fail.
    allowed_topics: list[str] | None = None
    #: How long one produce request may wait for the broker's answer.
    request_timeout_ms: int = Field(default=30_000, ge=1)
    #: How long the producer waits to batch records before sending.
    linger_ms: int = Field(default=0, ge=0)
    #: How long to wait for a connection, topic metadata or buffer space before sending.
    max_block_ms: int = Field(default=10_000, ge=1)
    #: Upper bound from send to acknowledgement (default: request_timeout_ms + linger_ms).
    delivery_timeout_ms: int | None = Field(default=None, ge=1)
    #: Further kafka-python ``KafkaProducer`` settings (compression_type, security, ...).
    producer: dict[str, Any] = Field(default_factory=dict)
    #: Read-back (``deliverers.kafka_readback``): note the partition's end offset before
    #: each send, so that after a crash the reconciler reads the partition back instead
    #: of asking an operator. Costs one offsets request and one PostgreSQL write per send.
    read_back: bool = True
    #: The longest range a read-back scans; beyond it the lookup fails (asked again later).
    read_back_max_records: int = Field(default=100_000, ge=1)
    #: How long a read-back may take in all; beyond it the lookup fails (asked again later).
    read_back_timeout_seconds: float = Field(default=30.0, gt=0)
    #: One Kafka transaction per effect, committed before the completion is recorded, so
    #: ``read_committed`` consumers see each effect once (``deliverers.kafka_txn``). Off by
    #: default: Tansu 0.6 does not tell consumers which transactions aborted.
    transactional: bool = False
    #: The transactional id is ``{prefix}.{kind}.{instance}``: stable across restarts.
    transactional_id_prefix: str = Field(
        default="agent-outbox", min_length=1, max_length=100, pattern=r"^[A-Za-z0-9._-]+$"
    )
    #: This deliverer's identity in the transactional id (default: the host name). Give each
    #: concurrently running deliverer its own; a restart keeps it, which fences its predecessor.
    instance: str | None = Field(
        default=None, min_length=1, max_length=100, pattern=r"^[A-Za-z0-9._:-]+$"
    )
    #: How long the broker keeps a transaction open before aborting it itself.
    transaction_timeout_ms: int = Field(default=60_000, ge=1000)

    @field_validator("producer")
    @classmethod
    def _producer_settings(cls, value: dict[str, Any]) -> dict[str, Any]:
        for name in value:
            if name in OWNED_PRODUCER_SETTINGS:
                raise ValueError(f"{name!r} is set by the deliverer or its own field")
            if name not in KafkaProducer.DEFAULT_CONFIG:
                raise ValueError(f"{name!r} is not a kafka-python KafkaProducer setting")
        if value.get("retries", 1) == 0:
            raise ValueError("retries=0 conflicts with the idempotent producer")
        if value.get("max_in_flight_requests_per_connection", 1) > 5:
            raise ValueError("max_in_flight_requests_per_connection > 5 breaks idempotence")
        return value

    @model_validator(mode="after")
    def _delivery_timeout(self) -> KafkaConfig:
        if (
            self.delivery_timeout_ms is not None
            and self.delivery_timeout_ms < self.request_timeout_ms + self.linger_ms
        ):
            raise ValueError("delivery_timeout_ms must be at least request_timeout_ms + linger_ms")
        return self

    @property
    def effective_delivery_timeout_ms(self) -> int:
        """The producer's delivery timeout."""
        if self.delivery_timeout_ms is not None:
            return self.delivery_timeout_ms
        return self.request_timeout_ms + self.linger_ms


class _NotConnected(Exception):
    """No producer could be created (no broker answered within ``max_block_ms``)."""


class KafkaDeliverer(Deliverer[KafkaConfig]):
    """Publishes one record per effect; not idempotent by default (Kafka cannot dedup keys)."""

    default_idempotent: ClassVar[bool] = False
    payload_model: ClassVar[type[BaseModel] | None] = KafkaRecord

    def __init__(self, kind: str, config: DelivererConfig | None = None) -> None:
        super().__init__(kind, config)
        #: Seconds a delivery waits for the producer's verdict (a backstop; it expires first).
        self.ack_wait = self.config.effective_delivery_timeout_ms / 1000 + ACK_WAIT_MARGIN_SECONDS
        self._lock = threading.Lock()
        self._producer: Any = None
        self._connect_failure: tuple[str, float] | None = None
        self._closers: list[threading.Thread] = []
        # One consumer answers "end offset now?" before each send (it is not thread-safe).
        self._offsets_lock = threading.Lock()
        self._offsets: Any = None
        # A transactional producer runs one transaction at a time: deliveries queue for it.
        self._txn_cond = threading.Condition()
        self._txn_queue: list[Any] = []
        self._txn_running = False

    @property
    def transactional_id(self) -> str | None:
        """``{prefix}.{kind}.{instance}`` with ``transactional``, else None."""
        if not self.config.transactional:
            return None
        instance = self.config.instance or socket.gethostname()
        return f"{self.config.transactional_id_prefix}.{self.kind}.{instance}"

    # -- the producer ---------------------------------------------------------------

    def producer_settings(self) -> dict[str, Any]:
        """Settings the ``KafkaProducer`` is created with."""
        config = self.config
        return {
            "bootstrap_timeout_ms": config.max_block_ms,
            **config.producer,
            "bootstrap_servers": config.bootstrap_servers,
            "client_id": config.client_id,
            "enable_idempotence": True,
            "acks": "all",
            "request_timeout_ms": config.request_timeout_ms,
            "linger_ms": config.linger_ms,
            "max_block_ms": config.max_block_ms,
            "delivery_timeout_ms": config.effective_delivery_timeout_ms,
            **(
                {
                    "transactional_id": self.transactional_id,
                    "transaction_timeout_ms": config.transaction_timeout_ms,
                }
                if config.transactional
                else {}
            ),
        }

    def _current_producer(self) -> Any:
        """The shared producer, created on first use (thread-safe)."""
        waiting_since = time.monotonic()
        with self._lock:
            if self._producer is not None:
                return self._producer
            failure = self._connect_failure
            if failure is not None and failure[1] >= waiting_since:
                # Another thread failed to connect while this one waited: do not queue up
                # one more max_block_ms wait per delivery.
                raise _NotConnected(failure[0])
            try:
                self._producer = self._new_producer()
            except kafka_errors.KafkaError as exc:
                reason = f"{type(exc).__name__}: {exc}"
                self._connect_failure = (reason, time.monotonic())
                raise _NotConnected(reason) from exc
            self._connect_failure = None
            return self._producer

    def _new_producer(self) -> Any:
        """A connected ``KafkaProducer``; raises ``KafkaError`` when no broker answers.

        kafka-python 3.0 leaves the network client it made open when the
        constructor fails (no broker within ``bootstrap_timeout_ms``): close it here.
        """
        settings = self.producer_settings()
        make_client = settings.pop("kafka_client", KafkaProducer.DEFAULT_CONFIG["kafka_client"])
        clients: list[Any] = []

        def client_factory(**configs: Any) -> Any:
            client = make_client(**configs)
            clients.append(client)
            return client

        producer = None
        try:
            producer = KafkaProducer(**settings, kafka_client=client_factory)
            if self.config.transactional:
                # Fences this identity's predecessor: its open transaction is aborted.
                producer.init_transactions()
            return producer
        except BaseException:
            if producer is not None:
                producer.close(timeout=0)
            for client in clients:
                try:
                    client.close()
                except Exception:
                    log.debug("closing a half-made Kafka client failed", exc_info=True)
            raise

    def _retire(self, producer: Any, reason: str) -> None:
        """Replace ``producer`` on the next delivery; close it in the background.

        Other deliveries still waiting on it get its verdict (or a forced close
        after ``ack_wait``), so a healthy producer's records are not cut off.
        """
        with self._lock:
            if self._producer is not producer:
                return  # another delivery retired it already
            self._producer = None
            closer = threading.Thread(
                target=close_producer,
                args=(producer, self.ack_wait),
                name=f"kafka-close-{self.kind}",
                daemon=True,
            )
            self._closers = [t for t in self._closers if t.is_alive()]
            self._closers.append(closer)
            closer.start()
        log.warning("kind %s: replacing the Kafka producer after: %s", self.kind, reason)

    # -- delivery ---------------------------------------------------------------------

    def _refusal(self, topic: str) -> str | None:
        allowed = self.config.allowed_topics
        if allowed is not None and not any(fnmatch.fnmatchcase(topic, p) for p in allowed):
            return f"topic {topic!r} is not in allowed_topics of kind {self.kind!r}"
        return None

    def headers(self, record: KafkaRecord, delivery: Delivery) -> list[tuple[str, bytes]]:
        """The record's headers as sent: the outbox's three, the payload's, the trace context."""
        headers = [(IDEMPOTENCY_HEADER, delivery.idempotency_key.encode())]
        if delivery.run_id is not None:
            headers.append(("run-id", str(delivery.run_id).encode()))
        headers.append(("effect-id", str(delivery.effect_id).encode()))
        headers.extend((name, value.encode()) for name, value in record.headers.items())
        if record.traceparent is not None:
            headers.append((TRACEPARENT_HEADER, record.traceparent.encode()))
        return headers

    def deliver(self, delivery: Delivery) -> Outcome:
        """Publish once and wait for the broker's acknowledgement (blocking; run in a thread)."""
        record: KafkaRecord = delivery.payload
        refusal = self._refusal(record.topic)
        if refusal is not None:
            return Failed(refusal)
        try:
            producer = self._current_producer()
        except _NotConnected as exc:
            return Retry(f"not sent: no broker available: {exc}")
        partition = record.partition
        if self.has_lookup and delivery.notes is not None:
            try:
                partition, offset = self._before_send(producer, record, delivery)
            except (kafka_errors.KafkaError, ValueError) as exc:
                return Retry(f"not sent: the partition's offset is unknown: {exc}")
            note: dict[str, Any] = {"topic": record.topic, "partition": partition, "offset": offset}
            if self.transactional_id is not None:
                note["transactional_id"] = self.transactional_id
            if not delivery.notes.write_blocking(note):
                return Retry("not sent: this attempt is no longer this deliverer's")
        if self.config.transactional:
            return deliver_in_transaction(self, producer, record, delivery, partition)
        try:
            future = producer.send(
                record.topic,
                value=record.value_bytes(),
                key=None if record.key is None else record.key.encode(),
                headers=self.headers(record, delivery),
                partition=partition,
            )
        except REJECTED_ERRORS as exc:
            return Failed(f"refused before sending: {exc}")
        except ValueError as exc:  # e.g. a partition the topic does not have
            return Failed(f"refused before sending: {exc}")
        except kafka_errors.KafkaError as exc:
            # No metadata or buffer space within max_block_ms, or the producer was closed
            # by a concurrent retire: the record never left this process.
            return Retry(f"not sent: {type(exc).__name__}: {exc}")
        try:
            metadata = future.get(timeout=self.ack_wait)
        except Exception as exc:  # handed to the producer: whatever went wrong is ambiguous
            return self._unacknowledged(producer, future, exc)
        return Succeeded(
            {"topic": metadata.topic, "partition": metadata.partition, "offset": metadata.offset}
        )

    # -- read-back -------------------------------------------------------------------

    def _consumer(self) -> Any:
        from kafka import KafkaConsumer

        settings = {
            k: v
            for k, v in self.config.producer.items()
            if k.startswith(("security_", "sasl_", "ssl_")) and k in KafkaConsumer.DEFAULT_CONFIG
        }
        # An offsets request waits no longer than a send may block: a broker that does
        # not answer makes the attempt a plain retry (nothing was sent).
        timeout = max(self.config.max_block_ms, 1000)
        if "bootstrap_timeout_ms" in KafkaConsumer.DEFAULT_CONFIG:
            settings["bootstrap_timeout_ms"] = timeout
        return KafkaConsumer(
            bootstrap_servers=self.config.bootstrap_servers,
            client_id=f"{self.config.client_id}-read-back",
            group_id=None,
            enable_auto_commit=False,
            request_timeout_ms=timeout,
            **settings,
        )

    def _before_send(
        self, producer: Any, record: KafkaRecord, delivery: Delivery
    ) -> tuple[int, int]:
        """The partition this record goes to and that partition's end offset now."""
        from kafka import TopicPartition

        partition = record.partition
        if partition is None:
            partitions = producer.partitions_for(record.topic)
            key = None if record.key is None else record.key.encode()
            partition = choose_partition(set(partitions or ()), key, delivery.idempotency_key)
        tp = TopicPartition(record.topic, partition)
        with self._offsets_lock:
            if self._offsets is None:
                self._offsets = self._consumer()
            return partition, int(self._offsets.end_offsets([tp])[tp])

    def lookup(self, delivery: Delivery) -> Any:
        """Read the noted partition back for a record with the key (blocking; run in a thread).

        An attempt with no note never sent (the note is written before every send).
        """
        if not self.config.read_back:
            raise NotImplementedError("read_back is off for this kind")
        if not isinstance(delivery.note, dict):
            return NotApplied()
        if self.config.transactional or "transactional_id" in delivery.note:
            # By the note too: only the markers tell an aborted record, whatever the config now.
            return read_back_committed(self, delivery)
        consumer = self._consumer()
        try:
            return find_record(
                consumer,
                delivery.note,
                delivery.idempotency_key,
                header=IDEMPOTENCY_HEADER,
                max_records=self.config.read_back_max_records,
                timeout_seconds=self.config.read_back_timeout_seconds,
            )
        finally:
            consumer.close()

    @property
    def has_lookup(self) -> bool:
        """With ``read_back`` (the default), for a kind whose consumers do not dedup."""
        return self.config.read_back and not self.idempotent

    def _unacknowledged(self, producer: Any, future: Any, exc: Exception) -> Outcome:
        if isinstance(exc, REJECTED_ERRORS):
            return Failed(f"rejected by the broker: {exc}")
        if future.is_done:
            reason = f"no acknowledgement: {type(exc).__name__}: {exc}"
        else:
            reason = f"no verdict from the producer within {self.ack_wait:g}s"
        self._retire(producer, reason)
        reason += " (the record may have been written)"
        # Kafka cannot dedup a resend: only consumers that dedup make a retry safe.
        return Retry(reason) if self.idempotent else Unknown(reason)

    def close(self) -> None:
        """Flush and close the producer (and any being replaced)."""
        with self._lock:
            producer, self._producer = self._producer, None
            closers, self._closers = self._closers, []
        with self._offsets_lock:
            offsets, self._offsets = self._offsets, None
        if offsets is not None:
            offsets.close()
        if producer is not None:
            close_producer(producer, self.ack_wait)
        for closer in closers:
            closer.join()

    async def aclose(self) -> None:
        """Close without blocking the daemon's event loop while the producer flushes."""
        await asyncio.to_thread(self.close)
