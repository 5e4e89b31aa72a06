"""The client library agents use: start a run, record tool calls, commit atomic steps.

A step's checkpoint, its intents and the caller's own rows are written in one
transaction (G1). Every step id is recorded once: a replayed step returns what
was recorded without running its function again (G5).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, TypeVar

import pydantic
from sqlalchemy import Connection, Engine

from outbox.database import open_engine
from outbox.errors import (
    BudgetExceeded,
    IdempotencyConflict,
    LeaseLost,
    OutboxError,
    RunNotFound,
    RunStateError,
    RunTerminal,
    ValidationError,
)
from outbox.keys import derive_key
from outbox.models import (
    TERMINAL_RUN_STATUSES,
    Compensation,
    Effect,
    EffectIntent,
    EffectStatus,
    RunRecord,
    RunStart,
    RunStatus,
    StepRecord,
)
from outbox.payloads import content_hash, decode, encode
from outbox.settings import Settings
from outbox.statements import EFFECTS_CHANNEL, RUNS_CHANNEL
from outbox.store import Store, effects_json
from outbox.wakeup import WakeupThrottle

__all__ = ["Outbox", "OutboxTransaction", "Run", "StepTransaction"]

log = logging.getLogger(__name__)

T = TypeVar("T")


def _validated(model: type[pydantic.BaseModel], **values: Any) -> Any:
    """Validate boundary input, turning pydantic's error into ours (field and value named)."""
    try:
        return model(**values)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or model.__name__
        raise ValidationError(field, first.get("input"), first["msg"]) from None


def _as_uuid(value: uuid.UUID | str, field: str) -> uuid.UUID:
    if isinstance(value, uuid.UUID):
        return value
    try:
        return uuid.UUID(str(value))
    except ValueError:
        raise ValidationError(field, value, "not a UUID") from None


class _AlreadyRecorded(Exception):
    """Internal: the step was recorded by someone else; roll ours back and replay."""


class Outbox:
    """Entry point: a connection to the outbox store.

    Use :meth:`connect`; close it (or use it as a context manager) when done.
    """

    def __init__(self, engine: Engine, settings: Settings | None = None) -> None:
        self.settings = settings or Settings()
        self.engine = engine
        self.store = Store(engine)
        window = self.settings.notify_window_ms / 1000
        self._effects_wakeup = WakeupThrottle(
            lambda: self.store.notify(EFFECTS_CHANNEL), window_s=window
        )
        self._runs_wakeup = WakeupThrottle(lambda: self.store.notify(RUNS_CHANNEL), window_s=window)

    @classmethod
    def connect(
        cls, dsn: str | None = None, *, settings: Settings | None = None, **overrides: Any
    ) -> Outbox:
        """Connect to ``dsn``, else ``OUTBOX_DSN``, else the embedded PostgreSQL in ``./.outbox``.

        Keyword overrides (``home=``, ``max_payload_bytes=``, ...) are
        :class:`~outbox.Settings` fields. The embedded server is started when
        needed and migrated automatically; another database must be migrated
        with ``outbox migrate`` first.
        """
        if settings is None:
            settings = Settings.from_env(dsn=dsn, **overrides)
        elif dsn is not None or overrides:
            settings = settings.model_copy(update={"dsn": dsn or settings.dsn, **overrides})
        return cls(open_engine(settings), settings)

    def close(self) -> None:
        """Send owed wake-ups and release every connection."""
        self._effects_wakeup.close()
        self._runs_wakeup.close()
        self.engine.dispose()

    def __enter__(self) -> Outbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- runs -------------------------------------------------------------------

    def start_run(
        self,
        agent: str,
        version: str,
        inputs: Any = None,
        *,
        budget: float | None = None,
        run_id: uuid.UUID | str | None = None,
    ) -> Run:
        """Start a run of ``agent`` pinned to ``version``, with immutable ``inputs``.

        The run is ``runnable``: drive it from this process with :meth:`Run.call`
        and :meth:`Run.transaction`, or let a worker of that agent and version
        claim it. ``budget`` caps what its steps may spend (G7).
        """
        start = _validated(RunStart, agent=agent, version=version, inputs=inputs, budget=budget)
        inputs_json = encode(
            start.inputs, field="inputs", max_bytes=self.settings.max_payload_bytes
        )
        notify = self._runs_wakeup.inline()
        record = self.store.insert_run(
            {
                "id": uuid.uuid4() if run_id is None else _as_uuid(run_id, "run_id"),
                "agent": start.agent,
                "agent_version": start.version,
                "inputs": inputs_json,
                "inputs_hash": content_hash(inputs_json),
                "budget": None if start.budget is None else Decimal(str(start.budget)),
            },
            notify=notify,
        )
        self._runs_wakeup.committed(notify)
        log.info("run started", extra={"run_id": str(record.id), "agent": agent})
        return Run(self, record, [])

    def run(self, run_id: uuid.UUID | str) -> Run:
        """Load a run (in any process) to inspect or resume it."""
        rid = _as_uuid(run_id, "run_id")
        loaded = self.store.load_run(rid)
        if loaded is None:
            raise RunNotFound(rid)
        return Run(self, *loaded)

    def runs(
        self, *, status: str | None = None, agent: str | None = None, limit: int = 100
    ) -> list[RunRecord]:
        """Recent runs, newest first."""
        return self.store.list_runs(status=status, agent=agent, limit=limit)

    # -- effects ----------------------------------------------------------------

    def effect(self, effect_id: uuid.UUID | str) -> Effect:
        """One effect by id."""
        eid = _as_uuid(effect_id, "effect_id")
        found = self.store.get_effect(eid)
        if found is None:
            from outbox.errors import EffectNotFound

            raise EffectNotFound(eid)
        return found

    def effects(
        self,
        *,
        run_id: uuid.UUID | str | None = None,
        status: str | None = None,
        kind: str | None = None,
        limit: int = 100,
    ) -> list[Effect]:
        """Effects in intent order, filtered by run, status or kind."""
        if status is not None and status not in EffectStatus.__members__.values():
            raise ValidationError("status", status, f"not one of {[s.value for s in EffectStatus]}")
        rid = None if run_id is None else _as_uuid(run_id, "run_id")
        return self.store.list_effects(run_id=rid, status=status, kind=kind, limit=limit)

    def resolve_effect(
        self, effect_id: uuid.UUID | str, *, outcome: str, note: str, operator: str
    ) -> Effect:
        """Close an ``unknown`` effect after checking the outside world by hand.

        ``outcome`` is ``succeeded`` (it did happen), ``failed`` (it did not and
        must not be retried) or ``retry`` (it did not: deliver it again, same key).
        Recorded in the attempt log with ``operator`` and ``note``.
        """
        choices = {"succeeded": "succeeded", "failed": "failed", "retry": "pending"}
        if outcome not in choices:
            raise ValidationError("outcome", outcome, f"must be one of {sorted(choices)}")
        if not note.strip():
            raise ValidationError("note", note, "say why (it is kept in the attempt log)")
        effect = self.effect(effect_id)
        detail = encode({"as": outcome, "note": note, "by": operator}, field="note")
        changed = self.store.operator_change(
            "resolve",
            {
                "effect_id": effect.id,
                "new_status": choices[outcome],
                "operator": operator,
                "detail": detail,
            },
        )
        if not changed:
            raise RunStateError(
                f"effect_id={str(effect.id)!r} is {effect.status.value}, not unknown: "
                "only unknown effects are resolved"
            )
        if outcome == "retry":
            self._effects_wakeup.committed(False)
        return self.effect(effect.id)

    def retry_effect(
        self, effect_id: uuid.UUID | str, *, operator: str, extra_attempts: int = 3
    ) -> Effect:
        """Put a ``failed`` effect back to ``pending`` (same key) with ``extra_attempts`` tries."""
        if extra_attempts < 1:
            raise ValidationError("extra_attempts", extra_attempts, "must be at least 1")
        effect = self.effect(effect_id)
        detail = encode({"extra_attempts": extra_attempts, "by": operator}, field="detail")
        changed = self.store.operator_change(
            "retry",
            {
                "effect_id": effect.id,
                "extra_attempts": extra_attempts,
                "operator": operator,
                "detail": detail,
            },
        )
        if not changed:
            raise RunStateError(
                f"effect_id={str(effect.id)!r} is {effect.status.value}, not failed: "
                "only failed effects are retried (resolve unknown ones)"
            )
        self._effects_wakeup.committed(False)
        return self.effect(effect.id)

    @contextmanager
    def transaction(self, connection: Connection | None = None) -> Iterator[OutboxTransaction]:
        """Intents that belong to no run, committed with the caller's rows (plain outbox use).

        With ``connection``, the intents join the caller's open transaction (in a
        savepoint) and commit when the caller commits.
        """
        with self.store.begin(connection) as conn:
            tx = OutboxTransaction(self, conn)
            yield tx
            tx._flush()
        if connection is None:
            self._effects_wakeup.committed(tx._notified)


class _Intents:
    """Intents gathered during one transaction, written in one statement at its end."""

    def __init__(self, outbox: Outbox, conn: Connection) -> None:
        self._outbox = outbox
        self._conn = conn
        self._rows: list[dict[str, Any]] = []
        self._keys: dict[str, str] = {}
        self.count = 0

    @property
    def pending(self) -> int:
        return len(self._rows)

    def add(
        self,
        *,
        run_id: uuid.UUID | None,
        step_id: str | None,
        kind: str,
        payload: Any,
        options: dict[str, Any],
    ) -> Effect:
        intent: EffectIntent = _validated(EffectIntent, kind=kind, payload=payload, **options)
        limit = self._outbox.settings.max_payload_bytes
        payload_json = encode(intent.payload, field="payload", max_bytes=limit)
        payload_hash = content_hash(payload_json)
        compensate_json = None
        if intent.compensate is not None:
            compensate_json = encode(intent.compensate, field="compensate", max_bytes=limit)
        index = self.count
        self.count += 1
        if intent.key is not None:
            key = intent.key
        elif run_id is not None and step_id is not None:
            key = derive_key(run_id, step_id, index)
        else:
            key = uuid.uuid4().hex
        if key in self._keys:
            if self._keys[key] != payload_hash:
                raise IdempotencyConflict(
                    key, "intended twice in this step with different payloads"
                )
            return next(_effect(r) for r in self._rows if r["idempotency_key"] == key)
        if intent.key is not None:
            # A caller's key may already be taken by any run: wait for a racing
            # transaction holding it, then look (so two racers make one row).
            self._outbox.store.lock_key(self._conn, key)
            existing = self._outbox.store.effect_by_key(self._conn, key)
            if existing is not None:
                if existing.payload_hash != payload_hash:
                    raise IdempotencyConflict(key)
                return existing
        row = {
            "id": str(uuid.uuid4()),
            "step_index": index,
            "kind": intent.kind,
            "payload": payload_json,
            "payload_hash": payload_hash,
            "schema_version": intent.schema_version,
            "idempotency_key": key,
            "ordering_key": intent.ordering_key,
            "max_attempts": intent.max_attempts,
            "compensate": compensate_json,
            "compensates": None,
            "cost": intent.cost,
            "delay_seconds": intent.delay_seconds,
            "_run_id": run_id,
            "_step_id": step_id,
        }
        self._rows.append(row)
        self._keys[key] = payload_hash
        return _effect(row)

    def as_json(self) -> str:
        return effects_json(
            [{k: v for k, v in r.items() if not k.startswith("_")} for r in self._rows]
        )


def _effect(row: dict[str, Any]) -> Effect:
    return Effect(
        id=uuid.UUID(row["id"]),
        run_id=row["_run_id"],
        step_id=row["_step_id"],
        step_index=row["step_index"],
        kind=row["kind"],
        payload=decode(row["payload"]),
        payload_hash=row["payload_hash"],
        schema_version=row["schema_version"],
        idempotency_key=row["idempotency_key"],
        ordering_key=row["ordering_key"],
        status=EffectStatus.PENDING,
        max_attempts=row["max_attempts"],
        compensate=None
        if row["compensate"] is None
        else Compensation.model_validate_json(row["compensate"]),
        cost=None if row["cost"] is None else Decimal(str(row["cost"])),
    )


class OutboxTransaction:
    """Run-less intents inside one transaction: ``tx.connection`` and ``tx.intend``."""

    def __init__(self, outbox: Outbox, connection: Connection) -> None:
        self.connection = connection
        self._outbox = outbox
        self._intents = _Intents(outbox, connection)
        self._notified = False

    def intend(self, kind: str, payload: Any, *, key: str | None = None, **options: Any) -> Effect:
        """Record that effect ``kind`` with ``payload`` must happen once this commits."""
        return self._intents.add(
            run_id=None, step_id=None, kind=kind, payload=payload, options={"key": key, **options}
        )

    def _flush(self) -> None:
        if not self._intents.pending:
            return
        self._notified = self._outbox._effects_wakeup.inline()
        inserted = self._outbox.store.intend_without_run(
            self.connection, self._intents.as_json(), notify=self._notified
        )
        if inserted != self._intents.pending:
            raise IdempotencyConflict("?", "a key of this transaction was taken concurrently")


class StepTransaction:
    """What an atomic step's function receives: one open transaction.

    ``connection`` is a SQLAlchemy ``Connection`` in that transaction: rows the
    caller writes on it commit (or roll back) together with the checkpoint and
    the intents. Do not commit or roll back on it yourself.
    """

    def __init__(self, run: Run, connection: Connection, step_id: str) -> None:
        self.connection = connection
        self.run = run
        self.step_id = step_id
        self._state_json: str | None = None
        self._plan_json: str | None = None
        self._debit = Decimal(0)
        self._intents = _Intents(run._outbox, connection)

    def set_state(self, state: Any) -> None:
        """Replace the run's state when this step commits."""
        self._state_json = encode(
            state, field="state", max_bytes=self.run._outbox.settings.max_payload_bytes
        )

    def set_plan(self, plan: Any) -> None:
        """Replace the run's plan (task list) when this step commits."""
        self._plan_json = encode(
            plan, field="plan", max_bytes=self.run._outbox.settings.max_payload_bytes
        )

    def intend(
        self,
        kind: str,
        payload: Any,
        *,
        key: str | None = None,
        ordering_key: str | None = None,
        max_attempts: int | None = None,
        delay_seconds: float = 0.0,
        schema_version: int = 1,
        compensate: tuple[str, Any] | None = None,
        cost: float | None = None,
    ) -> Effect:
        """Record that effect ``kind`` with ``payload`` must happen, once, if this step commits.

        The idempotency key defaults to one derived from (run, step, index of
        this intent in the step), so a replayed step re-derives the same key.
        A caller's own ``key`` must be unique across all runs: reusing it with
        the same payload returns the existing intent, with another payload
        raises :class:`~outbox.IdempotencyConflict`.
        """
        options: dict[str, Any] = {
            "key": key,
            "ordering_key": ordering_key,
            "max_attempts": max_attempts,
            "delay_seconds": delay_seconds,
            "schema_version": schema_version,
            "cost": cost,
        }
        if compensate is not None:
            options["compensate"] = {"kind": compensate[0], "payload": compensate[1]}
        return self._intents.add(
            run_id=self.run.id, step_id=self.step_id, kind=kind, payload=payload, options=options
        )


class Run:
    """A handle on one run: its recorded steps, state and plan, and the calls that advance it."""

    def __init__(
        self,
        outbox: Outbox,
        record: RunRecord,
        steps: list[StepRecord],
        *,
        lease: tuple[str, int] | None = None,
    ) -> None:
        self._outbox = outbox
        self._record = record
        self._steps = {s.step_id: s for s in steps}
        self._lease = lease

    # -- what it is -------------------------------------------------------------

    @property
    def id(self) -> uuid.UUID:
        """The run's id."""
        return self._record.id

    @property
    def record(self) -> RunRecord:
        """The run as last read or written by this handle."""
        return self._record

    @property
    def agent(self) -> str:
        """The agent that runs it."""
        return self._record.agent

    @property
    def version(self) -> str:
        """The agent version it is pinned to."""
        return self._record.agent_version

    @property
    def inputs(self) -> Any:
        """The inputs it started with (never change)."""
        return self._record.inputs

    @property
    def status(self) -> RunStatus:
        """Its status as last seen by this handle."""
        return self._record.status

    @property
    def state(self) -> Any:
        """The state recorded by the last step that set one."""
        return self._record.state

    @property
    def plan(self) -> Any:
        """The plan recorded by the last step that set one."""
        return self._record.plan

    @property
    def current_step(self) -> str | None:
        """The last step recorded."""
        return self._record.current_step

    @property
    def completed_steps(self) -> list[str]:
        """Step ids recorded so far, in order."""
        return [s.step_id for s in sorted(self._steps.values(), key=lambda s: s.seq)]

    def step(self, step_id: str) -> StepRecord | None:
        """The record of one completed step, if any."""
        return self._steps.get(step_id)

    def effects(self) -> list[Effect]:
        """Every effect this run intended, in intent order, with its delivery state."""
        return self._outbox.store.list_effects(run_id=self.id, limit=1_000_000)

    def refresh(self) -> Run:
        """Re-read the run and its steps from the store."""
        loaded = self._outbox.store.load_run(self.id)
        if loaded is None:
            raise RunNotFound(self.id)
        self._record, steps = loaded
        self._steps = {s.step_id: s for s in steps}
        return self

    def __repr__(self) -> str:
        return (
            f"<Run {self.id} {self.agent}@{self.version} {self.status.value}"
            f" steps={len(self._steps)}>"
        )

    # -- advancing it -----------------------------------------------------------

    def call(self, step_id: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Any:
        """Call ``fn`` once for this run and record its JSON result under ``step_id``.

        ``fn`` runs outside any transaction (it may take minutes). On replay the
        recorded result is returned and ``fn`` is not called. If two processes
        race, the first recorded result wins and both return it. If ``fn``
        raises, nothing is recorded.
        """
        step_id = self._check_step_id(step_id)
        if step_id in self._steps:
            return self._replay(self._steps[step_id])
        self._check_live()
        result_json = encode(
            fn(*args, **kwargs), field="result", max_bytes=self._outbox.settings.max_payload_bytes
        )
        return self._commit(step_id, "call", result_json, None, None)

    def transaction(
        self,
        step_id: str,
        fn: Callable[[StepTransaction], Any],
        *,
        connection: Connection | None = None,
    ) -> Any:
        """Run ``fn`` in one transaction and commit its checkpoint, intents and rows together.

        If ``fn`` raises, nothing of the step is written (G1). If the step was
        already recorded, its result is returned and ``fn`` does not run (G5).
        With ``connection``, the step joins the caller's open transaction.
        """
        step_id = self._check_step_id(step_id)
        if step_id in self._steps:
            return self._replay(self._steps[step_id])
        self._check_live()
        return self._commit(step_id, "transaction", None, fn, connection)

    def complete(self, result: Any = None) -> None:
        """End the run as ``completed`` with an optional JSON result."""
        self._finish(RunStatus.COMPLETED, result=result)

    def fail(self, error: Any) -> None:
        """End the run as ``failed`` with a JSON-able description of why."""
        self._finish(RunStatus.FAILED, error=error)

    # -- internals --------------------------------------------------------------

    def _check_step_id(self, step_id: Any) -> str:
        limit = self._outbox.settings.max_step_id_length
        if not isinstance(step_id, str):
            raise ValidationError("step_id", step_id, "must be a string")
        if not step_id.strip():
            raise ValidationError("step_id", step_id, "must not be empty")
        if len(step_id) > limit:
            raise ValidationError("step_id", step_id, f"is {len(step_id)} characters, over {limit}")
        return step_id

    def _check_live(self) -> None:
        if self.status in TERMINAL_RUN_STATUSES:
            raise RunTerminal(self.id, self.status.value)

    def _replay(self, step: StepRecord) -> Any:
        return step.result

    def _commit(
        self,
        step_id: str,
        kind: str,
        result_json: str | None,
        fn: Callable[[StepTransaction], Any] | None,
        connection: Connection | None,
    ) -> Any:
        store = self._outbox.store
        wakeup = self._outbox._effects_wakeup
        notified = False
        try:
            with store.begin(connection) as conn:
                tx = StepTransaction(self, conn, step_id)
                if fn is not None:
                    result_json = encode(
                        fn(tx), field="result", max_bytes=self._outbox.settings.max_payload_bytes
                    )
                has_intents = tx._intents.pending > 0
                notified = has_intents and wakeup.inline()
                outcome = store.commit_step(
                    conn,
                    {
                        "run_id": self.id,
                        "step_id": step_id,
                        "kind": kind,
                        "step_result": result_json,
                        "new_state": tx._state_json,
                        "new_plan": tx._plan_json,
                        "effects": tx._intents.as_json(),
                        "debit": tx._debit,
                        "reserve": Decimal(0),
                        **self._fence_params(),
                    },
                    fenced=self._lease is not None,
                    notify=notified,
                )
                if not outcome.run_ok:
                    raise self._refusal(conn, tx._debit)
                if outcome.step_seq is None:
                    raise _AlreadyRecorded
                if outcome.inserted != tx._intents.pending:
                    raise IdempotencyConflict(
                        "?", "an intent's key was taken by another transaction"
                    )
        except _AlreadyRecorded:
            # Another process recorded this step first; ours was rolled back whole.
            recorded = store.step_record(self.id, step_id)
            assert recorded is not None
            self._steps[step_id] = recorded
            return self._replay(recorded)
        if has_intents and connection is None:
            wakeup.committed(notified)
        self._record = self._record.model_copy(
            update={
                "current_step": step_id,
                **({"state": decode(tx._state_json)} if tx._state_json is not None else {}),
                **({"plan": decode(tx._plan_json)} if tx._plan_json is not None else {}),
            }
        )
        result = decode(result_json)
        self._steps[step_id] = StepRecord(
            run_id=self.id,
            step_id=step_id,
            seq=outcome.step_seq or 0,
            kind=kind,
            result=result,
            completed_at=datetime.now(UTC),
        )
        return result

    def _fence_params(self) -> dict[str, Any]:
        if self._lease is None:
            return {}
        return {"fence_owner": self._lease[0], "fence_attempt": self._lease[1]}

    def _refusal(self, conn: Connection, debit: Decimal) -> OutboxError:
        """Explain why the run refused a step (it wrote nothing)."""
        current = self._outbox.store.run_record(conn, self.id)
        if current is None:
            return RunNotFound(self.id)
        self._record = current
        if current.status in TERMINAL_RUN_STATUSES or current.status not in (
            RunStatus.RUNNABLE,
            RunStatus.RUNNING,
            RunStatus.WAITING,
        ):
            return RunTerminal(self.id, current.status.value)
        if self._lease is not None and (current.lease_owner, current.attempt) != self._lease:
            return LeaseLost(
                f"run_id={str(self.id)!r}: lease attempt {self._lease[1]} of {self._lease[0]!r} "
                f"was taken over (now attempt {current.attempt} of {current.lease_owner!r})"
            )
        budget = current.budget or Decimal(0)
        remaining = budget - current.spent - current.reserved
        return BudgetExceeded(self.id, float(debit), float(remaining))

    def _finish(self, status: RunStatus, *, result: Any = None, error: Any = None) -> None:
        limit = self._outbox.settings.max_payload_bytes
        result_json = None if result is None else encode(result, field="result", max_bytes=limit)
        error_json = None if error is None else encode(error, field="error", max_bytes=limit)
        done = self._outbox.store.finish_run(
            self.id, status=status.value, result=result_json, error=error_json, fence=self._lease
        )
        if not done:
            self.refresh()
            if self._lease is not None and self.status not in TERMINAL_RUN_STATUSES:
                raise LeaseLost(f"run_id={str(self.id)!r}: lease was taken over")
            raise RunTerminal(self.id, self.status.value)
        self._record = self._record.model_copy(
            update={"status": status, "result": decode(result_json), "error": decode(error_json)}
        )
