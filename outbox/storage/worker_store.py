"""A run worker's statements: claim runs, heartbeat, timers, rescue, step failures, upgrades.

Part of :class:`~outbox.storage.store.Store` (which it is a base of). On Citus
each names one shard: claims take the shards in turn, and sweeps (timers,
rescue, heartbeats) go a shard at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any
from uuid import UUID

import sqlalchemy.exc
from sqlalchemy import Connection, Engine

from outbox.blobs import Blob
from outbox.faults import crash_point
from outbox.models import Lease, RunRecord
from outbox.shards import shard_of
from outbox.storage import blob_store
from outbox.storage.attempts import ClaimCutShort
from outbox.storage.blob_store import RUN_FIELDS
from outbox.storage.claims import ClaimMode
from outbox.storage.engine import translate_errors
from outbox.storage.shard_turns import ShardTurns, next_turn, session_lost
from outbox.storage.sql import control, leases, queue
from outbox.storage.sql import runs as run_sql
from outbox.storage.sql.common import RUNS_CHANNEL, notify

__all__ = ["RunWorkerStatements"]

log = logging.getLogger("outbox.storage.store")


class RunWorkerStatements:
    """The statements of :class:`~outbox.runs.worker.Worker` (a base of ``Store``)."""

    engine: Engine
    _turns: ShardTurns
    _claims: ClaimMode

    def _is_sharded(self, conn: Connection) -> bool:
        raise NotImplementedError  # Store's: asked once per store

    def claim_runs(
        self, quotas: list[tuple[dict[str, str], int]], *, owner: str, lease_seconds: float
    ) -> list[RunRecord]:
        """Claim runnable runs of the given (agent, version) partitions, in one transaction."""
        claimed: list[RunRecord] = []
        with translate_errors("claiming runs"), self.engine.begin() as conn:
            if not self._is_sharded(conn):
                for partition, limit in quotas:
                    claimed += self._claim_runs_on(
                        conn, queue.RUN_QUEUE, partition, limit, owner, lease_seconds
                    )
                return claimed
        # On Citus a claim locks rows of one shard: the shards take turns, each
        # claim a transaction of its own, so a node that does not answer rests
        # its shards and the others are claimed from.
        spec = replace(queue.RUN_QUEUE, sharded=True)
        with translate_errors("claiming runs"), self.engine.connect() as conn:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            for partition, limit in quotas:
                taken: list[RunRecord] = []
                name = str(partition)
                walk = self._turns.walk(name, limit, frozenset())
                shard = next(walk, None)
                while shard is not None:
                    found: list[RunRecord] = []
                    on_shard = {**partition, "shard": shard}
                    try:
                        with self._turns.answering(shard, conn):
                            # an idle round: a cheap read a shard, a claim only where it answers
                            if not self._turns.asks_first(name, shard, frozenset()) or (
                                self._ready_on(conn, spec, on_shard)
                            ):
                                found = self._claim_runs_on(
                                    conn, spec, on_shard, limit - len(taken), owner, lease_seconds
                                )
                    except sqlalchemy.exc.DBAPIError as exc:
                        lost = session_lost(conn)
                        cut = ClaimCutShort([*claimed, *taken], exc, shard, lost=lost)
                        if self._turns.kept(cut):
                            return cut.rows
                        raise
                    taken += found
                    shard = next_turn(walk, len(found))
                claimed += taken
        return claimed

    @staticmethod
    def _ready_on(conn: Connection, spec: queue.QueueSpec, partition: dict[str, Any]) -> bool:
        """On Citus: whether ``partition`` (its shard named) has a runnable run now."""
        params = queue.partition_params(partition)
        return conn.execute(queue.ready_on_shard(spec), params).first() is not None

    def _claim_runs_on(
        self,
        conn: Connection,
        spec: queue.QueueSpec,
        partition: dict[str, Any],
        limit: int,
        owner: str,
        lease_seconds: float,
    ) -> list[RunRecord]:
        params = queue.claim_params(
            partition, limit=limit, owner=owner, lease_seconds=lease_seconds
        )
        claimed: list[RunRecord] = []
        again = True
        while again:  # at most twice: plain, then lanes (see ClaimMode)
            statement, lanes = self._claims.statement(spec, partition, rated=False)
            rows = conn.execute(statement, params).mappings().all()
            found, again = self._claims.claimed(spec, partition, lanes, rows)
            claimed += [RunRecord.model_validate(r) for r in found]
        return claimed

    def extend_run_leases(
        self, held: list[tuple[UUID, int]], *, owner: str, lease_seconds: float
    ) -> set[UUID]:
        """Heartbeat for runs; returns the ids still leased to ``owner``."""
        if not held:
            return set()

        def extend(conn: Connection, shard: int | None) -> list[Any]:
            part = [h for h in held if shard is None or shard_of(h[0]) == shard]
            if not part:
                return []
            params = leases.extend_params(part, owner=owner, lease_seconds=lease_seconds)
            params["part_shard"] = shard
            spec = replace(queue.RUN_QUEUE, sharded=shard is not None)
            return [row[0] for row in conn.execute(leases.extend_leases(spec), params)]

        with translate_errors("extending run leases"):
            return set(self._each_shard(extend, {shard_of(h[0]) for h in held}))

    def wake_due_runs(self, max_rows: int = 1000) -> int:
        """Fire due timers; returns how many runs became runnable."""
        woken = 0

        def wake(conn: Connection, shard: int | None) -> list[Any]:
            nonlocal woken
            if (room := max_rows - woken) <= 0:
                return []
            params = {"max_rows": room, "on_shard": shard}
            rows = list(conn.execute(run_sql.wake_due_timers(shard is not None), params))
            woken += len(rows)
            return rows

        with translate_errors("firing timers"):
            return len(self._each_shard(wake, notify_runs=True))

    def rescue_expired_runs(self) -> int:
        """Runs of dead workers become runnable again; returns how many."""

        def rescue(conn: Connection, shard: int | None) -> list[Any]:
            statement = run_sql.rescue_expired_runs(shard is not None)
            return list(conn.execute(statement, {"on_shard": shard}))

        with translate_errors("rescuing runs"):
            rows = self._each_shard(rescue, notify_runs=True)
        for row in rows:
            log.warning(
                "run %s: its worker's lease expired; runnable again",
                row.id,
                extra={"run_id": str(row.id), "attempt": row.attempt},
            )
        return len(rows)

    def _each_shard(
        self,
        statement: Callable[[Connection, int | None], list[Any]],
        only: set[int] | None = None,
        *,
        notify_runs: bool = False,
    ) -> list[Any]:
        """The rows of ``statement(conn, shard)``: once on one server (``shard`` None).

        On Citus once per live shard (of ``only``, if given), each its own
        transaction: a node that does not answer rests its shards, and the
        sweep goes on with the others. ``notify_runs``: wake the run workers
        if any rows came back.
        """
        with self.engine.begin() as conn:
            if not self._is_sharded(conn):
                found = statement(conn, None)
                if found and notify_runs:
                    conn.execute(notify(RUNS_CHANNEL))
                return found
        rows: list[Any] = []
        with self.engine.connect() as conn:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            for shard in self._turns.live():
                if only is None or shard in only:
                    with self._turns.answering(shard, conn):
                        rows += statement(conn, shard)
            if rows and notify_runs:
                conn.execute(notify(RUNS_CHANNEL))
        return rows

    def record_step_failure(
        self,
        run_id: UUID,
        lease: Lease,
        *,
        step: str,
        max_retries: int,
        delay: float,
        failure_json: str,
    ) -> str | None:
        """Count a step's failure (fenced); returns the run's new status, None if not ours."""
        params = {
            "run_id": run_id,
            "fence_owner": lease.owner,
            "fence_attempt": lease.attempt,
            "step_key": step,
            "max_retries": max_retries,
            "delay": delay,
            "failure": failure_json,
        }
        with translate_errors("recording a step failure"), self.engine.begin() as conn:
            row = conn.execute(run_sql.record_step_failure(), params).first()
        return None if row is None else str(row.status)

    def upgrade_run(
        self,
        run_id: UUID,
        lease: Lease,
        *,
        from_version: str,
        to_version: str,
        state_json: str,
        blobs: Sequence[Blob | None] = (),
    ) -> RunRecord | None:
        """Move a claimed run to ``to_version`` with upgraded state (fenced)."""
        params = {
            "run_id": run_id,
            "fence_owner": lease.owner,
            "fence_attempt": lease.attempt,
            "from_version": from_version,
            "to_version": to_version,
            "upgraded_state": state_json,
        }
        with translate_errors("upgrading a run"), self.engine.begin() as conn:
            row = conn.execute(run_sql.upgrade_run(), params).first()
            if row is not None:
                blob_store.put(conn, run_id, blobs)
            crash_point("during_upgrade", f"{from_version}->{to_version}", run=run_id)
            if row is None:
                return None
            return blob_store.resolve(conn, [RunRecord.model_validate(row._mapping)], RUN_FIELDS)[0]

    def park_paused(self, run_id: UUID, lease: Lease) -> str | None:
        """Let go of a run whose pause waited for its step (fenced); its new status, or None."""
        params = {"run_id": run_id, "fence_owner": lease.owner, "fence_attempt": lease.attempt}
        with translate_errors("parking a paused run"), self.engine.begin() as conn:
            row = conn.execute(control.park_paused(), params).first()
            if row is not None:
                conn.execute(notify(RUNS_CHANNEL))
        return None if row is None else str(row.status)
