"""``outbox relay``: pending effects carried to Kafka for stream-mode deliverers.

The relay claims pending effects with the poll deliverer's claim (so per-key
order holds) straight into ``dispatched``, leased to it for the dispatch TTL,
then publishes each to the topic ``<prefix><kind>``, keyed by ordering key
(else run id). What the broker did not acknowledge goes back to ``pending``
(fenced like a completion). One statement in PostgreSQL per batch published:
a mark after the publish cost more than the claim and held rows a stream
deliverer was already claiming. A relay killed between its claim and its
publish leaves that batch ``dispatched`` with no record, and nothing says
which batch that was. So a relay holds its owner's session lock while it
lives (:mod:`outbox.storage.sql.owners`), and another relay's reconcile
round, finding it gone twice ``gone_grace`` apart, cuts what it dispatched
to the orphan TTL (30 s): deliverers take what reached Kafka meanwhile, and
the rest is dispatched again then, not when the dispatch TTL (300 s) runs
out. A relay started under the name of one that died does the same with
its own name's. See :mod:`outbox.delivery.stream` for the consuming side
and what the two promise together.

Needs the ``kafka`` extra (kafka-python).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from typing import Any

from kafka import KafkaProducer
from kafka import errors as kafka_errors

from outbox.delivery.attempt import released
from outbox.delivery.daemon import OWNER_LOCK_WAIT_SECONDS
from outbox.delivery.liveness import Sightings
from outbox.delivery.maintenance import every
from outbox.delivery.reconcile import reconcile
from outbox.delivery.seam import OwnerLockLike
from outbox.delivery.settings import RelaySettings
from outbox.delivery.sources import wait_or_wake
from outbox.errors import ConfigurationError
from outbox.faults import crash_point
from outbox.retry import IdleBackoff
from outbox.storage.async_store import AsyncStore, ClaimedEffect
from outbox.storage.sql.dispatch import DISPATCH_QUEUE

__all__ = ["Relay", "close_producer", "topic_for"]

log = logging.getLogger(__name__)

#: What kafka-python raises when no broker answers (not a bad setting).
_UNREACHABLE = (kafka_errors.KafkaTimeoutError, kafka_errors.KafkaConnectionError)


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
        #: Relays found gone, and since when.
        self._sightings = Sightings(settings.gone_grace_seconds)

    def stop(self) -> None:
        """Stop after the current batch."""
        self._stopping.set()
        self._wake.set()

    async def run(self) -> None:
        """Relay until stopped."""
        try:
            self._producer = await asyncio.to_thread(self._make_producer)
        except _UNREACHABLE as exc:
            # Not fatal: each batch makes the producer again until the broker answers.
            log.warning(
                "Kafka is not reachable at %s (%s); trying again with each batch",
                self.settings.bootstrap_servers,
                exc,
            )
        except (ValueError, TypeError, kafka_errors.KafkaConfigurationError) as exc:
            raise ConfigurationError(
                f"the Kafka producer refused its settings (--kafka, --kafka-option): {exc}"
            ) from exc
        lock = self.store.owner_lock(self.owner)
        lock.start()
        await self._take_over_own_name(lock)
        background = [
            asyncio.create_task(self.store.listen_for_effects(self._wake)),
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
            await lock.close()

    async def _take_over_own_name(self, lock: OwnerLockLike) -> None:
        if not await lock.wait_held(OWNER_LOCK_WAIT_SECONDS):
            log.warning(
                "relay %s: no session lock yet; if this process dies, what it dispatched "
                "waits for the dispatch TTL",
                self.owner,
            )
            return
        # This relay holds its name's lock, so what is dispatched under the name was
        # claimed by a relay of that name that died (one restarted with --owner).
        try:
            ended = await self.store.end_relay_dispatches(
                self.owner,
                ttl=self.settings.orphan_ttl_seconds,
                gone_only=False,
                restart_grace=self.settings.restart_grace_seconds,
            )
        except Exception as exc:  # the TTL still covers them
            log.warning(
                "relay %s: could not end its predecessor's dispatches (%s)", self.owner, exc
            )
            return
        if ended:
            log.info(
                "relay %s: %d effects dispatched before a restart: dispatched again unless "
                "taken within %gs",
                self.owner,
                ended,
                self.settings.orphan_ttl_seconds,
            )

    async def _reconcile(self) -> None:
        # Needs no deliverer: dead relays' claims, expired dispatches.
        await self._end_gone_relays_dispatches()
        await reconcile(self.store, {}, worker=f"reconciler:{self.owner}", report_skipped=False)

    async def _end_gone_relays_dispatches(self) -> None:
        grace = self.settings.restart_grace_seconds
        gone = [o for o in await self.store.gone_relays(restart_grace=grace) if o != self.owner]
        now = time.monotonic()
        for owner in sorted(self._sightings.seen(gone, now)):
            ended = await self.store.end_relay_dispatches(
                owner, ttl=self.settings.orphan_ttl_seconds, gone_only=True, restart_grace=grace
            )
            if ended:
                log.info(
                    "relay %s is gone: %d effects it dispatched are dispatched again unless "
                    "taken within %gs",
                    owner,
                    ended,
                    self.settings.orphan_ttl_seconds,
                )
        if gone and self._sightings.forget_due(now):
            await self.store.forget_gone_owners(gone, restart_grace=grace)

    async def _relay_batch(self) -> int:
        quotas = [({"kind": kind}, self.settings.batch_size) for kind in self.kinds]
        effects = await self.store.claim_many(
            DISPATCH_QUEUE,
            quotas,
            owner=self.owner,
            lease_seconds=self.settings.dispatch_ttl_seconds,
        )
        if not effects:
            return 0
        crash_point("after_dispatch_claim")
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
        self.dispatched += len(published)
        return len(effects)

    def _make_producer(self) -> KafkaProducer:
        return KafkaProducer(
            bootstrap_servers=self.settings.bootstrap_servers, **self.settings.producer_settings
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
