"""The background rounds every delivering process runs: heartbeat, reconcile, stats.

Each round runs on its own interval through :func:`every`; a failed round is
logged and the next one comes, so a database outage never kills the daemon
(the attempts it holds are safe: their leases run out and the reconciler of
whichever process is alive resolves them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping

from outbox.delivery.contract import Deliverer
from outbox.delivery.leases import Leases
from outbox.delivery.metrics import DeliveryMetrics
from outbox.delivery.reconcile import reconcile
from outbox.delivery.settings import DeliverySettings
from outbox.runs.stopping import advance_stopping_runs
from outbox.storage.async_store import AsyncStore

__all__ = ["UNKNOWN_KIND_NOTE", "Maintenance", "every"]

log = logging.getLogger(__name__)

UNKNOWN_KIND_NOTE = "no deliverer is registered for kind "
#: Pending effects of kinds nobody here knows, and effects held back by their
#: ordering key, are noted at most this often (and on the first round).
UNKNOWN_KINDS_EVERY = 30.0


async def every(
    seconds: float, round_: Callable[[], Awaitable[object]], what: str, *, first: bool = False
) -> None:
    """Run ``round_`` every ``seconds`` until cancelled; a failed round is logged, never fatal."""
    if not first:
        await asyncio.sleep(seconds)
    while True:
        try:
            await round_()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("%s round failed: %s", what, exc, exc_info=log.isEnabledFor(logging.DEBUG))
        await asyncio.sleep(seconds)


class Maintenance:
    """The rounds of one delivery daemon, started together and cancelled together."""

    def __init__(
        self,
        store: AsyncStore,
        deliverers: Mapping[str, Deliverer],
        settings: DeliverySettings,
        leases: Leases,
        metrics: DeliveryMetrics,
        on_requeued: Callable[[], None],
    ) -> None:
        self.store = store
        self.deliverers = deliverers
        self.settings = settings
        self.leases = leases
        self.metrics = metrics
        self.on_requeued = on_requeued
        self._last_kinds_check = 0.0

    def start(self) -> list[asyncio.Task[None]]:
        """Start every round; the caller cancels the tasks when it stops."""
        s = self.settings
        return [
            asyncio.create_task(every(s.heartbeat_seconds, self.heartbeat, "heartbeat")),
            asyncio.create_task(every(s.reconcile_seconds, self.reconcile, "reconcile")),
            asyncio.create_task(every(s.stats_seconds, self.stats, "stats", first=True)),
        ]

    async def heartbeat(self) -> None:
        """Push out the leases of every held attempt."""
        await self.leases.heartbeat(self.store, self.settings.owner, self.settings.lease_seconds)

    async def reconcile(self) -> None:
        """Resolve expired attempts, move cancelled runs on, note what holds effects back.

        Each part runs even when another failed (a role without a privilege one
        part needs still gets the others done); the first failure is raised.
        """
        failures: list[Exception] = []
        for part in (self._resolve_expired, self._advance_stopping, self._notes):
            try:
                await part()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures.append(exc)
        if failures:
            raise failures[0]

    async def _resolve_expired(self) -> None:
        report = await reconcile(
            self.store,
            self.deliverers,
            worker=f"reconciler:{self.settings.owner}",
            lease_seconds=self.settings.lease_seconds,
            default_max_attempts=self.settings.max_attempts,
        )
        if report.items:
            # Effects put back to pending are ours to claim now, not at the next poll.
            self.on_requeued()

    async def _advance_stopping(self) -> None:
        # Cancelled runs move on as their effects finish, even where no worker of
        # their agent runs.
        await self.store.run_sync(advance_stopping_runs, "advancing stopping runs")

    async def _notes(self) -> None:
        if time.monotonic() - self._last_kinds_check <= UNKNOWN_KINDS_EVERY:
            return
        self._last_kinds_check = time.monotonic()
        await self.store.mark_unknown_kinds(
            sorted(self.deliverers),
            grace_seconds=self.settings.unknown_kind_grace_seconds,
            note_prefix=UNKNOWN_KIND_NOTE,
        )
        await self.store.note_blocked_by_order(
            grace_seconds=self.settings.blocked_note_grace_seconds
        )

    async def stats(self) -> None:
        """Refresh the effect gauges from the database."""
        counts = await self.store.state_counts()
        self.metrics.set_states(counts.effects)
        self.metrics.oldest_pending.set(counts.oldest_pending_seconds)
