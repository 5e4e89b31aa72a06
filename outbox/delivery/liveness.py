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
from collections.abc import Mapping, Sequence

from outbox.delivery.contract import Deliverer
from outbox.delivery.seam import DeliveryStore

__all__ = ["GoneOwners"]

log = logging.getLogger(__name__)

#: Gone owners holding nothing are unregistered at most this often.
FORGET_EVERY = 60.0


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
        self.grace = grace_seconds
        self.restart_grace = restart_grace_seconds
        #: Idempotent kinds this process knows, and each one's attempt cap.
        self.limits = {
            kind: d.max_attempts or default_max_attempts
            for kind, d in deliverers.items()
            if d.idempotent
        }
        self._since: dict[str, float] = {}
        self._last_forget = 0.0

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
        now = at
        gone = {owner for owner, _ in found if owner != self.owner}
        # An owner whose lock is held again is not gone: its suspicion ends.
        self._since = {o: t for o, t in self._since.items() if o in gone}
        put_back = 0
        idle: list[str] = []
        for owner, holds in found:
            if owner not in gone:
                continue  # our own lock session dropped: we are alive, it comes back
            first = self._since.setdefault(owner, now)
            if not holds:
                idle.append(owner)
            elif now - first >= self.grace:
                put_back += await self._put_back(owner)
        if idle and now - self._last_forget >= FORGET_EVERY:
            self._last_forget = now
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
