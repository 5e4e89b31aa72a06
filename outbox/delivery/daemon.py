"""The delivery daemon (poll mode): claim pending effects, call their deliverers, record outcomes.

One asyncio loop per process. Claims are bounded batches (``FOR UPDATE SKIP
LOCKED``, one statement per kind), so memory does not grow with the backlog.
Every claimed effect starts at once; outcomes are written in batches by one
writer, so a batch costs two transactions (claim, complete). Leases are pushed
out by a heartbeat while calls run. A ``LISTEN`` connection wakes the claim loop
when intents commit; a poll is always there as the backstop. The reconciler runs
on an interval, so a dead daemon's effects are recovered by the living.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from outbox.delivery import (
    Deliverer,
    Retry,
)
from outbox.delivery.attempt import perform_attempt
from outbox.delivery.metrics import DeliveryMetrics
from outbox.delivery.reconcile import reconcile
from outbox.faults import crash_point
from outbox.retry import RetryPolicy
from outbox.storage.async_store import AsyncDeliveryStore, Completion
from outbox.storage.notify import listen
from outbox.storage.sql.queue import EFFECT_QUEUE, RELAY_OWNER_PREFIX
from outbox.storage.sql.steps import EFFECTS_CHANNEL

__all__ = ["DeliverSettings", "DeliveryDaemon", "default_owner"]

log = logging.getLogger(__name__)

RESULT_LIMIT = 64 * 1024


def default_owner() -> str:
    """A lease owner name unique to this process: host, pid and a random suffix."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class DeliverSettings(BaseModel):
    """How one delivery daemon behaves."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Twice the batch size: the next claim can start while the previous batch's
    # completion commits, instead of waiting for its slots (measured in bench/).
    concurrency: int = Field(default=200, ge=1, le=10_000)
    batch_size: int = Field(default=100, ge=1, le=10_000)
    lease_seconds: float = Field(default=10.0, gt=0)
    poll_seconds: float = Field(default=1.0, gt=0)
    reconcile_seconds: float = Field(default=1.0, gt=0)
    grace_seconds: float = Field(default=30.0, ge=0)
    unknown_kind_grace_seconds: float = Field(default=60.0, ge=0)
    schema_retry_seconds: float = Field(default=300.0, ge=0)
    stats_seconds: float = Field(default=15.0, gt=0)
    owner: str = Field(default_factory=default_owner)
    retry_base_seconds: float = Field(default=0.5, ge=0)
    retry_cap_seconds: float = Field(default=300.0, ge=0)
    max_attempts: int = Field(default=10, ge=1)

    @property
    def heartbeat_seconds(self) -> float:
        """How often leases are pushed out: three times per lease."""
        return self.lease_seconds / 3

    @property
    def retry_policy(self) -> RetryPolicy:
        """The backoff shape."""
        return RetryPolicy(self.retry_base_seconds, self.retry_cap_seconds, self.max_attempts)

    @field_validator("owner")
    @classmethod
    def _not_a_relay(cls, owner: str) -> str:
        # Stream deliverers take effects from relay-named owners; a deliverer so
        # named would have its calls taken from it mid-flight.
        if owner.startswith(RELAY_OWNER_PREFIX):
            raise ValueError(f"a deliverer's owner may not start with {RELAY_OWNER_PREFIX!r}")
        return owner


@dataclass
class _Held:
    """A claimed attempt until its outcome is recorded."""

    kind: str
    attempt: int
    created_at: datetime
    lease_lost: bool = False


class DeliveryDaemon:
    """Delivers pending effects of the kinds in ``deliverers`` until :meth:`stop`."""

    def __init__(
        self,
        store: AsyncDeliveryStore,
        dsn: str,
        deliverers: Mapping[str, Deliverer],
        settings: DeliverSettings | None = None,
        metrics: DeliveryMetrics | None = None,
    ) -> None:
        self.store = store
        self.dsn = dsn
        self.deliverers = dict(deliverers)
        self.settings = settings or DeliverSettings()
        self.metrics = metrics or DeliveryMetrics()
        self.owner = self.settings.owner
        self._held: dict[uuid.UUID, _Held] = {}
        self._by_kind: dict[str, int] = dict.fromkeys(self.deliverers, 0)
        self._paused_until: dict[str, float] = {}
        self._kinds_rr = list(self.deliverers)
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._done: list[Completion] = []
        self._done_ready = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self.delivered = 0

    # -- lifecycle ----------------------------------------------------------------

    def stop(self) -> None:
        """Stop claiming; in-flight calls get ``grace_seconds`` to finish."""
        log.info("stopping: no new claims; waiting for %d in-flight calls", len(self._held))
        self._stopping.set()
        self._wake.set()

    async def run(self) -> None:
        """Deliver until stopped, then drain gracefully."""
        background = [
            asyncio.create_task(self._listen(), name="listen"),
            asyncio.create_task(self._heartbeat(), name="heartbeat"),
            asyncio.create_task(self._reconcile_loop(), name="reconcile"),
            asyncio.create_task(self._stats_loop(), name="stats"),
        ]
        writer = asyncio.create_task(self._write_completions(), name="completions")
        try:
            await self._claim_loop()
            await self._drain()
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            self._done_ready.set()
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
            await self._flush()
            for deliverer in self.deliverers.values():
                # Clients such as httpx's belong to this event loop: close them on it.
                await deliverer.aclose()

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.settings.grace_seconds
        while self._held and time.monotonic() < deadline:
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

    # -- claiming -----------------------------------------------------------------

    def _quotas(self, free: int) -> list[tuple[dict[str, str], int]]:
        now = time.monotonic()
        quotas: list[tuple[dict[str, str], int]] = []
        self._kinds_rr = self._kinds_rr[1:] + self._kinds_rr[:1]  # fairness between kinds
        for kind in self._kinds_rr:
            if free <= 0:
                break
            if self._paused_until.get(kind, 0) > now:
                continue
            limit = self.deliverers[kind].concurrency
            room = free if limit is None else min(free, limit - self._by_kind[kind])
            room = min(room, self.settings.batch_size)
            if room > 0:
                quotas.append(({"kind": kind}, room))
                free -= room
        return quotas

    async def _claim_loop(self) -> None:
        idle_wait = 0.01
        while not self._stopping.is_set():
            free = self.settings.concurrency - len(self._held)
            quotas = self._quotas(free) if free > 0 else []
            rows: list[Any] = []
            if quotas:
                self._wake.clear()
                try:
                    rows = await self.store.claim_many(
                        EFFECT_QUEUE,
                        quotas,
                        owner=self.owner,
                        lease_seconds=self.settings.lease_seconds,
                    )
                except Exception:
                    log.exception("claim failed; retrying after the poll interval")
                    await self._sleep(self.settings.poll_seconds)
                    continue
                for row in rows:
                    self._start(row)
                if rows:
                    crash_point("after_claim")
            if rows and len(rows) == sum(n for _, n in quotas):
                idle_wait = 0.01
                await asyncio.sleep(0)  # a full batch: more is likely waiting
                continue
            # Adaptive backstop: short right after work, up to poll_seconds when idle.
            await self._sleep(idle_wait)
            idle_wait = min(self.settings.poll_seconds, idle_wait * 2) if not rows else 0.01

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout=seconds)

    def _start(self, row: Any) -> None:
        held = _Held(row["kind"], row["attempt"], row["created_at"])
        self._held[row["id"]] = held
        self._by_kind[held.kind] = self._by_kind.get(held.kind, 0) + 1
        self.metrics.in_flight.set(len(self._held))
        task = asyncio.create_task(self._deliver(row))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- one delivery -------------------------------------------------------------

    async def _deliver(self, row: Any) -> None:
        if self._stopping.is_set():
            started = row["attempt_started_at"]
            self._record(
                Completion(
                    row["id"],
                    row["attempt"],
                    "pending",
                    "released",
                    started_at=started.isoformat() if started else None,
                    error="released unstarted at shutdown",
                ),
            )
            return
        completion, outcome = await perform_attempt(
            self.deliverers[row["kind"]],
            row,
            policy=self.settings.retry_policy,
            default_max_attempts=self.settings.max_attempts,
            schema_retry_seconds=self.settings.schema_retry_seconds,
        )
        if isinstance(outcome, Retry) and outcome.rate_limited:
            kind = row["kind"]
            pause = outcome.after if outcome.after is not None else 1.0
            until = max(self._paused_until.get(kind, 0), time.monotonic() + pause)
            self._paused_until[kind] = until
            log.info("kind %s rate-limited for %.1fs", kind, pause)
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
            except Exception:
                log.exception("recording %d outcomes failed; retrying", len(batch))
                self._done = batch + self._done
                await asyncio.sleep(0.5)
                continue
            now = datetime.now(UTC)
            outcomes = dict(logged)
            for completion in batch:
                held = self._held.pop(completion.effect_id, None)
                if held is None:
                    continue
                self._by_kind[held.kind] -= 1
                outcome = outcomes.get(completion.effect_id, "stale")
                final = completion.status != "pending"
                latency = (now - held.created_at).total_seconds() if final else None
                self.metrics.attempt_recorded(held.kind, outcome, latency)
                if outcome == "stale":
                    log.warning(
                        "outcome of effect %s attempt %d was stale: a newer attempt "
                        "owns it; nothing changed",
                        completion.effect_id,
                        held.attempt,
                        extra={"effect_id": str(completion.effect_id), "attempt": held.attempt},
                    )
                if final:
                    self.delivered += 1
            self.metrics.in_flight.set(len(self._held))
            self._wake.set()  # slots are free again

    # -- background ---------------------------------------------------------------

    async def _listen(self) -> None:
        await listen(self.dsn, EFFECTS_CHANNEL, self._wake)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_seconds)
            held = [(i, h.attempt) for i, h in list(self._held.items()) if not h.lease_lost]
            try:
                kept = await self.store.extend(
                    EFFECT_QUEUE, held, owner=self.owner, lease_seconds=self.settings.lease_seconds
                )
            except Exception as exc:
                log.warning("heartbeat failed (%s); leases may run out", exc)
                continue
            for effect_id, _ in held:
                entry = self._held.get(effect_id)
                if entry is not None and effect_id not in kept and not entry.lease_lost:
                    entry.lease_lost = True
                    self.metrics.leases_lost.labels(kind=entry.kind).inc()
                    log.warning(
                        "lease on effect %s attempt %d was lost; its outcome will be "
                        "recorded as stale",
                        effect_id,
                        entry.attempt,
                        extra={"effect_id": str(effect_id), "attempt": entry.attempt},
                    )

    async def _reconcile_loop(self) -> None:
        last_kinds_check = 0.0
        while True:
            await asyncio.sleep(self.settings.reconcile_seconds)
            try:
                report = await reconcile(
                    self.store,
                    self.deliverers,
                    worker=f"reconciler:{self.owner}",
                    lease_seconds=self.settings.lease_seconds,
                    default_max_attempts=self.settings.max_attempts,
                )
                if report.items:
                    # Effects put back to pending are ours to claim now, not at the next poll.
                    self._wake.set()
                # Cancelled runs move on as their effects finish, even where no
                # worker of their agent runs.
                await self.store.advance_stopping_runs()
                if time.monotonic() - last_kinds_check > 30:
                    last_kinds_check = time.monotonic()
                    await self.store.mark_unknown_kinds(
                        sorted(self.deliverers),
                        grace_seconds=self.settings.unknown_kind_grace_seconds,
                        note_prefix="no deliverer is registered for kind ",
                    )
            except Exception:
                log.exception("reconcile round failed")

    async def _stats_loop(self) -> None:
        while True:
            try:
                counts, oldest = await self.store.open_counts()
                self.metrics.set_states(counts)
                self.metrics.oldest_pending.set(oldest)
            except Exception as exc:
                log.warning("collecting metrics failed: %s", exc)
            await asyncio.sleep(self.settings.stats_seconds)
