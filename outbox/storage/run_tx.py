"""The statements of one run-scoped transaction: waits, signals and stopping, by name.

Waits, signals and cancellation of one run serialise on the run row's lock
(:meth:`RunTx.lock`). What changes the run's unstarted effects under it (pause,
resume, cancel, an approval's deadline) locks those effects first, in id order
(:meth:`RunTx.lock_with_effects`), the order a completion takes an effect and
then the run it wakes. The domain logic (what a wait decides, how a stopping
run moves on) lives in :mod:`outbox.runs`; it calls these methods, never SQL.
Sync callers get a ``RunTx`` from ``Store.run_tx()``; the async daemon runs
the same logic through ``AsyncStore.run_sync``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, text

from outbox.blobs import Blob, reference_hash
from outbox.errors import RunNotFound
from outbox.models import Lease, RunStatus
from outbox.shards import shard_of
from outbox.storage import blob_store, writes
from outbox.storage.engine import distributed
from outbox.storage.outcome_writes import logged_rows
from outbox.storage.shard_turns import each_shard, stored_shard
from outbox.storage.sql import blobs as blob_sql
from outbox.storage.sql import control, maintenance
from outbox.storage.sql import effects as effect_sql
from outbox.storage.sql import governance as gov_sql
from outbox.storage.sql import runs as run_sql
from outbox.storage.sql import stopping as stopping_sql
from outbox.storage.sql.common import EFFECTS_CHANNEL, RUNS_CHANNEL, SIGNALS_CHANNEL, notify

__all__ = ["EffectBusy", "LockedRun", "RunTx", "TakenSignal", "WaitRow"]


class EffectBusy(Exception):
    """Another transaction holds the row of an effect a wait checks (its completion, mostly).

    Raised out of the wait's run transaction so that the run's lock is let go
    before anyone waits for the effect: a completion holds the effect's row
    and then takes the run's to wake it, so a check that held the run while it
    waited for the effect would deadlock with it. Never reaches a caller of
    the public API: the wait settles the effect and checks again.
    """

    def __init__(self, effect_id: uuid.UUID, shard: int) -> None:
        super().__init__(f"effect {effect_id} (shard {shard}) is being changed")
        self.effect_id = effect_id
        self.shard = shard


@dataclass(frozen=True)
class LockedRun:
    """The run row as its lock found it."""

    status: RunStatus
    lease: Lease | None
    #: A pause is set (the run is paused, or will be when its worker lets go).
    paused: bool = False
    #: What a failed run recorded (its failing step, for a fork).
    error: Any = None


@dataclass(frozen=True)
class WaitRow:
    """A wait step as recorded, with its deadline judged in database time."""

    status: str
    result: Any
    error: Any
    seq: int
    completed_at: datetime
    due: bool
    seconds_left: float | None


@dataclass(frozen=True)
class TakenSignal:
    """A signal a wait step consumed: its payload as stored, and the step as completed."""

    payload: Any
    seq: int
    completed_at: datetime


class RunTx:
    """Named statements on one connection inside a transaction (the caller commits)."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        # the shard of each effect this transaction named (statements name it: Citus)
        self._effect_shards: dict[uuid.UUID, int] = {}
        #: (run, effect): on Citus, runs of other shards parked on effects this ended,
        #: for the caller to wake after the commit (a statement stays on one shard)
        self.wake_after_commit: list[tuple[uuid.UUID, uuid.UUID]] = []

    def _run(self, statement: Any, params: dict[str, Any]) -> Any:
        return self.connection.execute(statement, params)

    def _logged(self, statement: Callable[[bool], Any], params: dict[str, Any]) -> list[Any]:
        """A statement that logs attempts (``log_changes``): the rows it logged."""
        sharded = distributed(self.connection)
        return logged_rows(self.connection, statement, params, sharded=sharded)

    # -- the run row ---------------------------------------------------------------

    def lock(self, run_id: uuid.UUID) -> LockedRun:
        """Lock the run row until commit; :class:`RunNotFound` when there is none."""
        row = self._run(run_sql.lock_run(), {"run_id": run_id}).first()
        if row is None:
            raise RunNotFound(run_id)
        lease = None if row.lease_owner is None else Lease(row.lease_owner, row.attempt)
        return LockedRun(RunStatus(row.status), lease, row.paused_at is not None, row.error)

    def lock_with_effects(self, run_id: uuid.UUID) -> LockedRun:
        """:meth:`lock`, after the run's effects that have not started (a completion's order).

        For what changes those effects under the run's lock: pause, resume, cancel.
        """
        self.lock_unstarted(run_id)
        return self.lock(run_id)

    def lock_unstarted(self, run_id: uuid.UUID) -> None:
        """Lock the run's effects that have not started, in id order (not the run)."""
        self._run(control.lock_unstarted_effects(), {"of_run": run_id})

    def mark(self, run_id: uuid.UUID, status: RunStatus, reason: str | None = None) -> None:
        """Set the locked run's status (and cancel reason); clears its lease and waits."""
        self._run(
            run_sql.mark_run(), {"run_id": run_id, "new_status": status.value, "reason": reason}
        )

    # -- waits ------------------------------------------------------------------------

    def record_wait(
        self,
        run_id: uuid.UUID,
        step_id: str,
        *,
        kind: str,
        seconds: float | None,
        until: datetime | None,
        detail: dict[str, Any],
    ) -> WaitRow:
        """Record a wait the first time it is met (deadline in database time); return its row."""
        self._run(
            run_sql.insert_wait_step(),
            {
                "w_run": run_id,
                "w_step": step_id,
                "kind": kind,
                "seconds": seconds,
                "until": None if until is None else until.isoformat(),
                "detail": json.dumps(detail),
            },
        )
        row = self._run(run_sql.wait_step(), {"w_run": run_id, "w_step": step_id}).one()
        return WaitRow(
            status=row.status,
            result=row.result,
            error=row.error,
            seq=row.seq,
            completed_at=row.completed_at,
            due=bool(row.due),
            seconds_left=None if row.seconds_left is None else max(0.0, float(row.seconds_left)),
        )

    def complete_wait(
        self, run_id: uuid.UUID, step_id: str, *, result: Any = None, error: Any = None
    ) -> tuple[int, datetime]:
        """A wait is over: record its result or error; returns the step's (seq, completed_at)."""
        row = self._run(
            run_sql.complete_wait_step(),
            {
                "w_shard": shard_of(run_id),
                "w_run": run_id,
                "w_step": step_id,
                "wait_result": None if result is None else json.dumps(result),
                "wait_error": None if error is None else json.dumps(error),
            },
        ).one()
        return row.step_seq, row.completed_at

    def take_signal(self, run_id: uuid.UUID, step_id: str, name: str) -> TakenSignal | None:
        """The wait step takes the oldest unconsumed signal ``name`` and completes with it.

        None when no such signal is there (nothing changed). The payload is as
        stored (a large one by reference).
        """
        row = self._run(
            run_sql.consume_signal(),
            {"w_shard": shard_of(run_id), "w_run": run_id, "w_step": step_id, "s_name": name},
        ).one()
        if not row.taken:
            return None
        return TakenSignal(payload=row.payload, seq=row.step_seq, completed_at=row.completed_at)

    def await_effect(self, run_id: uuid.UUID, effect_id: uuid.UUID) -> Any:
        """Mark the effect awaited by the run and read (status, result, last_error), or None.

        Raises :class:`EffectBusy` when another transaction holds the effect's
        row: the caller lets go of the run and calls :meth:`settle_effect`.
        """
        named = shard_of(effect_id)
        params = {"awaiting_run": run_id, "effect_id": effect_id, "effect_shard": named}
        row = self._run(run_sql.await_effect(), params).first()
        if row is not None:
            return row
        # held on the shard its id names (the common case): a read of that shard alone
        if self._run(gov_sql.effect_shard(named=True), params).first() is not None:
            raise EffectBusy(effect_id, named)
        stored = self._run(gov_sql.effect_shard(), {"effect_id": effect_id}).scalar()
        if stored is None:
            return None
        if stored != named:
            # an effect written before ids named their shard (or a caller chose its id)
            row = self._run(run_sql.await_effect(), {**params, "effect_shard": stored}).first()
            if row is not None:
                return row
        raise EffectBusy(effect_id, int(stored))

    def settle_effect(self, busy: EffectBusy) -> None:
        """Wait until the transaction that held ``busy``'s effect row ends (hold no other lock)."""
        # FOR SHARE waits for a writer's commit, and holds nothing a writer waits for
        # once this transaction ends
        held = gov_sql.effect_shard(named=True).with_for_update(read=True)
        self._run(held, {"effect_id": busy.effect_id, "effect_shard": busy.shard}).first()

    def suspend(
        self,
        run_id: uuid.UUID,
        *,
        wake_in: float | None,
        signal: str | None,
        effect_id: uuid.UUID | None,
    ) -> None:
        """Park the locked run as ``waiting``: no lease, process or connection is held."""
        self._run(
            run_sql.suspend_run(),
            {"run_id": run_id, "wake_in": wake_in, "signal_name": signal, "effect_id": effect_id},
        )

    # -- signals ----------------------------------------------------------------------

    def insert_signal(
        self, signal_id: uuid.UUID, run_id: uuid.UUID, name: str, payload_json: str, dedup_key: str
    ) -> bool:
        """Store a signal once per (run, dedup key); False for a duplicate."""
        row = self._run(
            run_sql.insert_signal(),
            {
                "signal_id": signal_id,
                "w_run": run_id,
                "s_name": name,
                "payload": payload_json,
                "dedup_key": dedup_key,
            },
        ).first()
        return row is not None

    def wake_signalled(self, run_id: uuid.UUID, name: str) -> bool:
        """Make the run runnable if it waits for this signal; True when it did."""
        woke = self._run(run_sql.wake_signalled_run(), {"run_id": run_id, "name": name}).first()
        if woke is not None:
            self.connection.execute(notify(RUNS_CHANNEL))
        # Plain scripts blocked in wait_signal listen here.
        self.connection.execute(
            text("SELECT pg_notify(:channel, :run)"),
            {"channel": SIGNALS_CHANNEL, "run": str(run_id)},
        )
        return woke is not None

    def mark_replay(self, digest: str) -> bool:
        """Remember a webhook signature; False when it was seen before (a replay)."""
        return self._run(maintenance.mark_replay(), {"digest": digest}).first() is not None

    def forget_replays(self, older_than_seconds: float) -> None:
        """Forget signatures older than the freshness window."""
        self._run(maintenance.forget_replays(), {"seconds": older_than_seconds})

    # -- approvals --------------------------------------------------------------------

    def _one_effect(self, effect_id: uuid.UUID) -> dict[str, Any]:
        """The parameters naming one effect: its id and the shard it is stored on."""
        shard = self._effect_shards.get(effect_id)
        if shard is None:
            found = stored_shard(self.connection, effect_id)
            shard = self._effect_shards[effect_id] = -1 if found is None else found
        return {"effect_id": effect_id, "effect_shard": shard}

    def effect_run(self, effect_id: uuid.UUID) -> uuid.UUID | None:
        """The run of an effect (None for an effect of no run, or none at all); not locked."""
        return self._run(gov_sql.effect_run(), self._one_effect(effect_id)).scalar()  # type: ignore[no-any-return]

    def lock_effect(self, effect_id: uuid.UUID) -> Any:
        """The effect row locked until commit (status, digest, approval, ``due``), or None."""
        return self._run(gov_sql.lock_effect(), self._one_effect(effect_id)).first()

    def approve_held(self, effect_id: uuid.UUID, approver: str, detail: dict[str, Any]) -> bool:
        """Release a held effect to ``pending`` (logged ``approved``); wakes deliverers."""
        params = {"approver": approver, "detail": json.dumps(detail)}
        params |= self._one_effect(effect_id)
        changed = bool(self._logged(gov_sql.approve_held, params))
        if changed:
            self.connection.execute(notify(EFFECTS_CHANNEL))
        return changed

    def reject_held(
        self,
        effect_id: uuid.UUID,
        approver: str,
        note: str,
        detail: dict[str, Any],
        *,
        outcome: str = "rejected",
    ) -> bool:
        """End a held effect as ``rejected`` (logged as ``outcome``); wakes a run parked on it."""
        params = {
            "approver": approver,
            "note": note,
            "outcome": outcome,
            "detail": json.dumps(detail),
            **self._one_effect(effect_id),
        }
        changed = bool(self._logged(gov_sql.reject_held, params))
        if changed:
            # a run parked on the effect may have woken (reject_held's CTE)
            self.connection.execute(notify(RUNS_CHANNEL))
            if distributed(self.connection):  # one of another shard is woken after it
                waiter = self._run(effect_sql.awaiting_run(), params).scalar()
                if waiter is not None and shard_of(waiter) != params["effect_shard"]:
                    self.wake_after_commit.append((waiter, effect_id))
        return changed

    def escalate_held(self, effect_id: uuid.UUID, approver: str, detail: dict[str, Any]) -> bool:
        """A held effect's deadline passed (escalate): it waits on without one (logged)."""
        params = {"approver": approver, "detail": json.dumps(detail)}
        params |= self._one_effect(effect_id)
        return bool(self._logged(gov_sql.escalate_held, params))

    def log_effect_event(
        self, effect_id: uuid.UUID, worker: str, outcome: str, detail: dict[str, Any]
    ) -> None:
        """Log a row about an effect that changes nothing else (a refused approval)."""
        params = {
            "worker": worker,
            "outcome": outcome,
            "detail": json.dumps(detail),
            **self._one_effect(effect_id),
        }
        self._run(gov_sql.log_effect_event(), params)

    def due_approvals(self, max_rows: int) -> list[tuple[uuid.UUID, uuid.UUID | None]]:
        """Held effects whose approval deadline passed, with their runs (not locked)."""
        rows = each_shard(self.connection, gov_sql.due_approvals, max_rows)
        self._effect_shards.update((r.id, int(r.shard)) for r in rows)
        return [(r.id, r.run_id) for r in rows]

    # -- stopping ---------------------------------------------------------------------

    def cancel_pending_effects(
        self, run_id: uuid.UUID, reason: str, *, by: str, detail: dict[str, Any]
    ) -> tuple[int, int]:
        """Stop the unstarted effects, logged with ``by``: (cancelled, made ``unknown``)."""
        params = {"stopping_run": run_id, "by": by, "detail": json.dumps(detail)}
        doubt = f"{reason}, but an earlier attempt was lost and may have taken effect: say whether"
        unknown = self._logged(stopping_sql.doubt_pending_effects, {**params, "reason": doubt})
        cancelled = self._logged(stopping_sql.cancel_pending_effects, {**params, "reason": reason})
        return len(cancelled), len(unknown)

    def effects_for_stopping(self, run_id: uuid.UUID) -> list[Any]:
        """Every effect of the run in intent order: id, status, compensate, compensates, key."""
        return list(
            self._run(stopping_sql.run_effects_for_stopping(), {"stopping_run": run_id}).all()
        )

    def mark_compensated(self, run_id: uuid.UUID, effect_ids: Sequence[uuid.UUID]) -> None:
        """The run's succeeded effects whose compensation succeeded become ``compensated``."""
        self._run(
            stopping_sql.mark_compensated(), {"stopping_run": run_id, "ids": list(effect_ids)}
        )

    def intend_compensations(self, run_id: uuid.UUID, originals: Sequence[uuid.UUID]) -> int:
        """Intend the compensations of a stopping run's effects ``originals``; how many were new."""
        return writes.intend_compensations(self.connection, run_id, originals)

    def stopping_runs(
        self, max_rows: int, after: stopping_sql.StoppingMark | None = None
    ) -> list[stopping_sql.StoppingMark]:
        """Cancelling and compensating runs after ``after``, by shard, oldest change first."""
        rows = each_shard(self.connection, stopping_sql.stopping_runs, max_rows, after)
        return [stopping_sql.StoppingMark(r.id, int(r.shard), r.updated_at) for r in rows]

    def savepoint(self) -> Any:
        """A nested transaction (one stopping run's failure must not undo the others)."""
        return self.connection.begin_nested()

    # -- values by reference ---------------------------------------------------------------

    def put_blobs(self, owner: uuid.UUID, blobs: Sequence[Blob | None]) -> None:
        """Store values by reference for ``owner`` (a run) in this transaction."""
        blob_store.put(self.connection, owner, blobs)

    def resolved(self, value: Any) -> Any:
        """``value`` as read from a row, with a reference replaced by the value it names."""
        sha = reference_hash(value)
        return value if sha is None else blob_store.fetch(self.connection, [sha])[sha]

    # -- pause, resume, fork ------------------------------------------------------------------

    def pause(self, run_id: uuid.UUID, reason: str, *, park: bool, first: bool) -> RunStatus:
        """Set the locked run's pause; ``park``: nobody holds it, so ``paused`` now."""
        statement = control.pause_run(park=park, first=first)
        return RunStatus(self._run(statement, {"run_id": run_id, "reason": reason}).one().status)

    def hold_effects(self, run_id: uuid.UUID) -> int:
        """The run's effects no deliverer started become ``paused``; returns how many."""
        return len(self._run(control.hold_effects(), {"of_run": run_id}).all())

    def resume(self, run_id: uuid.UUID, *, parked: bool) -> RunStatus:
        """Lift the locked run's pause; returns its status (``runnable`` if ``parked``)."""
        statement = control.resume_run(parked=parked)
        status = RunStatus(self._run(statement, {"run_id": run_id}).one().status)
        if parked:
            self.connection.execute(notify(RUNS_CHANNEL))
        return status

    def release_effects(self, run_id: uuid.UUID) -> int:
        """The run's paused effects are ``pending`` again; returns how many."""
        return int(self._run(control.release_effects(), {"of_run": run_id}).one().released)

    def completed_steps(self, run_id: uuid.UUID) -> list[tuple[str, int]]:
        """(step id, seq) of the run's completed steps, in order."""
        return [(r.step_id, r.seq) for r in self._run(control.fork_cut(), {"of_run": run_id})]

    def unsettled_effects(
        self, original: uuid.UUID, *, cut: int | None, from_step: str
    ) -> list[dict[str, Any]]:
        """The original's effects at or after the fork's step that may have taken effect."""
        rows = self._run(
            control.fork_unsettled(), {"of_run": original, "cut": cut, "from_step": from_step}
        )
        return [
            {**row._mapping, "effect_id": str(row.effect_id), "status": str(row.status)}
            for row in rows
        ]

    def fork(
        self,
        original: uuid.UUID,
        fork: uuid.UUID,
        *,
        cut: int | None,
        from_step: str,
        version: str | None,
    ) -> None:
        """Write the fork: its run, the steps before ``cut``, their debits, the blobs they use."""
        params = {
            "original": original,
            "fork": fork,
            "cut": cut,
            "from_step": from_step,
            "version": version,
        }
        # read, then written as values (control.fork_run says why)
        self._run(
            control.fork_insert("runs"), self._run(control.fork_run(), params).one()._asdict()
        )
        self.connection.execute(notify(RUNS_CHANNEL))
        for table, rows in (
            ("steps", control.fork_steps()),
            ("budget_ledger", control.fork_ledger()),
        ):
            copied = [row._asdict() for row in self._run(rows, params)]
            if copied:
                self.connection.execute(control.fork_insert(table), copied)
        # the blobs first: the chain's writer reads the fork's own shard only
        self._run(blob_sql.copy_refs(), {"from_owner": original, "to_owner": fork})
        chained = list(self._run(control.fork_chained(), params).scalars())
        self._run(
            control.fork_chain(), {"fork_shard": shard_of(fork), "fork": fork, "chained": chained}
        )
