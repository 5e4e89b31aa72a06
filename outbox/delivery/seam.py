"""What a delivery daemon needs of its store: the seam PostgreSQL and memory both fill.

The daemon, its sources, leases, outcome writer and background rounds reach
the database only through these methods, so the same daemon runs on
:class:`~outbox.storage.async_store.AsyncStore` (PostgreSQL) and on
:class:`~outbox.delivery.memory.InMemoryStore` (Python dicts), where its rules
(leases, kind caps, rate pauses, retries, abandons, fencing) are tested in
milliseconds. Procrastinate's ``InMemoryConnector`` is the model.

Every method keeps the promises of the PostgreSQL one: a claim increments the
attempt (the fencing token) and leases it; an outcome, a renewal, a note or an
expiry changes a row only while it still holds that attempt (a late outcome is
logged ``stale`` and changes nothing else).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar
from uuid import UUID

from outbox.storage.attempts import Batched, ClaimedEffect, Completion, DutyAsk, DutyFindings
from outbox.storage.run_tx import RunTx
from outbox.storage.sql.maintenance import StateCounts
from outbox.storage.sql.queue import QueueSpec, Rate

__all__ = ["DeliveryStore", "OwnerLockLike"]

T = TypeVar("T")


class OwnerLockLike(Protocol):
    """The session lock a daemon holds for its lease owner while it lives."""

    def start(self) -> None:
        """Start taking and keeping the lock in the background."""

    async def wait_held(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the lock; False if it is not held by then."""
        ...

    async def close(self) -> None:
        """Unregister the owner and release the lock."""


class DeliveryStore(Protocol):
    """The statements of delivery (see :class:`~outbox.storage.async_store.AsyncStore`)."""

    @property
    def distributed(self) -> bool:
        """Whether the database is distributed (Citus), as far as the store knows yet."""
        ...

    # -- the claim / call / complete path ----------------------------------------------

    async def claim_many(
        self,
        spec: QueueSpec,
        quotas: Sequence[tuple[dict[str, str], int]],
        *,
        owner: str,
        lease_seconds: float,
        rates: Mapping[str, Rate] | None = None,
    ) -> list[ClaimedEffect]:
        """Claim up to each partition's quota, in one transaction."""
        ...

    async def complete(self, owner: str, done: Sequence[Completion]) -> list[tuple[UUID, str]]:
        """Record outcomes, fenced; (effect id, logged outcome) per outcome."""
        ...

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
        """Outcomes, the next claim, renewals and the duty probe, all or nothing."""
        ...

    async def extend(
        self, spec: QueueSpec, held: Sequence[tuple[UUID, int]], *, owner: str, lease_seconds: float
    ) -> set[UUID]:
        """Push out these leases; the ids still ours."""
        ...

    async def with_payload(self, effect: ClaimedEffect) -> ClaimedEffect:
        """The attempt with a payload stored by reference read back."""
        ...

    async def run_holds(self, run_id: UUID, effect_id: UUID) -> bool:
        """Whether the run holds this effect back now (paused; stopping, unless a compensation)."""
        ...

    async def note_attempt(
        self,
        effect_id: UUID,
        attempt: int,
        *,
        owner: str,
        note: Mapping[str, Any],
        shard: int | None = None,
    ) -> bool:
        """Store a deliverer's note on the attempt (fenced); False if no longer ours.

        ``shard``: where the claim found the effect.
        """
        ...

    def listen_for_effects(self, wake: asyncio.Event) -> Coroutine[Any, Any, None]:
        """Set ``wake`` whenever effects are committed (run as a task; cancel to stop)."""
        ...

    def owner_lock(self, owner: str) -> OwnerLockLike:
        """The session lock of ``owner`` (see :mod:`outbox.storage.owner_lock`)."""
        ...

    # -- the background rounds ---------------------------------------------------------

    async def probe_duties(self, ask: DutyAsk) -> DutyFindings:
        """Which background duties have work."""
        ...

    async def expired(
        self, max_rows: int, *, redispatch_as: str | None = None
    ) -> tuple[int, list[ClaimedEffect]]:
        """In-flight attempts whose lease ran out (after re-dispatching stale dispatches)."""
        ...

    async def unknown_of(self, kinds: Sequence[str], max_rows: int) -> list[ClaimedEffect]:
        """``unknown`` effects of these kinds, oldest first."""
        ...

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
        """Resolve one expired attempt (compare-and-set)."""
        ...

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
        ...

    async def mark_unknown_kinds(
        self, known: Sequence[str], *, grace_seconds: float, note_prefix: str, max_rows: int = 1000
    ) -> int:
        """Note on pending effects of kinds nobody here delivers."""
        ...

    async def note_blocked_by_order(self, *, grace_seconds: float, max_rows: int = 1000) -> int:
        """Note on effects held back by their ordering key what holds them."""
        ...

    async def gone_owners(
        self, kinds: Sequence[str], *, restart_grace: float
    ) -> list[tuple[str, bool]]:
        """Registered owners whose lock is free."""
        ...

    async def expire_gone_owner(
        self,
        owner: str,
        limits: Mapping[str, int],
        *,
        note: str,
        worker: str,
        restart_grace: float,
    ) -> list[UUID]:
        """Put a gone owner's attempts of these kinds back to pending."""
        ...

    async def forget_gone_owners(self, candidates: Sequence[str], *, restart_grace: float) -> int:
        """Unregister gone owners that hold nothing."""
        ...

    async def run_sync(self, fn: Callable[[RunTx], T], what: str = "a run transaction") -> T:
        """Run domain logic on runs in one transaction (approval deadlines, stopping runs)."""
        ...

    async def state_counts(self) -> StateCounts:
        """What the gauges show."""
        ...


if TYPE_CHECKING:  # mypy holds both stores to the seam
    from outbox.delivery.memory import InMemoryStore
    from outbox.storage.async_store import AsyncStore

    def _both_fill_it(pg: AsyncStore, memory: InMemoryStore) -> list[DeliveryStore]:
        return [pg, memory]
