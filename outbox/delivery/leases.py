"""The attempts one delivering process holds, and the gate that decides which may start now.

Whatever the source (a claim in PostgreSQL, a record from Kafka), a claimed
attempt is *held* until its outcome is recorded. It starts when its kind has
room under the deliverer's ``concurrency`` cap and is not paused by a
rate-limit answer (``Retry(rate_limited=True)``); until then it waits here,
its lease kept alive by the one heartbeat. A poll source asks for
:meth:`Leases.quotas` so it claims no more than can start; a Kafka source
takes what its records name, and the gate holds back the excess.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from uuid import UUID

from outbox.delivery.contract import Deliverer
from outbox.delivery.metrics import DeliveryMetrics
from outbox.delivery.seam import DeliveryStore
from outbox.storage.attempts import ClaimedEffect
from outbox.storage.sql.queue import EFFECT_QUEUE

__all__ = ["Held", "Leases"]

log = logging.getLogger(__name__)


@dataclass
class Held:
    """A claimed attempt until its outcome is recorded."""

    effect: ClaimedEffect
    started: bool = False
    lease_lost: bool = False
    #: It was not started with its claim: it waited behind its kind's cap or pause.
    waited: bool = False
    #: When its lease was last known to run a full lease from (monotonic): the
    #: claim, then each heartbeat that extended it (taken when each was sent).
    renewed: float = field(default_factory=time.monotonic)


#: How long a kind whose last claim came back short yields its turn to busy kinds.
SHORT_SECONDS = 1.0
#: ...keeping this share of the room, claimed before the busy kinds' turns.
SHORT_SHARE = 0.1


class Quotas(list[tuple[dict[str, str], int]]):
    """A claim's quotas, ``(filter, how many)`` per kind, as :meth:`Leases.quotas` made them.

    ``left_out``: a kind that could take work got no quota because the room
    went to kinds before it, so a claim that finds little is no sign that the
    queue is short.
    """

    def __init__(self, leases: Leases | None = None) -> None:
        super().__init__()
        self.leases = leases
        self.left_out = False

    def found(self, rows: Iterable[ClaimedEffect]) -> bool:
        """Note what the claim found per kind; True if more is likely waiting.

        Judged per kind: a kind that filled its quota has more; one that came
        back short yields its turn for :data:`SHORT_SECONDS` (see
        :meth:`Leases.quotas`), so an idle kind beside a busy one neither takes
        the busy one's room nor makes the claim loop back off.
        """
        taken = Counter(row.kind for row in rows)
        now = time.monotonic()
        # A kind left out of a claim that took something claims at once; one that
        # took nothing (the room went to idle kinds) would find the same again.
        more = self.left_out and bool(taken)
        for spec, n in self:
            kind = spec.get("kind", "")
            if taken[kind] >= n:
                more = True
                if self.leases is not None:
                    self.leases.short_until.pop(kind, None)
            elif self.leases is not None:
                self.leases.short_until[kind] = now + SHORT_SECONDS
        return more


class Leases:
    """Held attempts, per-kind room and rate-limit pauses, and their one heartbeat."""

    def __init__(
        self, deliverers: Mapping[str, Deliverer], concurrency: int, metrics: DeliveryMetrics
    ) -> None:
        self.deliverers = deliverers
        self.concurrency = concurrency
        self.metrics = metrics
        #: By (effect id, attempt): a lease lost and the effect claimed again by
        #: this process are two attempts, each released by its own outcome.
        self.held: dict[tuple[UUID, int], Held] = {}
        self._reserved = 0
        self._running: dict[str, int] = dict.fromkeys(deliverers, 0)
        self._waiting: dict[str, deque[tuple[UUID, int]]] = {kind: deque() for kind in deliverers}
        self._paused_until: dict[str, float] = {}
        self._kinds_rr = list(deliverers)
        #: kind -> until when it yields its turn (its last claim came back short)
        self.short_until: dict[str, float] = {}
        #: Kinds with a declared rate, taken by claims through PostgreSQL.
        self.rates = {kind: d.rate for kind, d in deliverers.items() if d.rate is not None}

    def __len__(self) -> int:
        return len(self.held)

    @property
    def free(self) -> int:
        """How many more attempts this process may hold (claims under way count as held)."""
        return self.concurrency - len(self.held) - self._reserved

    @contextmanager
    def reserving(
        self, quotas: list[tuple[dict[str, str], int]], *, freeing: int = 0
    ) -> Iterator[None]:
        """Count the room a claim may fill as taken while it runs (two claims never share it).

        ``freeing``: outcomes written with the claim, whose places it reuses.
        """
        reserved = max(0, sum(n for _, n in quotas) - freeing)
        self._reserved += reserved
        try:
            yield
        finally:
            self._reserved -= reserved

    def _room(self, kind: str) -> int:
        cap = self.deliverers[kind].concurrency
        if cap is None:
            return self.concurrency
        return cap - self._running[kind] - len(self._waiting[kind])

    def paused(self, kind: str, now: float | None = None) -> bool:
        """True while a rate-limit answer holds this kind back."""
        return self._paused_until.get(kind, 0.0) > (time.monotonic() if now is None else now)

    def quotas(self, batch_size: int, *, freeing: int = 0) -> Quotas:
        """How many of each kind a claim may take now: room, pauses and fairness between kinds.

        ``freeing``: attempts whose outcomes are being recorded in the claim's own
        transaction, so their places count as free (their per-kind caps do not).

        Kinds whose last claim came back short get a small share first
        (:data:`SHORT_SHARE` of the room, never its last place), then busy kinds
        take turns at the rest, and short kinds at what is left after them. So
        an idle kind beside a busy one neither takes the busy one's room nor
        waits for it: a trickle of one kind is claimed with the next batch of
        another kind's backlog, even while that backlog keeps this daemon full.
        """
        free = self.free + freeing
        now = time.monotonic()
        self._kinds_rr = self._kinds_rr[1:] + self._kinds_rr[:1]
        short = {k for k, until in self.short_until.items() if until > now}
        open_ = [k for k in self._kinds_rr if not self.paused(k, now)]
        wanted: dict[str, int] = {}

        def give(kind: str, most: int) -> int:
            n = min(most, self._room(kind) - wanted.get(kind, 0), batch_size - wanted.get(kind, 0))
            if n > 0:
                wanted[kind] = wanted.get(kind, 0) + n
            return max(n, 0)

        share = max(1, int(free * SHORT_SHARE)) if free > 1 else 0
        for kind in (k for k in open_ if k in short):
            got = give(kind, min(share, free))
            share, free = share - got, free - got
        busy = [k for k in open_ if k not in short]
        left_out = False
        for i, kind in enumerate(busy):
            if free <= 0:
                left_out = any(self._room(k) > 0 for k in busy[i:])
                break
            free -= give(kind, free)
        for kind in (k for k in open_ if k in short):
            free -= give(kind, free)
        quotas = Quotas(self)
        quotas.extend(({"kind": kind}, n) for kind, n in wanted.items())
        quotas.left_out = left_out
        return quotas

    def hold(self, effect: ClaimedEffect, asked: float) -> None:
        """Keep a claimed attempt; it waits for :meth:`startable`.

        ``asked``: when the claim was sent (monotonic). Its lease runs from the
        claiming transaction's start, which a wait for a lock may have put long
        before the answer came: counted from the answer, a lease already run out
        (and taken over, and re-sent by a reconciler) looked whole.
        """
        self.held[effect.id, effect.attempt] = Held(effect, renewed=asked)
        self._waiting[effect.kind].append((effect.id, effect.attempt))
        self.metrics.in_flight.set(len(self.held))

    def may_call(self, effect: ClaimedEffect, lease_seconds: float) -> bool:
        """Whether the lease of a held attempt is surely still this process's, so it may start.

        Not when the heartbeat found it taken over, nor when no heartbeat has
        extended it for a whole lease (the database unreachable or locked): it
        may have run out and been taken over, and a call now could be a second.
        """
        held = self.held.get((effect.id, effect.attempt))
        if held is None:
            return True
        return not held.lease_lost and time.monotonic() - held.renewed < lease_seconds

    def startable(self) -> list[ClaimedEffect]:
        """Held attempts that may start now (marked started)."""
        now = time.monotonic()
        ready: list[ClaimedEffect] = []
        for kind, waiting in self._waiting.items():
            if not waiting:
                continue
            if self.paused(kind, now):
                for key in waiting:
                    if (left := self.held.get(key)) is not None:
                        left.waited = True
                continue
            cap = self.deliverers[kind].concurrency
            while waiting and (cap is None or self._running[kind] < cap):
                held = self.held.get(waiting.popleft())
                if held is None:
                    continue
                held.started = True
                self._running[kind] += 1
                ready.append(held.effect)
            for key in waiting:
                if (left := self.held.get(key)) is not None:
                    left.waited = True
        return ready

    def waited(self, effect: ClaimedEffect) -> bool:
        """Whether a held attempt waited before it started (behind a cap or a pause)."""
        held = self.held.get((effect.id, effect.attempt))
        return held is not None and held.waited

    def unstarted(self) -> list[ClaimedEffect]:
        """Held attempts not started (given back at shutdown); they leave the queue."""
        pending = [self.held[i].effect for w in self._waiting.values() for i in w if i in self.held]
        for waiting in self._waiting.values():
            waiting.clear()
        return pending

    def pause(self, kind: str, seconds: float, *, why: str = "rate-limited") -> None:
        """Hold back new attempts of ``kind`` for ``seconds`` (a sink said: too many requests)."""
        until = max(self._paused_until.get(kind, 0.0), time.monotonic() + seconds)
        self._paused_until[kind] = until
        log.info("kind %s %s: paused for %.1fs", kind, why, seconds)

    def release(self, effect_id: UUID, attempt: int) -> Held | None:
        """Forget an attempt whose outcome was recorded."""
        held = self.held.pop((effect_id, attempt), None)
        if held is not None and held.started:
            self._running[held.effect.kind] -= 1
        self.metrics.in_flight.set(len(self.held))
        return held

    def renewal_due(
        self, min_age: float, *, exclude: Iterable[UUID] = ()
    ) -> list[tuple[UUID, int]]:
        """(id, attempt) of every lease to push out, when one was renewed ``min_age`` s ago or more.

        All or nothing: once one lease is due, every held lease is renewed with it,
        so their renewals stay together in one statement. ``exclude``: attempts
        whose outcomes are being written (their leases end with them).
        """
        now = time.monotonic()
        skip = set(exclude)
        live = [(k, h) for k, h in self.held.items() if not h.lease_lost and k[0] not in skip]
        if not any(now - h.renewed >= min_age for _, h in live):
            return []
        return [k for k, _ in live]

    def renewed(self, held: list[tuple[UUID, int]], kept: set[UUID], sent: float) -> None:
        """Note what a renewal of ``held`` begun at ``sent`` found: ``kept`` are still ours.

        ``kept`` names effects: of two attempts of one held here, only the newer
        can still be the effect's, so the older is lost whatever it says.
        """
        newest: dict[UUID, int] = {}
        for effect_id, attempt in self.held:
            newest[effect_id] = max(attempt, newest.get(effect_id, attempt))
        for effect_id, attempt in held:
            entry = self.held.get((effect_id, attempt))
            if entry is not None and effect_id in kept and newest[effect_id] == attempt:
                entry.renewed = max(entry.renewed, sent)
            elif entry is not None and not entry.lease_lost:
                entry.lease_lost = True
                self.metrics.leases_lost.labels(kind=entry.effect.kind).inc()
                log.warning(
                    "lease on effect %s attempt %d was lost; its outcome will be recorded as stale",
                    effect_id,
                    attempt,
                    extra={"effect_id": str(effect_id), "attempt": attempt},
                )

    async def heartbeat(
        self, store: DeliveryStore, owner: str, lease_seconds: float, *, min_age: float = 0.0
    ) -> None:
        """Push out every held lease; note, count and log the ones taken over (G4 holds anyway).

        With ``min_age``, only when one of them was renewed that long ago or more
        (a batch's transaction renews them while the daemon is busy).
        """
        held = self.renewal_due(min_age)
        if not held:
            return
        sent = time.monotonic()
        kept = await store.extend(EFFECT_QUEUE, held, owner=owner, lease_seconds=lease_seconds)
        self.renewed(held, kept, sent)
