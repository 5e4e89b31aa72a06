"""Recovery in seconds: the idempotent attempts of a deliverer that is gone, put back early.

Every delivery daemon holds its owner's session lock (:mod:`outbox.storage.owner_lock`);
PostgreSQL frees it when the daemon's connection ends, at once after a
``kill -9``. Each round asks which registered owners' locks are free; an owner
found gone in two rounds at least ``gone_grace_seconds`` apart has its in-flight
attempts *of idempotent kinds* put back to ``pending`` (same key, fenced by the
attempt number), so a live deliverer redelivers them within about a second
instead of after the lease. Everything else it held (kinds that cannot dedup,
with or without ``lookup``) waits for its lease and the reconciler, as before:
a call that may have landed is never sent blindly again.

A PostgreSQL restart frees every lock at once; for ``restart_grace_seconds``
after the server started no owner counts as gone (:mod:`outbox.storage.sql.owners`), while live
daemons take their locks again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence

from outbox.delivery.contract import Deliverer
from outbox.delivery.seam import DeliveryStore

__all__ = ["GoneOwners", "Sightings"]

log = logging.getLogger(__name__)

#: Gone owners holding nothing are unregistered at most this often.
FORGET_EVERY = 60.0


class Sightings:
    """Owners seen gone, and since when: gone for good once seen so ``grace`` s apart.

    An owner seen with its lock held again (a lock session that dropped and came
    back) starts afresh. Shared by a deliverer's reconciler and a relay's.
    """

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self._since: dict[str, float] = {}
        self._last_forget = 0.0

    def seen(self, gone: Iterable[str], now: float) -> set[str]:
        """Note who is gone at ``now`` (monotonic); those gone for ``grace`` s at least."""
        self._since = {owner: self._since.get(owner, now) for owner in gone}
        return {owner for owner, first in self._since.items() if now - first >= self.grace}

    def forget_due(self, now: float) -> bool:
        """Whether gone owners holding nothing may be unregistered now (every FORGET_EVERY s)."""
        if now - self._last_forget < FORGET_EVERY:
            return False
        self._last_forget = now
        return True


class GoneOwners:
    """One reconciler's view of which deliverers are gone, and what it put back."""

    def __init__(
        self,
        store: DeliveryStore,
        deliverers: Mapping[str, Deliverer],
        *,
        owner: str,
        grace_seconds: float,
        restart_grace_seconds: float,
        default_max_attempts: int,
    ) -> None:
        self.store = store
        self.owner = owner
        self.restart_grace = restart_grace_seconds
        #: Idempotent kinds this process knows, and each one's attempt cap.
        self.limits = {
            kind: d.max_attempts or default_max_attempts
            for kind, d in deliverers.items()
            if d.idempotent
        }
        self.sightings = Sightings(grace_seconds)

    async def check(self) -> int:
        """One round; returns how many attempts were put back."""
        if not self.limits:
            return 0
        found = await self.store.gone_owners(sorted(self.limits), restart_grace=self.restart_grace)
        return await self.observed(found, time.monotonic())

    async def observed(self, found: Sequence[tuple[str, bool]], at: float) -> int:
        """Act on owners found gone at ``at`` (monotonic), by :meth:`check` or a duty probe.

        Returns how many attempts were put back.
        """
        if not self.limits:
            return 0
        # (our own lock session dropped: we are alive, it comes back)
        holding = {owner: holds for owner, holds in found if owner != self.owner}
        long_gone = self.sightings.seen(holding, at)
        put_back = 0
        for owner in sorted(long_gone):
            if holding[owner]:
                put_back += await self._put_back(owner)
        idle = [owner for owner, holds in holding.items() if not holds]
        if idle and self.sightings.forget_due(at):
            await self.store.forget_gone_owners(idle, restart_grace=self.restart_grace)
        return put_back

    async def _put_back(self, owner: str) -> int:
        note = (
            f"deliverer {owner} is gone (its session lock was released) with this attempt "
            "in flight; redelivering with the same key"
        )
        ids = await self.store.expire_gone_owner(
            owner,
            self.limits,
            note=note,
            worker=f"reconciler:{self.owner}",
            restart_grace=self.restart_grace,
        )
        if ids:
            log.info(
                "deliverer %s is gone: %d attempts of idempotent kinds put back for redelivery",
                owner,
                len(ids),
            )
        return len(ids)
