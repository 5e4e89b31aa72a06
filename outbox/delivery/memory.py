"""The delivery store in Python dicts: the daemon's rules tested in milliseconds.

:class:`InMemoryStore` fills :class:`~outbox.delivery.seam.DeliveryStore` the
way the PostgreSQL store does, so a :class:`~outbox.delivery.daemon.DeliveryDaemon`
runs on it unchanged (Procrastinate's ``InMemoryConnector`` is the model):

- a claim takes pending effects of a kind whose time has come, highest priority
  first, round-robin between fairness keys, never the next effect of an
  ordering key while an earlier one is open, within a kind's declared rate
  (the same GCRA as ``outbox_rate_limits``); it increments the attempt (the
  fencing token) and leases it;
- an outcome, a renewal, a note, an expiry or a take-over changes an effect
  only while it still holds that attempt (in flight under that owner, or set
  aside by a reconciler); a late outcome is logged ``stale`` and changes
  nothing else;
- a batch transaction (outcomes, claim, renewals, probe) is all or nothing.

What it leaves out: runs (so no approval deadlines and no stopping runs: its
duty probe never finds them), payloads stored by reference, other processes'
session locks (no owner is ever gone), notes on unknown kinds. Faults are
injected by hand: :meth:`InMemoryStore.fail` makes the next calls of one
operation raise, :meth:`InMemoryStore.refuse` makes outcome writes refuse rows
(a poison outcome, a role without a privilege).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar
from uuid import UUID

from outbox.delivery.memory_effects import MemoryEffect, ready_effects
from outbox.errors import DatabaseError, OutboxError
from outbox.models import OPEN_EFFECT_STATUSES, EffectStatus
from outbox.storage.attempts import Batched, ClaimedEffect, Completion, DutyAsk, DutyFindings
from outbox.storage.run_tx import RunTx
from outbox.storage.sql.maintenance import StateCounts
from outbox.storage.sql.queue import QueueSpec, Rate

__all__ = ["InMemoryStore", "MemoryEffect"]

T = TypeVar("T")
_OPEN = frozenset(OPEN_EFFECT_STATUSES)


class _HeldLock:
    """An owner lock nobody else can hold: memory is one process."""

    def start(self) -> None:
        """Nothing to take."""

    async def wait_held(self, timeout: float) -> bool:
        """Held at once."""
        return True

    async def close(self) -> None:
        """Nothing to release."""


class InMemoryStore:
    """Effects in a dict, with the PostgreSQL store's rules (see the module docstring)."""

    def __init__(self) -> None:
        self.effects: dict[UUID, MemoryEffect] = {}
        self._seq = itertools.count(1)
        self._listeners: set[asyncio.Event] = set()
        #: kind -> theoretical arrival time of its rate (monotonic)
        self._tat: dict[str, float] = {}
        self._faults: dict[str, list[BaseException]] = defaultdict(list)
        self._refuse: Callable[[Completion], str | None] | None = None
        #: Transactions per operation, as a benchmark's probe would count them.
        self.calls: dict[str, int] = defaultdict(int)
        #: Runs that hold their effects (paused, or being stopped): a test sets them.
        self.holding_runs: set[UUID] = set()

    #: One store, no shards: outcomes are written a batch at a time.
    distributed = False

    # -- setting up a test ---------------------------------------------------------------

    def add(
        self,
        kind: str,
        payload: Any = None,
        *,
        key: str | None = None,
        max_attempts: int | None = None,
        ordering_key: str | None = None,
        priority: int = 0,
        fairness_key: str = "",
        delay: float = 0.0,
    ) -> UUID:
        """Intend one effect (committed at once); listeners are woken, as by a NOTIFY."""
        effect_id = uuid.uuid4()
        self.effects[effect_id] = MemoryEffect(
            id=effect_id,
            seq=next(self._seq),
            kind=kind,
            payload={} if payload is None else payload,
            idempotency_key=key or effect_id.hex,
            max_attempts=max_attempts,
            ordering_key=ordering_key,
            priority=priority,
            fairness_key=fairness_key,
            available_at=time.monotonic() + delay,
        )
        for wake in self._listeners:
            wake.set()
        return effect_id

    def fail(self, operation: str, error: BaseException, *, times: int = 1) -> None:
        """Make the next ``times`` calls of ``operation`` raise ``error`` (changing nothing).

        Operations: ``claim``, ``complete`` (every outcome write, with or without
        a claim), ``complete_and_claim``, ``extend``, ``note``, ``probe``.
        """
        self._faults[operation] += [error] * times

    def refuse(self, why: Callable[[Completion], str | None] | None) -> None:
        """Refuse outcome writes holding a completion for which ``why`` returns a reason.

        The write raises a non-transient :class:`DatabaseError` and changes
        nothing, as a statement PostgreSQL refuses does (None: refuse nothing).
        """
        self._refuse = why

    def status(self, effect_id: UUID) -> str:
        """The effect's status now."""
        return self.effects[effect_id].status

    # -- faults --------------------------------------------------------------------------

    def _fault(self, *operations: str) -> None:
        for operation in operations:
            self.calls[operation] += 1
            if self._faults[operation]:
                raise self._faults[operation].pop(0)

    def _check_outcomes(self, done: Sequence[Completion]) -> None:
        if self._refuse is None:
            return
        for completion in done:
            reason = self._refuse(completion)
            if reason is not None:
                raise DatabaseError(f"recording outcomes failed: {reason}", sqlstate="42501")

    # -- the claim / call / complete path --------------------------------------------------

    async def claim_many(
        self,
        spec: QueueSpec,
        quotas: Sequence[tuple[dict[str, str], int]],
        *,
        owner: str,
        lease_seconds: float,
        rates: Mapping[str, Rate] | None = None,
    ) -> list[ClaimedEffect]:
        """Claim up to each kind's quota (see the module docstring)."""
        await asyncio.sleep(0)  # a statement's round trip lets others run
        self._fault("claim")
        return self._claim(quotas, owner, lease_seconds, rates)

    def _claim(
        self,
        quotas: Sequence[tuple[dict[str, str], int]],
        owner: str,
        lease_seconds: float,
        rates: Mapping[str, Rate] | None,
    ) -> list[ClaimedEffect]:
        now = time.monotonic()
        claimed: list[ClaimedEffect] = []
        for partition, limit in quotas:
            kind = partition.get("kind", "")
            rate = None if rates is None else rates.get(kind)
            if rate is not None:
                behind = max(self._tat.get(kind, now) - now, 0.0)
                limit = min(limit, max(math.floor(rate.burst - behind * rate.per_second), 0))
            picked = ready_effects(self.effects.values(), kind, limit, now)
            if rate is not None and picked:
                self._tat[kind] = max(self._tat.get(kind, now), now) + len(picked) / rate.per_second
            for effect in picked:
                effect.status = EffectStatus.IN_FLIGHT
                effect.lease_owner = owner
                effect.lease_expires_at = now + lease_seconds
                effect.attempt += 1
                effect.attempt_started_at = datetime.now(UTC)
                claimed.append(effect.claimed())
        return claimed

    async def complete(self, owner: str, done: Sequence[Completion]) -> list[tuple[UUID, str]]:
        """Record outcomes, fenced: a row changes only while it still holds the attempt."""
        await asyncio.sleep(0)  # a statement's round trip lets others run
        self._fault("complete")
        self._check_outcomes(done)
        return self._complete(owner, done)

    def _complete(self, owner: str, done: Sequence[Completion]) -> list[tuple[UUID, str]]:
        now = time.monotonic()
        logged = []
        for c in done:
            effect = self.effects.get(c.effect_id)
            holds = effect is not None and effect.attempt == c.attempt
            if effect is not None and holds:
                holds = (
                    effect.status == EffectStatus.IN_FLIGHT and effect.lease_owner == owner
                ) or effect.status in (EffectStatus.UNKNOWN, EffectStatus.PENDING)
            outcome = c.outcome if holds else "stale"
            if effect is not None and holds:
                effect.status = c.status
                if c.status == EffectStatus.SUCCEEDED:
                    effect.result = c.result_json
                effect.last_error = c.error
                if c.status == EffectStatus.PENDING:
                    effect.available_at = now + c.delay
                    if effect.run_id in self.holding_runs:  # as the hold trigger does
                        effect.status = EffectStatus.PAUSED
                effect.lease_owner = effect.lease_expires_at = None
            if effect is not None:
                # A stale outcome is logged with what it reported, as the SQL logs it.
                detail = (
                    c.detail_json if holds else {"reported": c.outcome, "detail": c.detail_json}
                )
                effect.log.append((c.attempt, owner, outcome, detail))
            logged.append((c.effect_id, outcome))
        return logged

    async def complete_and_claim(
        self,
        owner: str,
        done: Sequence[Completion],
        spec: QueueSpec,
        quotas: Sequence[tuple[dict[str, str], int]],
        *,
        lease_seconds: float,
        rates: Mapping[str, Rate] | None = None,
        extend: Sequence[tuple[UUID, int]] = (),
        probe: DutyAsk | None = None,
    ) -> Batched:
        """All of it or nothing: outcomes, the next claim, renewals, the probe."""
        await asyncio.sleep(0)  # a statement's round trip lets others run
        self._fault("complete", "complete_and_claim")
        self._check_outcomes(done)
        logged = self._complete(owner, done)
        claimed = self._claim(quotas, owner, lease_seconds, rates)
        kept = self._extend(extend, owner, lease_seconds)
        findings = None if probe is None else self._probe(probe)
        return Batched(logged, claimed, kept, findings)

    async def extend(
        self, spec: QueueSpec, held: Sequence[tuple[UUID, int]], *, owner: str, lease_seconds: float
    ) -> set[UUID]:
        """Push out the leases still ours; their ids."""
        await asyncio.sleep(0)  # a statement's round trip lets others run
        self._fault("extend")
        return self._extend(held, owner, lease_seconds)

    def _extend(
        self, held: Sequence[tuple[UUID, int]], owner: str, lease_seconds: float
    ) -> set[UUID]:
        kept = set()
        for effect_id, attempt in held:
            effect = self.effects.get(effect_id)
            if self._ours(effect, attempt, owner):
                assert effect is not None
                effect.lease_expires_at = time.monotonic() + lease_seconds
                kept.add(effect_id)
        return kept

    @staticmethod
    def _ours(effect: MemoryEffect | None, attempt: int, owner: str) -> bool:
        return (
            effect is not None
            and effect.attempt == attempt
            and effect.status == EffectStatus.IN_FLIGHT
            and effect.lease_owner == owner
        )

    async def with_payload(self, effect: ClaimedEffect) -> ClaimedEffect:
        """Payloads are kept inline here."""
        return effect

    async def run_holds(self, run_id: UUID, effect_id: UUID) -> bool:
        """Whether the run is one a test made hold its effects."""
        await asyncio.sleep(0)  # a statement's round trip lets others run
        return run_id in self.holding_runs

    async def note_attempt(
        self,
        effect_id: UUID,
        attempt: int,
        *,
        owner: str,
        note: Mapping[str, Any],
        shard: int | None = None,
    ) -> bool:
        """Keep a deliverer's note on the attempt, fenced."""
        await asyncio.sleep(0)  # a statement's round trip lets others run
        self._fault("note")
        effect = self.effects.get(effect_id)
        if not self._ours(effect, attempt, owner):
            return False
        assert effect is not None
        effect.attempt_note = {**note, "attempt": attempt}
        return True

    async def listen_for_effects(self, wake: asyncio.Event) -> None:
        """Set ``wake`` whenever :meth:`add` intends an effect, until cancelled."""
        self._listeners.add(wake)
        wake.set()
        try:
            await asyncio.get_running_loop().create_future()
        finally:
            self._listeners.discard(wake)

    def owner_lock(self, owner: str) -> _HeldLock:
        """Held at once (no other process can hold it)."""
        return _HeldLock()

    # -- the background rounds -------------------------------------------------------------

    async def probe_duties(self, ask: DutyAsk) -> DutyFindings:
        """Whether the reconciler has work (runs, hence approvals and stopping, are not kept)."""
        await asyncio.sleep(0)  # a statement's round trip lets others run
        self._fault("probe")
        return self._probe(ask)

    def _probe(self, ask: DutyAsk) -> DutyFindings:
        now = time.monotonic()
        expired = any(self._expired(e, now) for e in self.effects.values()) or any(
            e.status == EffectStatus.UNKNOWN and e.kind in ask.askable
            for e in self.effects.values()
        )
        return DutyFindings(expired=expired)

    @staticmethod
    def _expired(effect: MemoryEffect, now: float) -> bool:
        return (
            effect.status == EffectStatus.IN_FLIGHT
            and effect.lease_expires_at is not None
            and effect.lease_expires_at < now
        )

    async def expired(
        self, max_rows: int, *, redispatch_as: str | None = None
    ) -> tuple[int, list[ClaimedEffect]]:
        """In-flight attempts whose lease ran out, oldest lease first (no dispatches here)."""
        now = time.monotonic()
        rows = sorted(
            (e for e in self.effects.values() if self._expired(e, now)),
            key=lambda e: e.lease_expires_at or 0.0,
        )
        return 0, [e.claimed() for e in rows[:max_rows]]

    async def unknown_of(self, kinds: Sequence[str], max_rows: int) -> list[ClaimedEffect]:
        """``unknown`` effects of these kinds, oldest first."""
        rows = [
            e for e in self.effects.values() if e.status == EffectStatus.UNKNOWN and e.kind in kinds
        ]
        return [e.claimed() for e in sorted(rows, key=lambda e: e.seq)[:max_rows]]

    async def expire(
        self,
        effect_id: UUID,
        attempt: int,
        *,
        new_status: str,
        note: str,
        resolution: str,
        worker: str,
        shard: int | None = None,
    ) -> bool:
        """Resolve one expired attempt, logged ``expired`` (compare-and-set)."""
        effect = self.effects.get(effect_id)
        now = time.monotonic()
        if effect is None or effect.attempt != attempt or not self._expired(effect, now):
            return False
        effect.status = new_status
        effect.lease_owner = effect.lease_expires_at = None
        effect.available_at = now
        effect.last_error = note
        effect.log.append((attempt, worker, "expired", {"resolution": resolution, "note": note}))
        return True

    async def take_over(
        self,
        effect_id: UUID,
        attempt: int,
        *,
        owner: str,
        lease_seconds: float,
        shard: int | None = None,
    ) -> bool:
        """Lease an expired attempt to ``owner`` (compare-and-set)."""
        effect = self.effects.get(effect_id)
        now = time.monotonic()
        if effect is None or effect.attempt != attempt or not self._expired(effect, now):
            return False
        effect.lease_owner, effect.lease_expires_at = owner, now + lease_seconds
        return True

    async def mark_unknown_kinds(self, known: Sequence[str], **_: Any) -> int:
        """Notes on unknown kinds are not kept here."""
        return 0

    async def note_blocked_by_order(self, **_: Any) -> int:
        """Notes on blocked ordering keys are not kept here."""
        return 0

    async def gone_owners(self, kinds: Sequence[str], **_: Any) -> list[tuple[str, bool]]:
        """No owner is ever gone: memory is one process."""
        return []

    async def expire_gone_owner(
        self, owner: str, limits: Mapping[str, int], **_: Any
    ) -> list[UUID]:
        """No owner is ever gone."""
        return []

    async def forget_gone_owners(self, candidates: Sequence[str], **_: Any) -> int:
        """No owner is ever gone."""
        return 0

    async def run_sync(self, fn: Callable[[RunTx], T], what: str = "a run transaction") -> T:
        """Runs are not kept here (the duty probe never asks for this)."""
        raise OutboxError(f"{what}: the in-memory store keeps no runs")

    async def state_counts(self) -> StateCounts:
        """Open effects by (status, kind), and how long the longest-due pending one waited."""
        now = time.monotonic()
        counts: dict[tuple[str, str], int] = defaultdict(int)
        oldest = 0.0
        for e in self.effects.values():
            if e.status in _OPEN:
                counts[(str(e.status), e.kind)] += 1
            if e.status == EffectStatus.PENDING and e.available_at <= now:
                oldest = max(oldest, now - e.available_at)
        return StateCounts(runs={}, effects=dict(counts), oldest_pending_seconds=oldest)
