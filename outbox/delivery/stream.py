"""Stream mode: a relay carries pending effects to Kafka; a Kafka source feeds the delivery daemon.

``outbox relay`` (:mod:`outbox.delivery.relay`) claims pending effects with the
same claim machinery as the poll deliverer (so per-key order holds: the next
effect of an ordering key is not claimed while one is undecided), straight
into ``dispatched``, and publishes each to the topic ``<prefix><kind>``, keyed
by ordering key (else run id). Several relays may run. A relay also
re-dispatches what nobody delivered within ``dispatch_ttl`` (a batch whose
relay died before publishing it among them), so a relay alone keeps its
promises.

``outbox deliver --from-kafka`` is the one :class:`~outbox.delivery.daemon.DeliveryDaemon`
with a :class:`KafkaSource`: for each batch of records it claims the named
effects that are still ``dispatched`` (a record for an effect already claimed
or finished is a redelivery: skipped), delivers them exactly as poll mode does
(same leases, per-kind caps, rate-limit pauses, retry policy, grace period and
metrics), and commits a partition's offset only up to its oldest record
whose fate is open (:mod:`outbox.delivery.offsets`): one whose claim has not
succeeded, one an effect was claimed through whose outcome is not recorded,
or a copy of such an effect. A consumer killed with ``kill -9`` loses
nothing: its records come again to the group, and its claimed attempts are
resolved by the reconciler like any lost attempt.

The source never waits on the broker where it would stall delivery or a
stop: commits are asynchronous (one at a time, sent before each read), a read
is a poll cut into short slices that :meth:`KafkaSource.wake` ends, a read or
claim that fails is logged and tried again after a pause (never an error out
of ``take``), and :meth:`KafkaSource.close` is bounded by the time it is given
(the rest of ``--grace``), its consumer thread a daemon thread that cannot hold
the process.

Needs the ``kafka`` extra (kafka-python).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kafka import ConsumerRebalanceListener, KafkaConsumer, TopicPartition
from kafka import errors as kafka_errors
from kafka.structs import OffsetAndMetadata

from outbox.delivery.leases import Leases
from outbox.delivery.offsets import Offsets, Read
from outbox.delivery.recording import Written
from outbox.delivery.relay import topic_for
from outbox.delivery.settings import StreamSettings
from outbox.delivery.sources import Writing, wait_or_wake
from outbox.delivery.threads import DaemonThreads
from outbox.errors import ConfigurationError
from outbox.shards import shard_of
from outbox.storage.async_store import AsyncStore, ClaimedEffect, Completion
from outbox.storage.attempts import ClaimCutShort

__all__ = ["KafkaSource"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: A consumer poll is cut into slices this long, so a stop ends it within one.
POLL_SLICE_SECONDS = 0.1
#: What kafka-python raises when no broker answers (not a bad setting).
_UNREACHABLE = (kafka_errors.KafkaTimeoutError, kafka_errors.KafkaConnectionError)
#: ``close(timeout)`` waits this much longer than ``timeout`` for the consumer to let go.
CLOSE_SLACK_SECONDS = 0.25
#: Claims failing in a row (a deadlock, PostgreSQL away) pause twice as long each time, up to this.
CLAIM_BACKOFF_MAX_SECONDS = 5.0


class _Rebalances(ConsumerRebalanceListener):  # type: ignore[misc]
    """Notes which partitions a rebalance moved (called on kafka-python's I/O thread)."""

    def __init__(self) -> None:
        self.moved: deque[list[TopicPartition]] = deque()  # appends are thread-safe

    def on_partitions_revoked(self, revoked: Any) -> None:
        self.moved.append(list(revoked))

    def on_partitions_assigned(self, assigned: Any) -> None:
        self.moved.append(list(assigned))

    def on_partitions_lost(self, lost: Any) -> None:
        self.moved.append(list(lost))


def _named(record: Any) -> tuple[uuid.UUID, int] | None:
    """The effect a record names, and its shard (its run's; of no run, its own id's).

    From the ``effect-id`` and ``run-id`` headers the relay sets, which spare
    parsing the whole envelope, payload and all, per record; else from the value.
    """
    try:
        found = {key: value for key, value in record.headers or () if key in _NAMING}
        if "effect-id" in found:
            effect_id = uuid.UUID(found["effect-id"].decode())
            run_id = uuid.UUID(found["run-id"].decode()) if "run-id" in found else None
        else:
            envelope = json.loads(record.value)
            effect_id = uuid.UUID(envelope["effect_id"])
            run_id = uuid.UUID(envelope["run_id"]) if envelope.get("run_id") else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return effect_id, shard_of(run_id or effect_id)


_NAMING = frozenset({"effect-id", "run-id"})


class KafkaSource:
    """Claims the effects named by a consumer group's records (see the module docstring).

    Offsets are committed asynchronously, one commit at a time, before each
    read, up to what :class:`~outbox.delivery.offsets.Offsets` allows; so
    neither ``take`` nor ``recorded`` ever waits for the broker, and the
    last commit at :meth:`close` is bounded by the time it is given.
    """

    name = "kafka"

    def __init__(self, store: AsyncStore, kinds: Sequence[str], settings: StreamSettings) -> None:
        self.store = store
        self.kinds = list(kinds)
        self.settings = settings
        self.linger = settings.write_linger_seconds
        self.claim_sent = 0.0
        #: Records whose effect was not claimed through them (finished, or claimed elsewhere).
        self.skipped = 0
        self.offsets: Offsets[TopicPartition] = Offsets()
        #: Reads whose claim failed: claimed again before anything more is read.
        self._undecided: list[Read] = []
        #: The shard of each effect read and not yet claimed (on Citus a claim names it).
        self._shards: dict[uuid.UUID, int] = {}
        #: Claims failed in a row: the pause before the next one doubles with each.
        self._claim_failures = 0
        self._rebalances = _Rebalances()
        #: Set by :meth:`wake`: read on the consumer thread between poll slices.
        self._woken = threading.Event()
        self._woken_at = 0.0
        self._wake = asyncio.Event()
        # kafka-python's consumer is not thread-safe: every call goes through this
        # one thread, a daemon thread, so a call stuck on a frozen broker past the
        # grace period never holds the process (see outbox.delivery.threads).
        self._thread: DaemonThreads | None = None
        #: Set on the consumer thread once connected (the first read waits for it).
        self._consumer: KafkaConsumer | None = None
        self._connecting: asyncio.Future[None] | None = None
        # Touched on the consumer thread only.
        self._commit: tuple[Any, dict[TopicPartition, int]] | None = None
        self._committed: dict[TopicPartition, int] = {}
        self._commit_failures = 0

    async def _call(self, fn: Callable[[], T]) -> T:
        assert self._thread is not None
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn)

    async def open(self) -> None:
        """Start joining the consumer group; a bad consumer setting is an error here.

        A broker that cannot be reached is not: it is logged, and each read
        tries again (the daemon starts and stops as usual meanwhile).
        """
        self._thread = DaemonThreads(1, "outbox-kafka-consumer")
        await self._connected(since=0.0)

    async def _connected(self, since: float) -> bool:
        """Whether the consumer is ready; waits for an attempt to connect, unless woken.

        Raises what is not a broker out of reach (a bad setting).
        """
        if self._consumer is not None:
            return True
        assert self._thread is not None
        if self._connecting is None:
            self._connecting = asyncio.wrap_future(self._thread.submit(self._connect))
        if not await self._unless_woken(self._connecting, since):
            return False  # still connecting: the attempt goes on
        connecting, self._connecting = self._connecting, None
        try:
            connecting.result()
        except kafka_errors.KafkaConfigurationError as exc:
            raise ConfigurationError(
                f"the Kafka consumer refused its settings (--from-kafka, --kafka-option): {exc}"
            ) from exc
        except _UNREACHABLE as exc:
            log.warning(
                "Kafka is not reachable at %s (%s); trying again",
                self.settings.bootstrap_servers,
                exc,
            )
            return False
        return True

    def _connect(self) -> None:
        """On the consumer thread: make the consumer and subscribe."""
        consumer = KafkaConsumer.__new__(KafkaConsumer)
        try:
            consumer.__init__(
                bootstrap_servers=self.settings.bootstrap_servers,
                group_id=self.settings.group,
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                **self.settings.consumer,
            )
            topics = [topic_for(self.settings.topic_prefix, kind) for kind in self.kinds]
            consumer.subscribe(topics, listener=self._rebalances)
        except BaseException:
            # kafka-python starts its I/O thread before it reaches the broker and
            # leaves it running when that fails: one more thread per attempt.
            client = getattr(consumer, "_client", None)
            if client is not None:
                with contextlib.suppress(Exception):
                    client.close()
            raise
        self._consumer = consumer

    async def _unless_woken(self, work: asyncio.Future[Any], since: float) -> bool:
        """Wait for ``work``; False as soon as :meth:`wake` is called (or was, after ``since``)."""
        if self._woken_at > since:
            return work.done()
        self._wake.clear()
        woken = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait({work, woken}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
        return work.done()

    def wake(self) -> None:
        """Cut a read or a pause short (room, a stop): a read returns within a poll slice."""
        self._woken_at = time.monotonic()
        self._woken.set()
        self._wake.set()

    async def take(self, leases: Leases) -> list[ClaimedEffect]:
        """Read up to the room there is, then claim the records' effects still dispatched.

        A read that fails, or a claim PostgreSQL refuses, returns nothing after
        a pause; the records of a refused claim are claimed again first. On
        Citus a claim cut short part-way returns what it committed, and the
        records of the shards it did not settle are claimed again first.
        """
        started = time.monotonic()
        reads = self._undecided
        if not reads:
            room = min(leases.free, self.settings.batch_size)
            if room <= 0:
                return []
            reads = await self._read(room, started)
            if not reads:
                return []
        left: list[Read] = []
        try:
            ids = list({read.effect_id: None for read in reads})
            self.claim_sent = time.monotonic()
            claimed = await self.store.claim_dispatched(
                ids,
                owner=self.settings.owner,
                lease_seconds=self.settings.lease_seconds,
                shards={i: self._shards[i] for i in ids if i in self._shards},
            )
        except ClaimCutShort as cut:
            unsettled = set(cut.left)
            left = [read for read in reads if read.effect_id in unsettled]
            reads = [read for read in reads if read.effect_id not in unsettled]
            ids = [i for i in ids if i not in unsettled]
            claimed = cut.rows
            log.warning(
                "claiming on shard %d failed (%s); the %d effects claimed before it are"
                " kept, the other %d records are claimed again",
                cut.shard,
                cut.error,
                len(claimed),
                len(left),
            )
        except Exception as exc:
            # The records stay open (nothing is committed past them) and are
            # claimed again before anything more is read: each record's effect is
            # checked in PostgreSQL again, so what was recorded meanwhile is skipped.
            # A deadlock is a passing conflict with a relay or another deliverer, never a
            # reason to end the daemon; backing off lets the other side finish first.
            self._undecided = reads
            self._claim_failures += 1
            pause = self.claim_backoff()
            log.warning(
                "claiming the effects of %d records failed (%s); trying again in %gs"
                " (%d failures in a row)",
                len(reads),
                exc,
                pause,
                self._claim_failures,
            )
            await self._rest(started, pause)
            return []
        self._undecided = left
        self._claim_failures = 0
        for effect_id in ids:
            self._shards.pop(effect_id, None)
        self.skipped += self.offsets.decide(reads, {effect.id for effect in claimed})
        return claimed

    async def _read(self, room: int, started: float) -> list[Read]:
        """Commit what may be committed, then poll up to ``room`` records; their reads."""
        try:
            ready = await self._connected(started)
        except Exception as exc:
            log.warning("joining the Kafka consumer group failed (%s); trying again", exc)
            ready = False
        if not ready:
            await self._rest(started)
            return []
        self._woken.clear()
        due = self.offsets.committable()
        try:
            batch = await self._call(lambda: self._poll(due, room))
        except Exception as exc:
            log.warning(
                "reading from Kafka failed (%s); trying again in %gs",
                exc,
                self.settings.poll_seconds,
            )
            await self._rest(started)
            return []
        while self._rebalances.moved:  # the group moved partitions: they start afresh
            self.offsets.reset(self._rebalances.moved.popleft())
        reads = []
        for tp, records in batch.items():
            for record in records:
                named = _named(record)
                read = self.offsets.read(tp, record.offset, named[0] if named else None)
                if read is not None and named is not None:
                    self._shards[named[0]] = named[1]
                    reads.append(read)
                    continue
                log.warning(
                    "skipping a record that is not an outbox envelope at %s:%d:%d",
                    record.topic,
                    record.partition,
                    record.offset,
                )
        return reads

    def claim_backoff(self) -> float:
        """The pause after the claims that failed in a row: doubling from the poll interval."""
        first, doublings = self.settings.poll_seconds, min(max(self._claim_failures - 1, 0), 30)
        return min(first * 2.0**doublings, max(first, CLAIM_BACKOFF_MAX_SECONDS))

    async def _rest(self, since: float, seconds: float | None = None) -> None:
        """After a failure: wait ``seconds`` (a poll interval), unless woken since ``since``."""
        if self._woken_at > since:
            return
        self._wake.clear()
        await wait_or_wake(self._wake, self.settings.poll_seconds if seconds is None else seconds)

    def _poll(self, due: dict[TopicPartition, int], room: int) -> Any:
        """On the consumer thread: send the due commit, then poll in slices until woken."""
        consumer = self._consumer
        assert consumer is not None
        try:
            self._send_commit(consumer, due)
        except Exception as exc:  # never a reason not to read: committed with a later read
            log.warning("sending an offset commit failed: %s", exc)
        deadline = time.monotonic() + self.settings.poll_seconds
        while True:
            left = deadline - time.monotonic()
            batch = consumer.poll(
                timeout_ms=int(max(0.0, min(left, POLL_SLICE_SECONDS)) * 1000), max_records=room
            )
            if batch or left <= POLL_SLICE_SECONDS or self._woken.is_set():
                return batch

    def _send_commit(self, consumer: KafkaConsumer, due: dict[TopicPartition, int]) -> None:
        """On the consumer thread: one asynchronous commit at a time, of owned partitions only."""
        if self._commit is not None:
            sent, offsets = self._commit
            if not sent.is_done:
                return
            self._commit = None
            if sent.succeeded():
                self._committed.update(offsets)
                self._commit_failures = 0
            else:
                self._commit_failures += 1
                if self._commit_failures in (1, 10) or self._commit_failures % 100 == 0:
                    log.warning(
                        "committing offsets failed (%s); trying again (%d failures in a row)",
                        sent.exception,
                        self._commit_failures,
                    )
        offsets = self._uncommitted(consumer, due)
        if offsets:
            self._commit = (consumer.commit_async(_commit_args(offsets)), offsets)

    def _uncommitted(
        self, consumer: KafkaConsumer, due: dict[TopicPartition, int]
    ) -> dict[TopicPartition, int]:
        """On the consumer thread: the due offsets of partitions owned, not committed yet."""
        owned = consumer.assignment()
        return {
            tp: offset
            for tp, offset in due.items()
            if tp in owned and self._committed.get(tp) != offset
        }

    async def write(self, batch: list[Completion], writing: Writing) -> Written:
        """Write ``batch`` (the next claim comes with the next records, in :meth:`take`)."""
        return await writing.writer.write(batch, timeout=writing.timeout)

    async def recorded(self, effect_ids: Sequence[uuid.UUID]) -> None:
        """Outcomes are durable: their records close (committed with the next read)."""
        for effect_id in effect_ids:
            self.offsets.recorded(effect_id)

    async def close(self, timeout: float) -> None:
        """Commit what is recorded and leave the group, within ``timeout`` seconds."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        due = self.offsets.committable()
        deadline = time.monotonic() + timeout

        def finish() -> None:  # after any attempt to connect still under way
            consumer, self._consumer = self._consumer, None
            if consumer is None:
                return
            offsets = self._uncommitted(consumer, due)
            if offsets:
                try:
                    consumer.commit(_commit_args(offsets), timeout_ms=_ms_left(deadline))
                except Exception as exc:  # read again by the group; recorded effects are skipped
                    log.warning("final offset commit failed: %s", exc)
            consumer.close(autocommit=False, timeout_ms=_ms_left(deadline))

        try:
            closing = asyncio.get_running_loop().run_in_executor(thread, finish)
            await asyncio.wait_for(closing, max(timeout, 0.0) + CLOSE_SLACK_SECONDS)
        except TimeoutError:
            log.warning("the Kafka consumer did not close within %gs: left behind", timeout)
        except Exception as exc:
            log.warning("closing the Kafka consumer failed: %s", exc)
        finally:
            thread.shutdown(wait=False)


def _commit_args(offsets: dict[TopicPartition, int]) -> dict[TopicPartition, OffsetAndMetadata]:
    return {tp: OffsetAndMetadata(offset, "", -1) for tp, offset in offsets.items()}


def _ms_left(deadline: float) -> int:
    return max(1, int((deadline - time.monotonic()) * 1000))
