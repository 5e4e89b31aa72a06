"""Exactly-once ``kafka.publish`` for ``read_committed`` consumers: a Kafka transaction per effect.

With ``transactional = true`` the deliverer publishes each effect's record in
its own Kafka transaction, under a transactional id that is stable for the
deliverer (``{transactional_id_prefix}.{kind}.{instance}``; ``instance``
defaults to the host name), so a restarted deliverer with the same identity
fences its predecessor: the broker aborts whatever transaction that one left
open and refuses its commits from then on.

The protocol of one attempt, and what a crash at each point leaves:

1. note ``{topic, partition, offset, transactional_id}`` on the effect (fenced by
   the attempt); crash before or here: nothing is in the topic;
2. begin, send, wait for the acknowledgement; crash here (``after_send``): the
   record is in the log inside an open transaction, invisible to
   ``read_committed`` consumers;
3. commit the Kafka transaction; crash here (``after_call``): the record is
   committed, the effect is still ``in_flight``;
4. record the completion in PostgreSQL (the daemon does, after ``deliver``
   returns); crash after it: nothing to repair.

After a crash the reconciler asks :meth:`KafkaDeliverer.lookup` once the
attempt's lease expired, whichever deliverer (and transactional id) runs it:

- it first fences the noted transactional id (``init_transactions`` under that
  id), unless it is this deliverer's own, already fenced at its start. That
  aborts a transaction the dead attempt left open and stops a paused zombie
  from committing it later, so the record's fate is settled;
- it then reads the partition from the noted offset with the control batches
  (commit and abort markers) and counts a record with the effect's key only
  when its producer's next marker is a commit. Found: ``succeeded`` with that
  offset, nothing resent. Not found: redelivered with the same key, in a new
  transaction. A record whose transaction has no marker yet makes the lookup
  fail; the reconciler asks again next round.

The read-back reads markers itself instead of trusting the broker's
``read_committed`` fetch because a broker may not send the list of aborted
transactions: Tansu 0.6 (the test broker) writes the markers but sends no
list, so kafka-python's ``read_committed`` consumers there return records of
aborted transactions. With such a broker this mode still keeps the topic free
of committed duplicates, but consumers must filter aborted records (as
:func:`committed_records` does); with Apache Kafka they need only
``isolation_level="read_committed"``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kafka import KafkaProducer, TopicPartition
from kafka.net.compat import KafkaNetClient
from kafka.protocol.consumer import FetchRequest
from kafka.record import MemoryRecords

from deliverers.kafka_readback import IDEMPOTENCY_HEADER, REJECTED_ERRORS
from outbox.delivery import Delivery, Failed, NotApplied, Outcome, Retry, Succeeded, Unknown
from outbox.faults import crash_point

if TYPE_CHECKING:
    from deliverers.kafka import KafkaDeliverer
    from deliverers.kafka_record import KafkaRecord

__all__ = [
    "Marker",
    "RawRecord",
    "TransactionUndecided",
    "committed_records",
    "deliver_in_transaction",
    "fence",
    "find_committed",
    "read_back_committed",
    "scan_partition",
]

log = logging.getLogger(__name__)

#: Bytes asked for in one fetch of the read-back.
FETCH_BYTES = 1 << 20


class TransactionUndecided(Exception):
    """A record with the key is in a transaction with no commit or abort marker yet."""


@dataclass(frozen=True)
class RawRecord:
    """One data record as stored, with what decides its visibility."""

    offset: int
    producer_id: int
    transactional: bool
    headers: tuple[tuple[str, bytes], ...]
    value: bytes | None


@dataclass(frozen=True)
class Marker:
    """A transaction's commit or abort marker (a control batch)."""

    offset: int
    producer_id: int
    commit: bool


def scan_partition(
    bootstrap_servers: str,
    tp: TopicPartition,
    start: int,
    end: int,
    *,
    timeout_ms: int = 10_000,
    **client: Any,
) -> Iterator[RawRecord | Marker]:
    """Every record and transaction marker of ``tp`` from ``start`` to ``end`` (the high watermark).

    A raw fetch (read_uncommitted, control batches kept): the consumer API
    drops the markers, and they are what says which records are committed.
    """
    if start >= end:
        return
    net = KafkaNetClient(bootstrap_servers=bootstrap_servers, **client)
    try:
        node = net.least_loaded_node(bootstrap_fallback=True)
        offset = start
        while offset < end:
            partition = FetchRequest.FetchTopic.FetchPartition(
                partition=tp.partition,
                fetch_offset=offset,
                partition_max_bytes=FETCH_BYTES,
                log_start_offset=-1,
                current_leader_epoch=-1,
            )
            request = FetchRequest(
                replica_id=-1,
                # Tansu 0.6 answers max_wait_ms=0 with no partitions at all.
                max_wait_ms=100,
                min_bytes=0,
                max_bytes=FETCH_BYTES,
                isolation_level=0,
                topics=[FetchRequest.FetchTopic(topic=tp.topic, partitions=[partition])],
                min_version=4,
                max_version=11,
            )
            response = net.send_and_receive(node, request, timeout_ms=timeout_ms)
            if not response.responses or not response.responses[0].partitions:
                raise RuntimeError(f"no data for {tp.topic}[{tp.partition}] at {offset} < {end}")
            data = response.responses[0].partitions[0]
            if data.error_code:
                raise RuntimeError(f"fetch of {tp.topic}[{tp.partition}] failed: {data.error_code}")
            records = MemoryRecords(data.records)
            before = offset
            while (batch := records.next_batch()) is not None:
                if batch.is_control_batch:
                    control = next(iter(batch))
                    if batch.base_offset >= offset:
                        yield Marker(batch.base_offset, batch.producer_id, not control.abort)
                else:
                    for record in batch:
                        if offset <= record.offset < end:
                            yield RawRecord(
                                record.offset,
                                batch.producer_id,
                                bool(batch.is_transactional),
                                tuple(record.headers or ()),
                                record.value,
                            )
                offset = max(offset, batch.next_offset)
            if offset == before:
                # Never "not found" on a short read: the lookup fails and is asked again.
                raise RuntimeError(f"{tp.topic}[{tp.partition}]: nothing at {offset} < {end}")
    finally:
        net.close()


def committed_records(items: Iterator[RawRecord | Marker]) -> tuple[list[RawRecord], bool]:
    """The records a correct ``read_committed`` consumer sees, and whether one is still open.

    A transactional record counts when its producer's next marker is a commit;
    a non-transactional one always does.
    """
    pending: dict[int, list[RawRecord]] = {}
    visible: list[RawRecord] = []
    for item in items:
        if isinstance(item, Marker):
            held = pending.pop(item.producer_id, [])
            if item.commit:
                visible.extend(held)
        elif item.transactional:
            pending.setdefault(item.producer_id, []).append(item)
        else:
            visible.append(item)
    visible.sort(key=lambda r: r.offset)
    return visible, any(pending.values())


def find_committed(
    items: Iterator[RawRecord | Marker], idempotency_key: str, header: str, note: dict[str, Any]
) -> Succeeded | NotApplied:
    """Settle a lookup: a committed record with the key, none, or undecided (raises)."""
    wanted = idempotency_key.encode()
    visible, open_left = committed_records(items)
    for record in visible:
        if (header, wanted) in record.headers:
            return Succeeded(
                {
                    "topic": note["topic"],
                    "partition": int(note["partition"]),
                    "offset": record.offset,
                    "looked_up": True,
                }
            )
    if open_left:
        # The open one may hold the key (a fence failed or a zombie under another id):
        # deciding now could resend a record that is committed a moment later.
        raise TransactionUndecided(
            f"an open transaction in {note['topic']}[{note['partition']}] after offset "
            f"{note['offset']}; asking again later"
        )
    return NotApplied()


_fence_lock = threading.Lock()


def fence(settings: dict[str, Any], transactional_id: str) -> None:
    """Take over ``transactional_id``: the broker aborts its open transaction and fences its holder.

    ``settings`` are the deliverer's producer settings (connection, security).
    """
    with _fence_lock:
        producer = KafkaProducer(**{**settings, "transactional_id": transactional_id})
        try:
            producer.init_transactions()
        finally:
            producer.close(timeout=5)
    log.info("fenced Kafka transactional id %s before reading back", transactional_id)


def _run_bounded(call: Any, timeout: float, name: str) -> None:
    """``call()`` on a helper thread, waiting at most ``timeout`` seconds.

    kafka-python's ``commit_transaction`` and ``abort_transaction`` wait with no
    time limit (a fenced producer's commit can wait forever); the delivery must not.
    """
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # handed back to the delivery's thread
            outcome.append(exc)
        else:
            outcome.append(None)

    helper = threading.Thread(target=run, name=name, daemon=True)
    helper.start()
    helper.join(timeout)
    if not outcome:
        raise TimeoutError(f"{name} gave no verdict within {timeout:g}s")
    if outcome[0] is not None:
        raise outcome[0]


@dataclass
class _Slot:
    """One delivery waiting for the transaction that carries its record."""

    record: KafkaRecord
    delivery: Delivery
    partition: int | None
    outcome: Outcome | None = None


def deliver_in_transaction(
    deliverer: KafkaDeliverer,
    producer: Any,
    record: KafkaRecord,
    delivery: Delivery,
    partition: int | None,
) -> Outcome:
    """Publish ``record`` in a transaction and commit it (steps 2 and 3 of the protocol).

    A producer runs one transaction at a time, so concurrent deliveries share
    one (group commit): the first to find no transaction running takes every
    waiting record into the next one; the others wait for its verdict. Each
    record's outcome is its own (one refused record fails alone; the rest of
    that transaction is aborted and retried).
    """
    slot = _Slot(record, delivery, partition)
    cond = deliverer._txn_cond
    with cond:
        deliverer._txn_queue.append(slot)
        while slot.outcome is None:
            if deliverer._txn_running:
                cond.wait()
                continue
            deliverer._txn_running = True
            batch, deliverer._txn_queue = deliverer._txn_queue, []
            cond.release()
            try:
                outcomes = _one_transaction(deliverer, producer, batch)
            except Exception as exc:  # whatever it was, the read-back can tell
                deliverer._retire(producer, f"{type(exc).__name__}: {exc}")
                outcomes = [Unknown(f"transaction failed: {type(exc).__name__}: {exc}")] * len(
                    batch
                )
            finally:
                cond.acquire()
                deliverer._txn_running = False
            for waiting, outcome in zip(batch, outcomes, strict=True):
                waiting.outcome = outcome
            cond.notify_all()
    return slot.outcome


def _one_transaction(deliverer: KafkaDeliverer, producer: Any, batch: list[_Slot]) -> list[Outcome]:
    from kafka import errors as kafka_errors

    wait = deliverer.ack_wait
    refused: dict[int, Outcome] = {}

    def abandon(reason: str) -> list[Outcome]:
        # Not committed by this producer, and never will be: aborted now, or by the
        # broker when the next producer under this id fences this one.
        try:
            _run_bounded(producer.abort_transaction, wait, "kafka-abort")
        except Exception:
            deliverer._retire(producer, reason)
        return [refused.get(i, Retry(f"not committed: {reason}")) for i in range(len(batch))]

    try:
        producer.begin_transaction()
    except kafka_errors.KafkaError as exc:
        deliverer._retire(producer, f"{type(exc).__name__}: {exc}")
        return [Retry(f"not sent: {type(exc).__name__}: {exc}")] * len(batch)
    futures: dict[int, Any] = {}
    for i, slot in enumerate(batch):
        try:
            futures[i] = producer.send(
                slot.record.topic,
                value=slot.record.value_bytes(),
                key=None if slot.record.key is None else slot.record.key.encode(),
                headers=deliverer.headers(slot.record, slot.delivery),
                partition=slot.partition,
            )
        except (REJECTED_ERRORS, ValueError) as exc:  # type: ignore[misc]
            refused[i] = Failed(f"refused before sending: {exc}")
        except kafka_errors.KafkaError as exc:
            deliverer._retire(producer, f"{type(exc).__name__}: {exc}")
            return abandon(f"{type(exc).__name__}: {exc}")
    if not futures:
        return abandon("every record was refused")
    metadata: dict[int, Any] = {}
    failure: str | None = None
    for i, future in futures.items():
        try:
            metadata[i] = future.get(timeout=wait)
        except REJECTED_ERRORS as exc:
            refused[i] = Failed(f"rejected by the broker: {exc}")
            failure = failure or f"another record was rejected: {exc}"
        except Exception as exc:
            failure = failure or f"no acknowledgement: {type(exc).__name__}: {exc}"
    if failure is not None:
        deliverer._retire(producer, failure)
        return abandon(failure)
    crash_point("after_send", deliverer.kind)
    try:
        _run_bounded(producer.commit_transaction, wait, "kafka-commit")
    except (kafka_errors.ProducerFencedError, kafka_errors.InvalidProducerEpochError) as exc:
        # Fenced before the commit: the fencer's init_transactions aborted it.
        deliverer._retire(producer, f"fenced: {exc}")
        return [refused.get(i, Retry(f"not committed: fenced: {exc}")) for i in range(len(batch))]
    except Exception as exc:
        # The commit may or may not have been applied: the read-back decides.
        reason = f"transaction commit gave no verdict: {type(exc).__name__}: {exc}"
        deliverer._retire(producer, reason)
        return [refused.get(i, Unknown(reason)) for i in range(len(batch))]
    return [
        refused.get(i)
        or Succeeded(
            {
                "topic": metadata[i].topic,
                "partition": metadata[i].partition,
                "offset": metadata[i].offset,
            }
        )
        for i in range(len(batch))
    ]


def read_back_committed(deliverer: KafkaDeliverer, delivery: Delivery) -> Succeeded | NotApplied:
    """The transactional lookup: fence the attempt's transactional id, then read markers back."""
    note: dict[str, Any] = delivery.note
    noted_id = note.get("transactional_id")
    own = noted_id == deliverer.transactional_id and deliverer._producer is not None
    if isinstance(noted_id, str) and not own:
        fence(deliverer.producer_settings(), noted_id)
    tp = TopicPartition(note["topic"], int(note["partition"]))
    consumer = deliverer._consumer()
    try:
        end = int(consumer.end_offsets([tp])[tp])  # read_uncommitted: the high watermark
    finally:
        consumer.close()
    security = {
        k: v
        for k, v in deliverer.config.producer.items()
        if k.startswith(("security_", "sasl_", "ssl_"))
    }
    items = scan_partition(
        deliverer.config.bootstrap_servers,
        tp,
        int(note["offset"]),
        end,
        timeout_ms=max(deliverer.config.max_block_ms, 1000),
        **security,
    )
    return find_committed(items, delivery.idempotency_key, IDEMPOTENCY_HEADER, note)
