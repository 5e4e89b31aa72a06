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
import contextlib
import logging
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from outbox.delivery.attempt import perform_attempt, released
from outbox.delivery.contract import AttemptNotes, Deliverer, Retry
from outbox.delivery.leases import Leases
from outbox.delivery.maintenance import Maintenance
from outbox.delivery.metrics import DeliveryMetrics
from outbox.delivery.recording import OutcomeWriter, Written, describe, one_per_effect
from outbox.delivery.seam import DeliveryStore, OwnerLockLike
from outbox.delivery.settings import DeliverySettings
from outbox.delivery.sources import EffectSource, PollSource, Writing, wait_or_wake
from outbox.delivery.storable import storable_text
from outbox.faults import crash_point
from outbox.models import AttemptOutcome, EffectStatus
from outbox.storage.attempts import ClaimedEffect, Completion

__all__ = ["DeliveryDaemon"]

log = logging.getLogger(__name__)

#: After a transient failure to write outcomes, wait this long before trying
#: again, doubling up to RECORD_RETRY_MAX_SECONDS while the failures go on.
RECORD_RETRY_SECONDS = 0.5
RECORD_RETRY_MAX_SECONDS = 10.0
#: A kind whose outcomes cannot be written at all is paused this long, doubling
#: up to UNRECORDABLE_PAUSE_MAX_SECONDS while it goes on: no claims, no calls.
UNRECORDABLE_PAUSE_SECONDS = 1.0
UNRECORDABLE_PAUSE_MAX_SECONDS = 60.0
#: At shutdown, a write past the grace period still gets this long (one try).
LAST_WRITE_SECONDS = 0.25
#: How long the first claim waits for the owner's session lock. Without it this
#: daemon's death is seen only when its leases run out; it claims anyway.
OWNER_LOCK_WAIT_SECONDS = 5.0


class DeliveryDaemon:
    """Delivers effects of the kinds in ``deliverers`` from ``source`` until :meth:`stop`."""

    def __init__(
        self,
        store: DeliveryStore,
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
        self._writer = OutcomeWriter(store, self.owner)
        self._write_retry = RECORD_RETRY_SECONDS
        self._unrecordable_pause: dict[str, float] = {}
        #: When shutdown must be over (set by :meth:`stop`): calls, writes, everything.
        self._deadline: float | None = None
        self._closing = False
        self._maintenance: Maintenance | None = None
        #: Attempts whose final outcome (not a retry) this daemon recorded.
        self.delivered = 0

    # -- lifecycle ----------------------------------------------------------------

    def stop(self) -> None:
        """Stop taking work; in-flight calls get ``grace_seconds`` to finish."""
        log.info("stopping: no new claims; waiting for %d in-flight calls", len(self.leases))
        if self._deadline is None:
            self._deadline = time.monotonic() + self.settings.grace_seconds
        self._stopping.set()
        self._room.set()
        self.source.wake()

    async def run(self) -> None:
        """Deliver until stopped, then drain gracefully."""
        self._maintenance = maintenance = Maintenance(
            self.store, self.deliverers, self.settings, self.leases, self.metrics, self.source.wake
        )
        owner_lock = self.store.owner_lock(self.owner) if self.settings.early_recovery else None
        if owner_lock is not None:
            owner_lock.start()
            held = await self._until_held_or_stopped(owner_lock)
            if not held and not self._stopping.is_set():
                log.warning(
                    "owner %s: no session lock yet; if this process dies its attempts "
                    "wait for their leases",
                    self.owner,
                )
        await self.source.open()
        background = maintenance.start()
        writer = asyncio.create_task(self._write_completions(), name="completions")
        try:
            await self._take_loop()
            await self._drain()
        finally:
            if self._deadline is None:  # ended by an error, not by stop(): still bounded
                self._deadline = time.monotonic() + self.settings.grace_seconds
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            # The writer may finish the write it is in until the deadline: a write
            # cancelled half-way cannot tell whether it committed. Past the deadline
            # (a write started before the stop, on a locked table, say) it is cancelled
            # and its outcomes are left to the reconciler, as after a crash.
            self._closing = True
            self._done_ready.set()
            left = max(self._deadline - time.monotonic(), LAST_WRITE_SECONDS)
            finished, _ = await asyncio.wait({writer}, timeout=left)
            if not finished:
                log.warning(
                    "grace period over while outcomes were being written; the reconciler "
                    "resolves those attempts when their leases run out"
                )
                writer.cancel()
                await asyncio.gather(writer, return_exceptions=True)
            await self._flush()
            await self.source.close(max(self._deadline - time.monotonic(), LAST_WRITE_SECONDS))
            if owner_lock is not None:
                await owner_lock.close()
            for deliverer in self.deliverers.values():
                # Clients such as httpx's belong to this event loop: close them on it.
                await deliverer.aclose()

    async def _until_held_or_stopped(self, lock: OwnerLockLike) -> bool:
        """Wait for the owner lock, at most OWNER_LOCK_WAIT_SECONDS, or until a stop."""
        held = asyncio.ensure_future(lock.wait_held(OWNER_LOCK_WAIT_SECONDS))
        stopped = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({held, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not held.done():
                held.cancel()
        return held.done() and not held.cancelled() and held.result()

    async def _drain(self) -> None:
        for effect in self.leases.unstarted():
            self._record(released(effect, "released unstarted at shutdown"))
        deadline = self._deadline or time.monotonic() + self.settings.grace_seconds
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
            try:
                batch = await self.source.take(self.leases)
            except Exception as exc:
                # A source that failed (a deadlock, a lost connection, a broker
                # away) has kept nothing it could not give back: try again later.
                log.warning("taking effects from %s failed (%s); retrying", self.source.name, exc)
                await wait_or_wake(self._room, self.settings.poll_seconds)
                continue
            if batch:
                self._changed()
            if self._stopping.is_set():
                for effect in batch:
                    self._record(released(effect, "released unstarted at shutdown"))
                break
            self._hold(batch, self.source.claim_sent)

    def _hold(self, batch: list[ClaimedEffect], asked: float) -> None:
        """Hold attempts claimed by a claim sent at ``asked``; start those that may start."""
        for effect in batch:
            if effect.kind in self.deliverers:
                self.leases.hold(effect, asked)
            else:  # a record of a kind this process does not deliver
                self._record(released(effect, f"no deliverer for kind {effect.kind!r} here"))
        self._start_ready()

    def _start_ready(self) -> None:
        for effect in self.leases.startable():
            task = asyncio.create_task(self._deliver(effect))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    # -- one delivery -------------------------------------------------------------

    def _not_called(self, effect: ClaimedEffect, level: int, logged: str, why: str) -> None:
        """Give a held attempt back uncalled (logged at ``level``); ``why`` goes in its record."""
        log.log(
            level,
            "effect %s attempt %d: %s; not called",
            effect.id,
            effect.attempt,
            logged,
            extra={"effect_id": str(effect.id), "attempt": effect.attempt},
        )
        self._record(released(effect, f"{why}: not called"))

    async def _deliver(self, effect: ClaimedEffect) -> None:
        if self._stopping.is_set():
            self._record(released(effect, "released unstarted at shutdown"))
            return
        if not self.leases.may_call(effect, self.settings.lease_seconds):
            # It waited (behind a cap, a pause) and its lease may be another's now:
            # a reconciler that took it over redelivers or asks the sink, so a call
            # here could be a second one. Given back unstarted; fenced, so it is
            # logged as stale if the lease is indeed no longer ours.
            self._not_called(
                effect,
                logging.WARNING,
                "lease lost while it waited",
                "lease lost before the call started",
            )
            return
        try:
            attempt = await self.store.with_payload(effect)
        except Exception as exc:  # the payload is read again with the next attempt
            log.warning("effect %s: its payload could not be read: %s", effect.id, exc)
            self._record(released(effect, f"payload could not be read: {exc}", delay=1.0))
            return
        if self.leases.waited(effect) and effect.run_id is not None:
            # A pause or a cancel counts a claimed attempt as started. One that
            # waited (a stream source claims what its records name, whatever the
            # kind's room) may have waited past one: given back instead, the
            # hold trigger keeps it for its run. (Asked last, just before the call.)
            try:
                holds = await self.store.run_holds(effect.run_id, effect.id)
            except Exception as exc:
                self._record(released(effect, f"its run could not be read: {exc}", delay=1.0))
                return
            if holds:
                self._not_called(
                    effect,
                    logging.INFO,
                    "its run was paused or stopped while it waited",
                    "its run holds its effects",
                )
                return
        try:
            completion, outcome = await perform_attempt(
                self.deliverers[effect.kind],
                attempt,
                policy=self.settings.retry_policy,
                default_max_attempts=self.settings.max_attempts,
                schema_retry_seconds=self.settings.schema_retry_seconds,
                notes=self._notes(effect),
            )
        except Exception as exc:
            # A bug around the call (a deliverer's parse_payload, say): without a record
            # the attempt would be held, its lease renewed, for ever. The call may have
            # been made, so it goes to an operator rather than out again.
            log.exception("attempt at effect %s failed outside the call", effect.id)
            completion = Completion(
                effect.id,
                effect.attempt,
                EffectStatus.UNKNOWN,
                AttemptOutcome.UNKNOWN,
                error=storable_text(f"the attempt failed: {type(exc).__name__}: {exc}"),
                started_at=effect.started_iso,
                shard=effect.shard,
            )
            outcome = None
        if isinstance(outcome, Retry) and outcome.rate_limited:
            self._pause(effect.kind, outcome.after if outcome.after is not None else 1.0)
        self._record(completion)

    def _changed(self) -> None:
        if self._maintenance is not None:
            self._maintenance.changed()

    def _notes(self, effect: ClaimedEffect) -> AttemptNotes:
        """Where this attempt's deliverer notes what a later lookup needs (fenced by attempt)."""
        owner = effect.lease_owner or self.owner

        async def write(note: Mapping[str, Any]) -> bool:
            written = await self.store.note_attempt(
                effect.id, effect.attempt, owner=owner, note=note, shard=effect.shard
            )
            crash_point("after_note")
            return written

        return AttemptNotes(write, asyncio.get_running_loop())

    def _pause(self, kind: str, seconds: float, why: str = "rate-limited") -> None:
        """Hold ``kind`` back; what waits behind the pause starts when it ends.

        Started by a timer rather than by the take loop, which waits in its
        source (a claim, a Kafka poll) and so may not look again in time.
        """
        self.leases.pause(kind, seconds, why=why)
        asyncio.get_running_loop().call_later(seconds, self._start_ready)

    def _record(self, completion: Completion) -> None:
        self._done.append(completion)
        self._done_ready.set()

    # -- recording outcomes -------------------------------------------------------

    async def _write_completions(self) -> None:
        while not self._closing:
            await self._done_ready.wait()
            self._done_ready.clear()
            await self._flush()

    async def _linger(self) -> None:
        """Wait up to the source's linger while attempts are under way and the batch has room."""
        # (a source written before ``linger`` existed has none: it never waits)
        linger = getattr(self.source, "linger", 0.0)
        if linger <= 0:
            return
        until = time.monotonic() + linger
        while (
            len(self._done) < self.settings.batch_size
            and not self._stopping.is_set()
            # A task that recorded its outcome is done by the time this runs.
            and any(not task.done() for task in self._tasks)
        ):
            left = until - time.monotonic()
            if left <= 0:
                return
            self._done_ready.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._done_ready.wait(), left)

    def _write_timeout(self) -> float | None:
        """How long one write may take: unbounded while running, the grace left when stopping."""
        if self._deadline is None:
            return None
        return max(self._deadline - time.monotonic(), LAST_WRITE_SECONDS)

    async def _flush(self) -> None:
        while self._done:
            await self._linger()
            batch, self._done = one_per_effect(self._done)
            maintenance = self._maintenance
            writing = Writing(
                self._writer,
                self.leases,
                self._write_timeout(),
                claim=not self._stopping.is_set(),
                # The heartbeat and the duty probe ride a transaction that claims when
                # due, so a busy daemon's rounds find nothing left to do on their own.
                ride=maintenance.ride if maintenance is not None else None,
            )
            sent = time.monotonic()
            written = await self.source.write(batch, writing)
            if maintenance is not None and written.ride is not None:
                if written.duties_failed:
                    maintenance.ride_failed()
                elif not written.left and written.rode:
                    maintenance.rode(written.ride, written.kept, written.findings)
            self._account(batch, written)
            if written.claimed:
                self._hold(written.claimed, sent)
            finished = [*written.logged, *written.abandoned]
            if finished:
                self._changed()
                try:
                    await self.source.recorded(finished)
                except Exception as exc:  # the source re-reads; recorded effects are skipped
                    log.warning("source could not take note of %d outcomes: %s", len(batch), exc)
                self._room.set()  # slots are free again
                self.source.wake()
            if not written.left:
                self._write_retry = RECORD_RETRY_SECONDS
                continue
            left = written.left + self._done
            self._done = []
            if self._deadline is not None and time.monotonic() >= self._deadline:
                # Their leases run out (heartbeats have stopped) and the reconciler of
                # a living process resolves them, as after a crash.
                log.warning(
                    "grace period over: %d outcomes not recorded (%s); their leases will run "
                    "out and the reconciler will resolve them",
                    len(left),
                    describe(written.error) if written.error else "no time left",
                )
                return
            log.warning(
                "recording %d outcomes failed (%s); retrying in %.1fs",
                len(left),
                describe(written.error) if written.error else "?",
                self._write_retry,
            )
            self._done = left + self._done
            if self._deadline is None:
                await wait_or_wake(self._stopping, self._write_retry)  # a stop cuts it short
            else:
                await asyncio.sleep(
                    min(self._write_retry, max(0.0, self._deadline - time.monotonic()))
                )
            self._write_retry = min(self._write_retry * 2, RECORD_RETRY_MAX_SECONDS)

    def _account(self, batch: list[Completion], written: Written) -> None:
        now = datetime.now(UTC)
        outcomes = written.logged
        abandoned: dict[str, list[Completion]] = {}
        for completion in batch:
            if completion.effect_id in written.abandoned:
                held = self.leases.release(completion.effect_id, completion.attempt)
                if held is not None:
                    abandoned.setdefault(held.effect.kind, []).append(completion)
                continue
            if completion.effect_id not in outcomes:
                continue  # left for a later write
            held = self.leases.release(completion.effect_id, completion.attempt)
            if held is None:
                continue
            kind = held.effect.kind
            substituted = completion.effect_id in written.substituted
            if not substituted:  # this kind's outcomes can be written (again)
                self._unrecordable_pause.pop(kind, None)
            outcome = outcomes[completion.effect_id]
            final = substituted or completion.status != EffectStatus.PENDING
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
        for kind, completions in abandoned.items():
            self._abandon(kind, completions, written.abandoned)
        self._start_ready()

    def _abandon(self, kind: str, completions: list[Completion], why: dict[UUID, str]) -> None:
        """Nothing could be written for these attempts (their leases are released): pause ``kind``.

        Their leases are no longer renewed, so the reconciler resolves them once
        they run out (redelivery with the same key for an idempotent sink,
        ``unknown`` otherwise), here or in a process whose database role can
        write outcomes. Pausing the kind, longer each time, keeps a deliverer that
        cannot record anything from calling sinks in a loop.
        """
        self.metrics.unrecorded.labels(kind=kind).inc(len(completions))
        pause = self._unrecordable_pause.get(kind, UNRECORDABLE_PAUSE_SECONDS / 2) * 2
        pause = min(pause, UNRECORDABLE_PAUSE_MAX_SECONDS)
        self._unrecordable_pause[kind] = pause
        self._pause(kind, pause, why="cannot record outcomes")
        first = completions[0]
        reason = why[first.effect_id]
        hint = ""
        if "SQLSTATE 42501" in reason:
            hint = " (the database role lacks a privilege: see docs/howto/run-deliverers.md)"
        log.error(
            "%d outcomes of kind %s could not be recorded at all, e.g. effect %s attempt %d: "
            "%s%s. Their leases are no longer renewed: the reconciler resolves them when the "
            "leases run out. Kind %s is paused for %.0fs.",
            len(completions),
            kind,
            first.effect_id,
            first.attempt,
            reason,
            hint,
            kind,
            pause,
            extra={"effect_id": str(first.effect_id), "attempt": first.attempt},
        )
