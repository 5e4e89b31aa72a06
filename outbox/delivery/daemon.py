"""The delivery daemon: take attempts from a source, call their deliverers, record outcomes.

One asyncio loop per process, one daemon for both modes: the source is a
:class:`~outbox.delivery.sources.PollSource` (claims in PostgreSQL) or a
:class:`~outbox.delivery.stream.KafkaSource` (records a relay published).
Attempts start as soon as their kind has room (:class:`~outbox.delivery.leases.Leases`);
outcomes are written in batches by one writer, and only then is the source
told (a Kafka source commits its offsets then). Leases are pushed out by a
heartbeat while calls run; the reconciler runs on an interval, so a dead
daemon's effects are recovered by the living.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime

from outbox.delivery.attempt import perform_attempt, released
from outbox.delivery.contract import Deliverer, Retry
from outbox.delivery.leases import Leases
from outbox.delivery.maintenance import Maintenance
from outbox.delivery.metrics import DeliveryMetrics
from outbox.delivery.settings import DeliverySettings
from outbox.delivery.sources import EffectSource, PollSource, wait_or_wake
from outbox.models import AttemptOutcome, EffectStatus
from outbox.storage.async_store import AsyncStore, ClaimedEffect, Completion

__all__ = ["DeliveryDaemon"]

log = logging.getLogger(__name__)

#: After a failed write of outcomes, wait this long before trying again.
RECORD_RETRY_SECONDS = 0.5


class DeliveryDaemon:
    """Delivers effects of the kinds in ``deliverers`` from ``source`` until :meth:`stop`."""

    def __init__(
        self,
        store: AsyncStore,
        deliverers: Mapping[str, Deliverer],
        settings: DeliverySettings | None = None,
        *,
        source: EffectSource | None = None,
        metrics: DeliveryMetrics | None = None,
    ) -> None:
        self.store = store
        self.deliverers = dict(deliverers)
        self.settings = settings or DeliverySettings()
        self.source = source or PollSource(store, self.settings)
        self.metrics = metrics or DeliveryMetrics()
        self.owner = self.settings.owner
        self.leases = Leases(self.deliverers, self.settings.concurrency, self.metrics)
        self._stopping = asyncio.Event()
        self._room = asyncio.Event()
        self._done: list[Completion] = []
        self._done_ready = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        #: Attempts whose final outcome (not a retry) this daemon recorded.
        self.delivered = 0

    # -- lifecycle ----------------------------------------------------------------

    def stop(self) -> None:
        """Stop taking work; in-flight calls get ``grace_seconds`` to finish."""
        log.info("stopping: no new claims; waiting for %d in-flight calls", len(self.leases))
        self._stopping.set()
        self._room.set()
        self.source.wake()

    async def run(self) -> None:
        """Deliver until stopped, then drain gracefully."""
        maintenance = Maintenance(
            self.store, self.deliverers, self.settings, self.leases, self.metrics, self.source.wake
        )
        await self.source.open()
        background = maintenance.start()
        writer = asyncio.create_task(self._write_completions(), name="completions")
        try:
            await self._take_loop()
            await self._drain()
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            self._done_ready.set()
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
            await self._flush()
            await self.source.close()
            for deliverer in self.deliverers.values():
                # Clients such as httpx's belong to this event loop: close them on it.
                await deliverer.aclose()

    async def _drain(self) -> None:
        for effect in self.leases.unstarted():
            self._record(released(effect, "released unstarted at shutdown"))
        deadline = time.monotonic() + self.settings.grace_seconds
        while any(not t.done() for t in self._tasks) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        pending = [t for t in self._tasks if not t.done()]
        if pending:
            # Calls still running after the grace period stay in flight; their
            # leases run out and the reconciler resolves them.
            log.warning("grace period over: abandoning %d calls to the reconciler", len(pending))
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        await self._flush()

    # -- taking and starting --------------------------------------------------------

    async def _take_loop(self) -> None:
        while not self._stopping.is_set():
            if self.leases.free <= 0:
                self._room.clear()
                await wait_or_wake(self._room, self.settings.poll_seconds)
                self._start_ready()
                continue
            batch = await self.source.take(self.leases)
            if self._stopping.is_set():
                for effect in batch:
                    self._record(released(effect, "released unstarted at shutdown"))
                break
            for effect in batch:
                if effect.kind in self.deliverers:
                    self.leases.hold(effect)
                else:  # a record of a kind this process does not deliver
                    self._record(released(effect, f"no deliverer for kind {effect.kind!r} here"))
            self._start_ready()
            resume = self.leases.next_resume()
            if resume is not None and not batch:
                await wait_or_wake(self._room, resume)
                self._start_ready()

    def _start_ready(self) -> None:
        for effect in self.leases.startable():
            task = asyncio.create_task(self._deliver(effect))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    # -- one delivery -------------------------------------------------------------

    async def _deliver(self, effect: ClaimedEffect) -> None:
        if self._stopping.is_set():
            self._record(released(effect, "released unstarted at shutdown"))
            return
        try:
            attempt = await self.store.with_payload(effect)
        except Exception as exc:  # the payload is read again with the next attempt
            log.warning("effect %s: its payload could not be read: %s", effect.id, exc)
            self._record(released(effect, f"payload could not be read: {exc}", delay=1.0))
            return
        completion, outcome = await perform_attempt(
            self.deliverers[effect.kind],
            attempt,
            policy=self.settings.retry_policy,
            default_max_attempts=self.settings.max_attempts,
            schema_retry_seconds=self.settings.schema_retry_seconds,
        )
        if isinstance(outcome, Retry) and outcome.rate_limited:
            self.leases.pause(effect.kind, outcome.after if outcome.after is not None else 1.0)
        self._record(completion)

    def _record(self, completion: Completion) -> None:
        self._done.append(completion)
        self._done_ready.set()

    # -- recording outcomes -------------------------------------------------------

    async def _write_completions(self) -> None:
        while True:
            await self._done_ready.wait()
            self._done_ready.clear()
            await self._flush()

    async def _flush(self) -> None:
        while self._done:
            batch, self._done = self._done, []
            try:
                logged = await self.store.complete(self.owner, batch)
            except Exception as exc:
                log.warning("recording %d outcomes failed (%s); retrying", len(batch), exc)
                self._done = batch + self._done
                await asyncio.sleep(RECORD_RETRY_SECONDS)
                continue
            self._account(batch, dict(logged))
            try:
                await self.source.recorded([c.effect_id for c in batch])
            except Exception as exc:  # the source re-reads; recorded effects are skipped
                log.warning("source could not take note of %d outcomes: %s", len(batch), exc)
            self._room.set()  # slots are free again
            self.source.wake()

    def _account(self, batch: list[Completion], outcomes: dict[uuid.UUID, str]) -> None:
        now = datetime.now(UTC)
        for completion in batch:
            held = self.leases.release(completion.effect_id)
            if held is None:
                continue
            kind = held.effect.kind
            outcome = outcomes.get(completion.effect_id, AttemptOutcome.STALE)
            final = completion.status != EffectStatus.PENDING
            latency = (now - held.effect.created_at).total_seconds() if final else None
            self.metrics.attempt_recorded(kind, outcome, latency)
            if outcome == AttemptOutcome.STALE:
                log.warning(
                    "outcome of effect %s attempt %d was stale: a newer attempt owns it; "
                    "nothing changed",
                    completion.effect_id,
                    held.effect.attempt,
                    extra={"effect_id": str(completion.effect_id), "attempt": held.effect.attempt},
                )
            if final:
                self.delivered += 1
        self._start_ready()
