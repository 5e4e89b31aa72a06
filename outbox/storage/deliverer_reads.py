"""Reads about the deliverers of a database: who is alive, what the dead hold, what was done.

For the people watching: ``outbox demo`` (its own runs' tally, other
deliverers serving its kinds) and ``outbox reconcile`` (attempts held by
deliverers that are gone). Short read-only transactions on the client's engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from uuid import UUID

from sqlalchemy import Engine

from outbox.storage.engine import translate_errors
from outbox.storage.sql import maintenance, owners

__all__ = ["DelivererReads"]


class DelivererReads:
    """Read-only questions about deliverers, on one engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def tally(self, run_ids: Sequence[UUID]) -> dict[str, dict[str, int]]:
        """Effects of these runs by status, attempt-log rows by outcome, successes by worker."""
        ids = {"ids": list(run_ids)}
        with translate_errors("tallying effects"), self.engine.begin() as conn:
            return {
                "status": dict(conn.execute(maintenance.effects_by_status(), ids).all()),
                "outcome": dict(conn.execute(maintenance.attempts_by_outcome(), ids).all()),
                "worker": dict(conn.execute(maintenance.succeeded_by_worker(), ids).all()),
            }

    def gone_in_flight(self, restart_grace: float = 5.0) -> list[tuple[str, int, int, Any]]:
        """``(owner, in flight, dispatched, first lease end)`` of what gone owners hold.

        Deliverers hold attempts in flight; Kafka relays, effects they dispatched.
        """
        params = {"restart_grace": restart_grace}
        with translate_errors("listing gone deliverers"), self.engine.begin() as conn:
            gone = list(conn.execute(owners.gone_owner_names(), params).scalars())
            if not gone:
                return []
            rows = conn.execute(owners.in_flight_by_owner(), {"owners": gone}).all()
        return [(str(owner), int(n), int(d), ends) for owner, n, d, ends in rows]

    def live_owners(self) -> list[str]:
        """Lease owners of the delivery daemons alive on this database (their lock held)."""
        with translate_errors("listing deliverers"), self.engine.begin() as conn:
            return list(conn.execute(owners.live_owners()).scalars())

    def in_flight_of(self, owner_pattern: str) -> int:
        """Effects in flight under lease owners matching the SQL ``LIKE`` pattern."""
        with translate_errors("counting in-flight effects"), self.engine.begin() as conn:
            return int(
                conn.execute(maintenance.in_flight_like(), {"pattern": owner_pattern}).scalar_one()
            )
