"""The background rounds every delivering process runs: heartbeat, reconcile, stats.

Each round runs on its own interval; a failed round is logged and the next
one comes, so a database outage never kills the daemon (the attempts it holds
are safe: their leases run out and the reconciler of whichever process is
alive resolves them).

The duties that need the database on a clock (lease renewal, the reconciler,
approval deadlines, stopping runs, gone owners) cost no transaction of their
own while the daemon is busy: :meth:`Maintenance.ride` hands the batch
writer what to carry in the transaction that records a batch's outcomes and
claims the next one (the renewal of held leases, and the duty probe of
:mod:`outbox.storage.sql.duties`), and the rounds run their statements alone
only when no batch carried them in time. A duty's own statements run only
when the probe found work for it, in whichever process probed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from uuid import UUID

from outbox.delivery.contract import Deliverer
from outbox.delivery.leases import Leases
from outbox.delivery.liveness import GoneOwners
from outbox.delivery.metrics import DeliveryMetrics
from outbox.delivery.reconcile import LookupBackoff, reconcile
from outbox.delivery.recording import Ride
from outbox.delivery.seam import DeliveryStore
from outbox.delivery.settings import DeliverySettings
from outbox.retry import wait_or_wake
from outbox.runs.approvals import expire_approvals
from outbox.runs.stopping import StoppingSweep
from outbox.storage.attempts import DutyAsk, DutyFindings

__all__ = ["UNKNOWN_KIND_NOTE", "Maintenance", "Ride", "every"]

log = logging.getLogger(__name__)

UNKNOWN_KIND_NOTE = "no deliverer is registered for kind "
#: Pending effects of kinds nobody here knows, and effects held back by their
#: ordering key, are noted at most this often (and on the first round).
UNKNOWN_KINDS_EVERY = 30.0
#: After this daemon claims or records something, the effect gauges are counted
#: again within this long (and at most this often while work goes on).
STATS_AFTER_CHANGE_SECONDS = 1.0
#: ...but never more often than this many times the last count took: counting a
#: million pending effects takes a third of a second, which every second would
#: cost the server a quarter of a CPU while it drains them.
STATS_COST_FACTOR = 20.0
#: A duty probe waits at least this many times the last one took: on one server
#: it takes about 2 ms and runs every half second, but over the 32 shards of a
#: Citus cluster it is 160 shard reads (about 85 ms), which twice a second kept
#: a sixth of a coordinator busy, idle or not.
PROBE_COST_FACTOR = 10.0
#: A batch's transaction renews the held leases once one of them is this share
#: of the heartbeat interval old; the heartbeat round, once one is HEARTBEAT_DUE
#: old (checked every HEARTBEAT_TICK of it), so a lease is never left older
#: than one interval (as when every round renewed every lease), and a busy
#: daemon's batches renew before the round needs to.
RIDE_RENEWAL_AGE = 0.5
HEARTBEAT_DUE = 0.75
HEARTBEAT_TICK = 0.25
#: After a batch transaction carrying duties failed, they run on their own this long.
RIDE_OFF_SECONDS = 60.0


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
        store: DeliveryStore,
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
        self._stopping = StoppingSweep()
        self._changed = asyncio.Event()
        #: Set when a probe that rode a batch found work: the duty round runs now.
        self._work = asyncio.Event()
        self._found: DutyFindings | None = None
        self._found_at = 0.0
        #: When the last probe, alone or riding, was sent (monotonic).
        self._probed_at = -float("inf")
        self._ride_off_until = 0.0
        #: Sinks that could not answer a lookup are asked again later, not every round.
        self._lookups = LookupBackoff()
        self.gone = GoneOwners(
            store,
            deliverers,
            owner=settings.owner,
            grace_seconds=settings.gone_grace_seconds,
            restart_grace_seconds=settings.restart_grace_seconds,
            default_max_attempts=settings.max_attempts,
        )
        #: What the duty probe asks, and how often some probe must run.
        self.ask = DutyAsk(
            askable=tuple(
                sorted(k for k, d in deliverers.items() if d.has_lookup and not d.idempotent)
            ),
            gone_kinds=tuple(sorted(self.gone.limits)) if self._gone_on else (),
            restart_grace=settings.restart_grace_seconds,
        )
        self._probe_every = settings.reconcile_seconds
        if self._gone_on:
            self._probe_every = min(self._probe_every, settings.gone_check_seconds)
        self._probe_took = 0.0

    def start(self) -> list[asyncio.Task[None]]:
        """Start every round; the caller cancels the tasks when it stops."""
        s = self.settings
        return [
            asyncio.create_task(
                every(s.heartbeat_seconds * HEARTBEAT_TICK, self._heartbeat, "heartbeat")
            ),
            asyncio.create_task(self._duty_rounds()),
            asyncio.create_task(self._stats_rounds()),
        ]

    @property
    def _gone_on(self) -> bool:
        return self.settings.early_recovery and bool(self.gone.limits)

    # -- riding a batch's transaction --------------------------------------------------

    def ride(self, completing: Iterable[UUID]) -> Ride:
        """What the next batch transaction should carry (nothing while riding is off).

        ``completing``: the attempts whose outcomes it writes (no renewal for them).
        """
        now = time.monotonic()
        if now < self._ride_off_until:
            return Ride(sent=now)
        extend = self.leases.renewal_due(
            self.settings.heartbeat_seconds * RIDE_RENEWAL_AGE, exclude=completing
        )
        probe = self.ask if now - self._probed_at >= self._probe_every / 2 else None
        return Ride(extend, probe, now)

    def rode(self, ride: Ride, kept: set[UUID], findings: DutyFindings | None) -> None:
        """Take note of what a committed batch transaction found for ``ride``."""
        if ride.extend:
            self.leases.renewed(ride.extend, kept, ride.sent)
        if findings is not None:
            self._probed_at = ride.sent
            self._found, self._found_at = findings, ride.sent
            if findings.expired or findings.approvals or findings.stopping or findings.gone:
                self._work.set()

    def ride_failed(self) -> None:
        """A batch transaction carrying duties failed: they run on their own for a while.

        A duty statement this role may not run (``pg_locks`` hidden, say) must
        not keep every batch from carrying its claim.
        """
        self._ride_off_until = time.monotonic() + RIDE_OFF_SECONDS

    # -- the rounds ------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        s = self.settings
        await self.leases.heartbeat(
            self.store, s.owner, s.lease_seconds, min_age=s.heartbeat_seconds * HEARTBEAT_DUE
        )

    async def _duty_rounds(self) -> None:
        """Probe when no batch did lately, and act on what a probe found (here or in a batch)."""
        while True:
            try:
                await self.duties()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning(
                    "background duties round failed: %s",
                    exc,
                    exc_info=log.isEnabledFor(logging.DEBUG),
                )
            await wait_or_wake(self._work, self._probe_every / 2)
            self._work.clear()

    async def duties(self) -> None:
        """One round: probe unless a batch did within the interval; run the duties with work.

        Each part runs even when another failed (a role without a privilege one
        part needs still gets the others done); the first failure is raised.
        """
        findings, at = self._found, self._found_at
        self._found = None
        now = time.monotonic()
        every = max(self._probe_every, PROBE_COST_FACTOR * self._probe_took)
        if findings is None and now - self._probed_at >= every:
            self._probed_at = now
            try:
                findings, at = await self.store.probe_duties(self.ask), now
                self._probe_took = time.monotonic() - now
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # The probe reads what every duty reads; a role that may not read
                # some of it still gets the duties it may do, each on its own.
                log.debug("duty probe failed (%s); running every duty", exc)
                await self._every_duty()
                return
        parts: list[Callable[[], Awaitable[object]]] = []
        if findings is not None:
            if self._gone_on:
                gone = findings.gone
                parts.append(lambda: self._observe_gone(gone, at))
            if findings.expired:
                parts.append(self._resolve_expired)
            if findings.approvals:
                parts.append(self._expire_approvals)
            if findings.stopping:
                parts.append(self._advance_stopping)
        parts.append(self._notes)
        failures: list[Exception] = []
        for part in parts:
            try:
                await part()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures.append(exc)
        if failures:
            raise failures[0]

    async def _every_duty(self) -> None:
        failures: list[Exception] = []
        parts: list[Callable[[], Awaitable[object]]] = [self.reconcile]
        if self._gone_on:
            parts.append(self.recover_gone)
        for part in parts:
            try:
                await part()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures.append(exc)
        if failures:
            raise failures[0]

    async def _observe_gone(self, found: tuple[tuple[str, bool], ...], at: float) -> None:
        if await self.gone.observed(found, at):
            self.on_requeued()  # ours to claim now, not at the next poll

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
        A count that took long (a large backlog) spaces the next one out, to
        ``STATS_COST_FACTOR`` times its duration.
        """
        while True:
            self._changed.clear()
            began = time.monotonic()
            try:
                await self.stats()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("stats round failed: %s", exc)
            counted = time.monotonic()
            pause = max(STATS_AFTER_CHANGE_SECONDS, STATS_COST_FACTOR * (counted - began))
            try:
                # Not asyncio.wait_for: on 3.11 it returns normally when the event is
                # set just as the round is cancelled, and the round would live on.
                async with asyncio.timeout(self.settings.stats_seconds):
                    await self._changed.wait()
            except TimeoutError:
                continue
            await asyncio.sleep(max(0.0, counted + pause - time.monotonic()))

    async def heartbeat(self) -> None:
        """Push out the leases of every held attempt (now, whatever their age)."""
        await self.leases.heartbeat(self.store, self.settings.owner, self.settings.lease_seconds)

    async def reconcile(self) -> None:
        """Every reconciler part now, whatever a probe would say.

        Resolve expired attempts, act on approval deadlines, move cancelled runs
        on, note holds.

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
            lookups=self._lookups,
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
        await self.store.run_sync(self._stopping, "advancing stopping runs")

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
