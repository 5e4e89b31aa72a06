"""The one module that talks to PostgreSQL for the client library.

It turns the statements of :mod:`outbox.storage.sql.steps` into calls, rows into
models, and driver errors into :class:`~outbox.errors.DatabaseError` (the
original stays as ``__cause__``). Callers never see SQL.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any
from uuid import UUID

from sqlalchemy import Connection, Engine, select, text
from sqlalchemy.exc import SQLAlchemyError

from outbox.blobs import reference_hashes
from outbox.models import (
    TERMINAL_EFFECT_STATUSES,
    Effect,
    EffectAttempt,
    RunRecord,
    StepRecord,
)
from outbox.shards import shard_of
from outbox.storage import blob_store, writes
from outbox.storage.blob_store import (
    AUDITED_STEP_FIELDS,
    EFFECT_FIELDS,
    RUN_FIELDS,
    STEP_FIELDS,
)
from outbox.storage.claims import ClaimMode
from outbox.storage.deliverer_reads import DelivererReads
from outbox.storage.engine import distributed, translate_errors
from outbox.storage.outcome_writes import logged_rows, wake_parked
from outbox.storage.run_tx import RunTx
from outbox.storage.schema import effect_attempts, effects, runs, steps
from outbox.storage.shard_turns import ShardTurns, stored_shard
from outbox.storage.sql import audit, maintenance, operator_changes
from outbox.storage.sql import effects as effect_sql
from outbox.storage.sql import governance as gov_sql
from outbox.storage.sql import runs as run_sql
from outbox.storage.sql import steps as sql
from outbox.storage.views import ConsoleViews
from outbox.storage.worker_store import RunWorkerStatements

__all__ = ["Store", "mark_consumed", "read_state_counts"]

log = logging.getLogger(__name__)


class Store(RunWorkerStatements):
    """Executes the client's statements on one engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._claims = ClaimMode()
        #: The operator console's reads (paginated, by index, off the hot paths).
        self.views = ConsoleViews(engine)
        #: Who delivers here: live daemons, the attempts of dead ones, a demo's tally.
        self.deliverers = DelivererReads(engine)
        #: On Citus (asked once): statements that lock rows of many runs go a shard at a time.
        self._sharded: bool | None = None
        #: On Citus: the shard each partition's next run claim starts at.
        self._turns = ShardTurns()

    def _is_sharded(self, conn: Connection) -> bool:
        if self._sharded is None:
            self._sharded = distributed(conn)
        return self._sharded

    @contextmanager
    def begin(self, connection: Connection | None = None) -> Iterator[Connection]:
        """A transaction: ours, or a savepoint inside the caller's open one."""
        with translate_errors("transaction"):
            if connection is None:
                with self.engine.begin() as conn:
                    yield conn
            else:
                with connection.begin_nested():
                    yield connection

    @contextmanager
    def run_tx(self, connection: Connection | None = None) -> Iterator[RunTx]:
        """A run-scoped transaction (waits, signals, stopping): see :class:`RunTx`."""
        with self.begin(connection) as conn:
            tx = RunTx(conn)
            yield tx
        if connection is not None:
            return  # not committed yet: a run woken now would find the effect unchanged
        for run_id, effect_id in tx.wake_after_commit:
            self._wake_apart(run_id, effect_id)

    # -- runs -----------------------------------------------------------------

    def insert_run(self, start: writes.RunStart) -> tuple[RunRecord, bool]:
        """Start a run; return it as stored and True, or the run its key names and False.

        The returned record's values are as stored (a large input is a reference).
        """
        with self.engine.begin() as conn:
            row, created = writes.begin_run(conn, start)
            record = RunRecord.model_validate(row)
            if created:
                return record, True
            with translate_errors("loading a run"):
                return blob_store.resolve(conn, [record], RUN_FIELDS)[0], False

    def load_run(
        self, run_id: UUID, step_id: str | None = None
    ) -> tuple[RunRecord, list[StepRecord]] | None:
        """A run and its recorded steps (only ``step_id``'s, when given), or ``None``.

        Values stored by reference are read back in place of their references.
        """
        run_q, steps_q = sql.run_with_steps(one_step=step_id is not None)
        params = {"run_id": run_id, "step_id": step_id}
        with translate_errors("loading a run"), self.engine.begin() as conn:
            row = conn.execute(run_q, params).one_or_none()
            if row is None:
                return None
            steps = conn.execute(steps_q, params).all()
            record = blob_store.resolve(conn, [RunRecord.model_validate(row._mapping)], RUN_FIELDS)
            recorded = blob_store.resolve(
                conn, [StepRecord.model_validate(s._mapping) for s in steps], STEP_FIELDS
            )
        return record[0], recorded

    def run_record(self, conn: Connection, run_id: UUID) -> RunRecord | None:
        """The run as the caller's transaction sees it."""
        row = conn.execute(
            select(runs).where(runs.c.id == run_id, runs.c.shard == shard_of(run_id))
        ).one_or_none()
        return None if row is None else RunRecord.model_validate(row._mapping)

    def step_record(self, run_id: UUID, step_id: str) -> StepRecord | None:
        """One recorded step."""
        query = select(steps).where(
            steps.c.run_id == run_id, steps.c.step_id == step_id, steps.c.shard == shard_of(run_id)
        )
        with translate_errors("loading a step"), self.engine.begin() as conn:
            row = conn.execute(query).one_or_none()
            if row is None:
                return None
            return blob_store.resolve(conn, [StepRecord.model_validate(row._mapping)], STEP_FIELDS)[
                0
            ]

    def list_runs(self, **filters: Any) -> list[RunRecord]:
        """Runs, newest first."""
        with translate_errors("listing runs"), self.engine.begin() as conn:
            rows = conn.execute(sql.list_runs(**filters)).all()
            return blob_store.resolve(
                conn, [RunRecord.model_validate(r._mapping) for r in rows], RUN_FIELDS
            )

    # -- effects ----------------------------------------------------------------

    def lock_key(self, conn: Connection, key: str) -> None:
        """Serialise transactions that intend the same caller-chosen key until commit."""
        conn.execute(text("SELECT pg_advisory_xact_lock(hashtextextended(:key, 0))"), {"key": key})

    def effect_by_key(self, conn: Connection, key: str, namespace: str) -> Effect | None:
        """The effect holding a caller's ``key`` in ``namespace``, as the transaction sees it.

        Found through the key's registry row (on the key's shard), then on its
        owner's shard: two single-shard reads rather than one over every shard.
        """
        params = {"namespace": namespace, "key": key}
        owner = conn.execute(sql.effect_key_owner(), params).one_or_none()
        if owner is None:
            return None
        home = shard_of(owner.run_id or owner.effect_id)
        row = conn.execute(sql.effect_on_shard(), {"id": owner.effect_id, "home": home}).first()
        if row is None:
            return None
        return blob_store.resolve(conn, [Effect.model_validate(row._mapping)], EFFECT_FIELDS)[0]

    def get_effect(self, effect_id: UUID) -> Effect | None:
        """One effect by id: on the shard its id names, else (an older id) on any."""
        with translate_errors("loading an effect"), self.engine.begin() as conn:
            named = {"id": effect_id, "home": shard_of(effect_id)}
            row = conn.execute(sql.effect_on_shard(), named).one_or_none()
            if row is None:
                row = conn.execute(select(effects).where(effects.c.id == effect_id)).one_or_none()
            if row is None:
                return None
            return blob_store.resolve(conn, [Effect.model_validate(row._mapping)], EFFECT_FIELDS)[0]

    def list_effects(self, **filters: Any) -> list[Effect]:
        """Effects in intent order."""
        with translate_errors("listing effects"), self.engine.begin() as conn:
            rows = conn.execute(sql.list_effects(**filters)).all()
            return blob_store.resolve(
                conn, [Effect.model_validate(r._mapping) for r in rows], EFFECT_FIELDS
            )

    def finished_effects(self, effect_ids: Sequence[UUID]) -> list[Effect]:
        """Those of ``effect_ids`` that are terminal (succeeded, failed, cancelled, compensated)."""
        if not effect_ids:
            return []
        with translate_errors("checking awaited effects"), self.engine.begin() as conn:
            rows = conn.execute(sql.finished_effects(), {"ids": list(effect_ids)}).all()
        return [Effect.model_validate(r._mapping) for r in rows]

    def attempts(self, effect_id: UUID) -> list[EffectAttempt]:
        """The attempt log of one effect, oldest first (read on the effect's shard)."""
        query = select(effect_attempts).where(effect_attempts.c.effect_id == effect_id)
        with translate_errors("loading attempts"), self.engine.begin() as conn:
            if self._is_sharded(conn):  # named, so that Citus reads that shard alone
                shard = stored_shard(conn, effect_id)
                query = query.where(effect_attempts.c.shard == (-1 if shard is None else shard))
            rows = conn.execute(query.order_by(effect_attempts.c.id)).all()
        return [EffectAttempt.model_validate(r._mapping) for r in rows]

    def operator_change(self, which: str, params: dict[str, Any]) -> bool:
        """An operator's compare-and-set on one effect (``resolve`` or ``retry``)."""
        statement: Callable[[bool], Any] = (
            partial(operator_changes.resolve_unknown, reopen=params["new_status"] == "pending")
            if which == "resolve"
            else operator_changes.retry_failed
        )
        ends = params.get("new_status") in TERMINAL_EFFECT_STATUSES
        effect_id = params["effect_id"]
        with translate_errors(f"{which} of an effect"), self.engine.begin() as conn:
            # The change and its log row go to the effect's shard alone on Citus.
            shard = stored_shard(conn, effect_id)
            if shard is None:
                return False
            bound = {**params, "effect_shard": shard}
            sharded = self._is_sharded(conn)
            if not logged_rows(conn, statement, bound, sharded=sharded):
                return False
            waiter = conn.execute(effect_sql.awaiting_run(), bound).scalar() if ends else None
            if waiter is not None and not sharded:
                wake_parked(conn, waiter, effect_id)  # with the change: both or neither
        if waiter is not None and sharded:
            self._wake_apart(waiter, effect_id)
        return True

    def _wake_apart(self, run_id: UUID, effect_id: UUID) -> None:
        """On Citus: wake a run parked on an effect that ended, in a transaction of its own.

        The run may live on another node: the change it follows committed on the
        effect's node alone, so a node that does not answer here stops only this
        wake-up, and the run still goes on when its recheck timer ends.
        """
        try:
            with self.engine.begin() as conn:
                wake_parked(conn, run_id, effect_id)
        except SQLAlchemyError as exc:
            log.warning("run %s parked on effect %s not woken (%s)", run_id, effect_id, exc)

    # -- governance -------------------------------------------------------------------

    def apply_gates(self, rows: list[dict[str, Any]], *, prune: bool) -> list[str]:
        """Upsert gate rows in one transaction; ``prune`` deletes gates not among them."""
        with translate_errors("storing approval gates"), self.engine.begin() as conn:
            stored = [conn.execute(gov_sql.upsert_gate(), row).scalar_one() for row in rows]
            if prune:
                conn.execute(gov_sql.delete_gates(keep=True), {"names": stored})
        return stored

    def list_gates(self) -> list[dict[str, Any]]:
        """Every approval gate as stored, by name."""
        with translate_errors("listing approval gates"), self.engine.begin() as conn:
            return [dict(r._mapping) for r in conn.execute(gov_sql.list_gates())]

    def remove_gates(self, names: list[str]) -> list[str]:
        """Delete gates by name; returns those deleted."""
        with translate_errors("removing approval gates"), self.engine.begin() as conn:
            return [r[0] for r in conn.execute(gov_sql.delete_gates(keep=False), {"names": names})]

    def audit_rows(self, run_id: UUID) -> dict[str, Any]:
        """Everything the audit of one run reads, in one snapshot (repeatable read)."""
        with translate_errors("reading a run's record"), self.engine.connect() as conn:
            conn = conn.execution_options(isolation_level="REPEATABLE READ")
            with conn.begin():
                run = conn.execute(gov_sql.audit_run(), {"run_id": run_id}).one_or_none()
                if run is None:
                    return {}
                params = {"run_id": run_id}
                found: dict[str, Any] = {
                    "run": dict(run._mapping),
                    "steps": [dict(r._mapping) for r in conn.execute(gov_sql.run_steps(), params)],
                    "effects": [
                        dict(r._mapping) for r in conn.execute(gov_sql.run_effects(), params)
                    ],
                    "attempts": [
                        dict(r._mapping) for r in conn.execute(gov_sql.attempts_of_run(), params)
                    ],
                }
                values = [found["run"][f] for f in RUN_FIELDS]
                values += [s[f] for s in found["steps"] for f in AUDITED_STEP_FIELDS]
                values += [e["payload"] for e in found["effects"]]
                found["blobs"] = blob_store.stored_rows(conn, reference_hashes(values))
                return found

    def run_ids(self, limit: int) -> list[UUID]:
        """Run ids, newest first (what ``outbox audit verify`` checks without a run named)."""
        with translate_errors("listing runs"), self.engine.begin() as conn:
            query = select(runs.c.id).order_by(runs.c.created_at.desc()).limit(limit)
            return [row[0] for row in conn.execute(query)]

    def notify(self, channel: str) -> None:
        """Send one NOTIFY outside any transaction of the caller's.

        Nothing durable rides on it, so it does not wait for a WAL flush.
        """
        with self.engine.connect() as conn:
            conn.execute(text("SET LOCAL synchronous_commit = off"))
            conn.execute(text("SELECT pg_notify(:channel, '')"), {"channel": channel})
            conn.commit()

    def run_versions(self) -> list[dict[str, Any]]:
        """Unfinished runs per agent, version and status (a version with none may retire)."""
        with translate_errors("counting runs per version"), self.engine.begin() as conn:
            rows = conn.execute(run_sql.run_versions()).all()
        return [
            {"agent": r.agent, "version": r.agent_version, "status": r.status, "runs": r.runs}
            for r in rows
        ]

    def ping(self) -> None:
        """One round trip to the server (health checks); raises :class:`DatabaseError`."""
        with translate_errors("checking the database"), self.engine.begin() as conn:
            conn.execute(text("SELECT 1"))

    def state_counts(self) -> maintenance.StateCounts:
        """Runs by status, open effects by (status, kind), age of the oldest pending effect."""
        with translate_errors("counting states"), self.engine.begin() as conn:
            return read_state_counts(conn)

    # -- audit (``outbox check``, chaos tests): whole tables of a small scratch database --

    def audit(self) -> dict[str, list[dict[str, Any]]]:
        """Every intent, attempt-log row and step record, as plain rows, in one snapshot."""
        with translate_errors("reading the audit"), self.engine.begin() as conn:
            conn.execute(text("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"))
            return {
                name: [dict(row._mapping) for row in conn.execute(statement)]
                for name, statement in (
                    ("effects", audit.all_effects()),
                    ("attempts", audit.all_attempts()),
                    ("steps", audit.all_steps()),
                )
            }

    def effect_counts(self) -> dict[str, int]:
        """Effects per status (every status present)."""
        with translate_errors("counting effects"), self.engine.begin() as conn:
            return {str(s): int(n) for s, n in conn.execute(audit.effect_status_counts()).all()}

    def expire_leases_of(self, owner_pattern: str) -> int:
        """End now the run and effect leases of owners matching ``owner_pattern`` (SQL LIKE).

        Only for an owner known to be dead (``outbox check`` saw its process
        exit): the runs are rescued and the attempts reconciled as if the
        leases had run out.
        """
        params = {"owner_pattern": owner_pattern}
        with translate_errors("ending a dead owner's leases"), self.engine.begin() as conn:
            ended = len(conn.execute(audit.expire_run_leases(), params).all())
            return ended + len(conn.execute(audit.expire_effect_leases(), params).all())

    def effect_kinds(self) -> list[str]:
        """The effect kinds intended so far."""
        with translate_errors("listing effect kinds"), self.engine.begin() as conn:
            return [str(k) for k in conn.execute(audit.effect_kinds()).scalars()]


def read_state_counts(conn: Connection) -> maintenance.StateCounts:
    """Runs by status, open effects by (status, kind), oldest pending age (sync or ``run_sync``)."""
    oldest = maintenance.oldest_pending_age(distributed(conn))
    return maintenance.StateCounts(
        runs={status: n for status, n in conn.execute(maintenance.run_counts()).all()},
        effects={(s, k): n for s, k, n in conn.execute(maintenance.open_effect_counts()).all()},
        oldest_pending_seconds=float(conn.execute(oldest).scalar_one()),
    )


def mark_consumed(conn: Connection, group: str, key: str) -> bool:
    """Mark ``key`` processed by consumer ``group`` in the caller's transaction; False if it was."""
    params = {"group": group, "key": key}
    return conn.execute(maintenance.mark_consumed(), params).first() is not None
