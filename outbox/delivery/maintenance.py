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
from outbox.delivery.liveness import GoneOwners
from outbox.delivery.metrics import DeliveryMetrics
from outbox.delivery.reconcile import reconcile
from outbox.delivery.settings import DeliverySettings
from outbox.runs.approvals import expire_approvals
from outbox.runs.stopping import advance_stopping_runs
from outbox.storage.async_store import AsyncStore

__all__ = ["UNKNOWN_KIND_NOTE", "Maintenance", "every"]

log = logging.getLogger(__name__)

UNKNOWN_KIND_NOTE = "no deliverer is registered for kind "
#: Pending effects of kinds nobody here knows, and effects held back by their
#: ordering key, are noted at most this often (and on the first round).
UNKNOWN_KINDS_EVERY = 30.0
#: After this daemon claims or records something, the effect gauges are counted
#: again within this long (and at most this often while work goes on).
STATS_AFTER_CHANGE_SECONDS = 1.0


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
        self._changed = asyncio.Event()
        self.gone = GoneOwners(
            store,
            deliverers,
            owner=settings.owner,
            grace_seconds=settings.gone_grace_seconds,
            restart_grace_seconds=settings.restart_grace_seconds,
            default_max_attempts=settings.max_attempts,
        )

    def start(self) -> list[asyncio.Task[None]]:
        """Start every round; the caller cancels the tasks when it stops."""
        s = self.settings
        tasks = [
            asyncio.create_task(every(s.heartbeat_seconds, self.heartbeat, "heartbeat")),
            asyncio.create_task(every(s.reconcile_seconds, self.reconcile, "reconcile")),
            asyncio.create_task(self._stats_rounds()),
        ]
        if s.early_recovery and self.gone.limits:
            tasks.append(
                asyncio.create_task(
                    every(s.gone_check_seconds, self.recover_gone, "gone deliverers", first=True)
                )
            )
        return tasks

    async def recover_gone(self) -> None:
        """Put back the idempotent attempts of deliverers whose session lock is free."""
        if await self.gone.check():
            self.on_requeued()  # ours to claim now, not at the next poll

    def changed(self) -> None:
        """Note that the daemon claimed or recorded effects: the gauges are counted again soon."""
        self._changed.set()

    async def _stats_rounds(self) -> None:
        """Count every ``stats_seconds``, and within a second of a change made here.

        Changes made by other processes show at the next round; a change made here
        (a delivery finished, say) does not leave a stale gauge for ``stats_seconds``.
        """
        while True:
            self._changed.clear()
            try:
                await self.stats()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("stats round failed: %s", exc)
            counted = time.monotonic()
            try:
                # Not asyncio.wait_for: on 3.11 it returns normally when the event is
                # set just as the round is cancelled, and the round would live on.
                async with asyncio.timeout(self.settings.stats_seconds):
                    await self._changed.wait()
            except TimeoutError:
                continue
            await asyncio.sleep(max(0.0, counted + STATS_AFTER_CHANGE_SECONDS - time.monotonic()))

    async def heartbeat(self) -> None:
        """Push out the leases of every held attempt."""
        await self.leases.heartbeat(self.store, self.settings.owner, self.settings.lease_seconds)

    async def reconcile(self) -> None:
        """Resolve expired attempts, act on approval deadlines, move cancelled runs on, note holds.

        Each part runs even when another failed (a role without a privilege one
        part needs still gets the others done); the first failure is raised.
        """
        failures: list[Exception] = []
        for part in (
            self._resolve_expired,
            self._expire_approvals,
            self._advance_stopping,
            self._notes,
        ):
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

    async def _expire_approvals(self) -> None:
        # Approval deadlines that passed get their on_timeout (a cancelled run among
        # them moves on in _advance_stopping, which runs next).
        await self.store.run_sync(expire_approvals, "acting on approval deadlines")

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
