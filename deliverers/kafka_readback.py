"""Read-back for ``kafka.publish``: is a record with this idempotency key in the log.

Kafka cannot dedup a resend across producer sessions, so after a crash between
the send and its record the only safe question is "is it in the log?". To make
that answerable, the deliverer fixes the record's partition itself and, before
every send, notes on the effect (fenced by the attempt) the topic, the
partition and that partition's end offset. A record sent after the note can
only be at or past that offset, so the lookup scans a bounded range: from the
noted offset to the partition's end now, at most ``read_back_max_records``
records, for one whose ``idempotency-key`` header is the key.

- a record with the key is found: applied (its offset is recorded);
- the scan reached the end without it: not applied, redelivered with the same key;
- the attempt has no note: the deliverer notes before every send, so it never sent;
- the scan was cut short (the bound, the time limit): the lookup fails and the
  reconciler asks again next round; nothing is resent meanwhile.

The partition is the payload's ``partition``, else the producer's own choice
for a key (murmur2, as the Java client), else, for a record without a key, one
chosen from the idempotency key (a hash), so that every attempt of an effect
goes to the same partition.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from kafka import KafkaConsumer, TopicPartition
from kafka import errors as kafka_errors
from kafka.partitioner.default import murmur2

from outbox.delivery import NotApplied, Succeeded

#: The header that carries an effect's idempotency key on every record we write.
IDEMPOTENCY_HEADER = "idempotency-key"
# The broker refused the record itself: nothing was written, resending cannot help.
REJECTED_ERRORS: tuple[type[Exception], ...] = (
    kafka_errors.MessageSizeTooLargeError,
    kafka_errors.RecordListTooLargeError,
    kafka_errors.InvalidTopicError,
    kafka_errors.TopicAuthorizationFailedError,
    kafka_errors.InvalidRecordError,
    kafka_errors.InvalidTimestampError,
    kafka_errors.PolicyViolationError,
    kafka_errors.UnsupportedForMessageFormatError,
)

__all__ = ["IDEMPOTENCY_HEADER", "REJECTED_ERRORS", "choose_partition", "find_record"]


def choose_partition(partitions: set[int], key: bytes | None, idempotency_key: str) -> int:
    """The partition a record goes to: the key's (murmur2, as the producer), else the effect's."""
    ordered = sorted(partitions)
    if not ordered:
        raise ValueError("the topic has no partitions")
    if key is not None:
        return ordered[(int(murmur2(key)) & 0x7FFFFFFF) % len(ordered)]
    digest = hashlib.sha256(idempotency_key.encode()).digest()
    return ordered[int.from_bytes(digest[:8], "big") % len(ordered)]


def find_record(
    consumer: KafkaConsumer,
    note: dict[str, Any],
    idempotency_key: str,
    *,
    header: str,
    max_records: int,
    timeout_seconds: float,
) -> Succeeded | NotApplied:
    """Scan the noted partition from the noted offset for the key (see the module docstring)."""
    tp = TopicPartition(note["topic"], int(note["partition"]))
    start = int(note["offset"])
    consumer.assign([tp])
    end = consumer.end_offsets([tp])[tp]
    if end <= start:
        return NotApplied()
    if end - start > max_records:
        raise TimeoutError(
            f"{end - start} records after the noted offset {start} of {tp.topic}[{tp.partition}]; "
            f"read_back_max_records is {max_records}"
        )
    consumer.seek(tp, start)
    wanted = idempotency_key.encode()
    deadline = time.monotonic() + timeout_seconds
    while consumer.position(tp) < end:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"read-back of {tp.topic}[{tp.partition}] took over {timeout_seconds}s"
            )
        batch = consumer.poll(timeout_ms=500, max_records=500)
        for record in batch.get(tp, []):
            if record.offset >= end:
                break
            if any(name == header and value == wanted for name, value in record.headers or []):
                return Succeeded(
                    {
                        "topic": tp.topic,
                        "partition": tp.partition,
                        "offset": record.offset,
                        "looked_up": True,
                    }
                )
    return NotApplied()
