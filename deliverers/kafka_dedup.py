"""Consumers that apply each idempotency key once: the consumer side of ``kafka.publish``.

A Kafka broker does not dedup across producer sessions, and a consumer sees a
record again after a crash between processing and committing its offset.
:class:`DedupConsumer` records each processed key in ``outbox_consumed_keys``
in the same PostgreSQL transaction as the consumer's own writes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kafka import errors as kafka_errors

from deliverers.kafka_readback import IDEMPOTENCY_HEADER
from outbox.storage import Connection, Engine
from outbox.storage.store import mark_consumed

__all__ = ["DedupConsumer", "DedupStats"]

log = logging.getLogger(__name__)


@dataclass
class DedupStats:
    """What one :meth:`DedupConsumer.process` call did."""

    #: Records the poll returned.
    polled: int = 0
    #: Records passed to ``handle`` whose transaction committed.
    processed: int = 0
    #: Records skipped because their key was processed before.
    duplicates: int = 0
    #: Of ``processed``: records without an ``idempotency-key`` header (no dedup possible).
    unkeyed: int = 0
    #: Offsets were committed to Kafka after the batch.
    committed: bool = False


class DedupConsumer:
    """Process each idempotency key once per consumer group, in the consumer's own transaction.

    Kafka delivers at least once: a record is redelivered when the consumer
    crashes (or its group rebalances) between processing and committing its
    offset, and ``kafka.publish`` may have written an effect twice (a retry
    after an acknowledgement that never came). Both copies carry the same
    ``idempotency-key`` header. For each record, ``process`` opens ONE
    PostgreSQL transaction, inserts ``(group, key)`` into
    ``outbox_consumed_keys`` (``ON CONFLICT DO NOTHING``) and, only if the row
    is new, calls ``handle(record, connection)``; the "seen" mark and
    ``handle``'s writes commit together or not at all. Kafka offsets are
    committed only after every transaction of the batch committed.

    What a consumer must do, and why:

    1. Create the ``KafkaConsumer`` with ``enable_auto_commit=False`` and a
       ``group_id`` (refused otherwise): auto-commit could commit the offset of
       a record whose transaction then rolled back, and that record would
       never be seen again.
    2. Make every consequence of a record a write on the ``connection`` passed
       to ``handle`` (SQLAlchemy Core or ``connection.exec_driver_sql``). That
       is what makes processing exactly-once. Anything else ``handle`` does (an
       HTTP call, a file, a second database) is outside the transaction and
       may happen again if the process dies before the commit: give it the
       record's ``idempotency-key`` and let it dedup.
    3. Do not commit, roll back or close ``connection`` in ``handle``, and do
       not commit offsets yourself. To refuse a record, raise: its transaction
       rolls back (its key is not marked), the consumer is moved back to it,
       and the exception propagates; the next ``process`` sees the record
       again.
    4. Use one stable ``group`` name per logical consumer (usually its Kafka
       ``group_id``): keys are deduplicated within a group, so two groups
       reading one topic each process every key once.
    5. Use the outbox's database (schema migration 0003 creates the table),
       or any database where ``outbox migrate`` ran.

    Records without an ``idempotency-key`` header are processed every time
    they are delivered (at least once). Rows of ``outbox_consumed_keys`` may be
    deleted once no copy of their key can arrive any more (older than the
    topic's retention plus the longest time an effect can be retried).
    """

    def __init__(
        self, consumer: Any, engine: Engine, group: str, *, header: str = IDEMPOTENCY_HEADER
    ) -> None:
        config = getattr(consumer, "config", {})
        if config.get("enable_auto_commit", False):
            raise ValueError(
                "the consumer must be created with enable_auto_commit=False: offsets are "
                "committed after the records' transactions"
            )
        if "group_id" in config and config["group_id"] is None:
            raise ValueError("the consumer needs a group_id to commit offsets")
        if not group:
            raise ValueError("group must be a non-empty name")
        self.consumer = consumer
        self.engine = engine
        self.group = group
        self.header = header

    def key_of(self, record: Any) -> str | None:
        """The record's idempotency key, or None when it has none."""
        for name, value in record.headers or ():
            if name == self.header and value is not None:
                return bytes(value).decode("utf-8", errors="replace")
        return None

    def process(
        self, handle: Callable[[Any, Connection], object], timeout_ms: int = 1000
    ) -> DedupStats:
        """Poll one batch, process each new key once, then commit the offsets."""
        stats = DedupStats()
        batch: dict[Any, list[Any]] = self.consumer.poll(timeout_ms=timeout_ms)
        for records in batch.values():
            stats.polled += len(records)
        if not stats.polled:
            return stats
        for partition, records in batch.items():
            for index, record in enumerate(records):
                try:
                    self._one(record, handle, stats)
                except BaseException:
                    self._rewind(batch, partition, index)
                    raise
        try:
            self.consumer.commit()
            stats.committed = True
        except kafka_errors.CommitFailedError as exc:
            # The group rebalanced: another member gets these records again and skips
            # every key committed above. Nothing is lost or processed twice.
            log.warning("offset commit of group %s failed: %s", self.group, exc)
        return stats

    def _one(
        self, record: Any, handle: Callable[[Any, Connection], object], stats: DedupStats
    ) -> None:
        key = self.key_of(record)
        with self.engine.begin() as connection:
            if key is not None and not mark_consumed(connection, self.group, key):
                stats.duplicates += 1
                return
            handle(record, connection)
        stats.processed += 1
        if key is None:
            stats.unkeyed += 1

    def _rewind(self, batch: dict[Any, list[Any]], failed: Any, index: int) -> None:
        """Move back to the first record not processed, in every partition of the batch."""
        seen_failed = False
        for partition, records in batch.items():
            if partition == failed:
                seen_failed = True
                self.consumer.seek(partition, records[index].offset)
            elif seen_failed:  # not started yet
                self.consumer.seek(partition, records[0].offset)
