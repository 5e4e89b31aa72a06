"""Where a delivery daemon's attempts come from: claims in PostgreSQL, or records from Kafka.

A source hands the daemon claimed attempts (:meth:`EffectSource.take`), writes
the outcomes of a batch (:meth:`EffectSource.write`: a poll source claims its
next batch in the same transaction) and is told when outcomes are durable
(:meth:`EffectSource.recorded`: a poll source has nothing to do then; a Kafka
source commits offsets, never ahead of what PostgreSQL holds). The daemon
never looks behind this seam.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol
from uuid import UUID

from outbox.delivery.leases import Leases, Quotas
from outbox.delivery.recording import ClaimRider, OutcomeWriter, Ride, Written
from outbox.delivery.seam import DeliveryStore
from outbox.delivery.settings import DeliverySettings
from outbox.faults import crash_point
from outbox.retry import IdleBackoff, wait_or_wake
from outbox.storage.attempts import ClaimedEffect, Completion
from outbox.storage.sql.queue import EFFECT_QUEUE

__all__ = ["EffectSource", "PollSource", "Writing", "wait_or_wake"]


@dataclass(frozen=True)
class Writing:
    """How the daemon has a batch of outcomes written, and what may go with it."""

    writer: OutcomeWriter
    leases: Leases
    #: How long each statement may take (None: no limit; the grace left when stopping).
    timeout: float | None
    #: False once stopping: nothing new may be taken with the outcomes.
    claim: bool
    #: The background duties that may ride a transaction that also claims, given the
    #: attempts whose outcomes it writes (None: no duties ride).
    ride: Callable[[Iterable[UUID]], Ride] | None = None


log = logging.getLogger(__name__)


class EffectSource(Protocol):
    """What a delivery daemon takes its attempts from."""

    #: Said in the daemon's banner and logs ("poll", "kafka").
    name: str
    #: Seconds the daemon lets outcomes wait for the attempts still under way, so
    #: that one write records them together (0: each write goes at once).
    linger: float
    #: When the claim of the last :meth:`take` was sent (monotonic): the leases it
    #: took run from then, not from the answer (nor from a wait before it).
    claim_sent: float

    async def open(self) -> None:
        """Connect (LISTEN, a consumer group); called once before the first :meth:`take`."""

    async def take(self, leases: Leases) -> list[ClaimedEffect]:
        """Claimed attempts within the room ``leases`` has; waits a while when there are none."""
        ...

    async def write(self, batch: list[Completion], writing: Writing) -> Written:
        """Have ``batch`` written; what the source claimed with it is in ``claimed``."""
        ...

    async def recorded(self, effect_ids: Sequence[UUID]) -> None:
        """The outcomes of these attempts are committed in PostgreSQL."""

    def wake(self) -> None:
        """Something changed (room, work requeued, stop): stop waiting in :meth:`take`."""

    async def close(self, timeout: float) -> None:
        """Release connections within ``timeout`` seconds; the daemon calls it last."""


class PollSource:
    """Claims pending effects with ``FOR UPDATE SKIP LOCKED``, woken by ``NOTIFY``, with a poll.

    Claims are bounded batches, one statement per kind and only as many as can
    start now, so memory does not grow with the backlog.
    """

    name = "poll"
    #: A write carries the next claim, which must not wait.
    linger = 0.0

    def __init__(self, store: DeliveryStore, settings: DeliverySettings) -> None:
        self.store = store
        self.settings = settings
        self._wake = asyncio.Event()
        self._idle = IdleBackoff(settings.poll_seconds)
        self._listener: asyncio.Task[None] | None = None
        self._wait_first = 0.0
        self.claim_sent = 0.0

    async def open(self) -> None:
        """Start listening for committed intents."""
        self._listener = asyncio.create_task(self.store.listen_for_effects(self._wake))

    def wake(self) -> None:
        """Claim again now."""
        self._wake.set()

    async def take(self, leases: Leases) -> list[ClaimedEffect]:
        """Claim what fits; after a claim that found less than asked, wait (NOTIFY or backoff)."""
        if self._wait_first:
            await wait_or_wake(self._wake, self._wait_first)
        # Taken now: a wake-up from here on (NOTIFY, room, a requeue) is for the
        # next claim. Cleared before deciding, or a wake-up seen while no kind
        # may claim (all paused, all at their caps) would be seen again at once,
        # and again: a busy loop for as long as the pause lasts.
        self._wake.clear()
        quotas = leases.quotas(self.settings.batch_size)
        if not quotas:
            self._wait_first = self.settings.poll_seconds
            return []
        try:
            self.claim_sent = time.monotonic()
            with leases.reserving(quotas):  # the outcome writer's claim sees it taken
                rows = await self.store.claim_many(
                    EFFECT_QUEUE,
                    quotas,
                    owner=self.settings.owner,
                    lease_seconds=self.settings.lease_seconds,
                    rates=leases.rates,
                )
        except Exception as exc:
            log.warning("claim failed (%s); retrying after the poll interval", exc)
            self._wait_first = self.settings.poll_seconds
            return []
        self.claimed(rows, quotas)
        return rows

    async def write(self, batch: list[Completion], writing: Writing) -> Written:
        """Write ``batch`` and, in the same transaction, claim the next batch if there is room.

        The duties ``writing.ride`` offers ride along only with a claim; what
        the claim found is held by the daemon (``claimed``) and decides when to
        claim next (:meth:`claimed`).
        """
        leases = writing.leases
        quotas = self.rider_quotas(leases, freeing=len(batch)) if writing.claim else []
        if not quotas:
            return await writing.writer.write(batch, timeout=writing.timeout)
        ride = writing.ride(c.effect_id for c in batch) if writing.ride is not None else None
        rider = ClaimRider(
            quotas,
            self.settings.lease_seconds,
            leases.rates,
            extend=ride.extend if ride else [],
            probe=ride.probe if ride else None,
        )
        with leases.reserving(quotas, freeing=len(batch)):
            written = await writing.writer.write(batch, timeout=writing.timeout, rider=rider)
        written.ride = ride
        if not written.left:
            self.claimed(written.claimed, quotas)
        return written

    def rider_quotas(self, leases: Leases, *, freeing: int) -> list[tuple[dict[str, str], int]]:
        """Quotas of a claim made with ``freeing`` outcomes (see :meth:`Leases.reserving`).

        None while the last claim found the queue short: a claim then waits for a
        NOTIFY or the backoff (:meth:`take`), not for the next outcomes.
        """
        if self._wait_first:
            return []
        return leases.quotas(self.settings.batch_size, freeing=freeing)

    def claimed(self, rows: list[ClaimedEffect], quotas: list[tuple[dict[str, str], int]]) -> None:
        """Note what a claim (here or with outcomes) found: when to claim next."""
        if rows:
            crash_point("after_claim")
        # More is likely waiting (a kind filled its quota, or one was left out):
        # claim again at once, riding the next outcomes.
        if isinstance(quotas, Quotas):
            more = quotas.found(rows)
        else:
            more = len(rows) == sum(n for _, n in quotas)
        self._wait_first = 0.0 if more else self._idle.found(bool(rows))

    async def recorded(self, effect_ids: Sequence[UUID]) -> None:
        """Nothing to do: the claim itself was the source's state."""

    async def close(self, timeout: float) -> None:
        """Stop listening (at once: ``timeout`` is not needed)."""
        if self._listener is not None:
            self._listener.cancel()
            await asyncio.gather(self._listener, return_exceptions=True)
