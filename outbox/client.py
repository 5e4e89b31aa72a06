"""The client library agents use: start a run, record tool calls, commit atomic steps.

A step's checkpoint, its intents and the caller's own rows are written in one
transaction (G1). Every step id is recorded once: a replayed step returns what
was recorded without running its function again (G5).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine

from outbox.database import open_engine
from outbox.errors import (
    RunNotFound,
    RunStateError,
    ValidationError,
)
from outbox.intents import OutboxTransaction
from outbox.models import (
    Effect,
    EffectStatus,
    RunRecord,
    RunStart,
)
from outbox.payloads import content_hash, encode
from outbox.run import Run
from outbox.settings import Settings
from outbox.statements import EFFECTS_CHANNEL, RUNS_CHANNEL
from outbox.store import Store
from outbox.validation import as_uuid, validated
from outbox.wakeup import WakeupThrottle

__all__ = ["Outbox"]

log = logging.getLogger(__name__)

T = TypeVar("T")


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
        start = validated(RunStart, agent=agent, version=version, inputs=inputs, budget=budget)
        inputs_json = encode(
            start.inputs, field="inputs", max_bytes=self.settings.max_payload_bytes
        )
        notify = self._runs_wakeup.inline()
        record = self.store.insert_run(
            {
                "id": uuid.uuid4() if run_id is None else as_uuid(run_id, "run_id"),
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
        rid = as_uuid(run_id, "run_id")
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
        eid = as_uuid(effect_id, "effect_id")
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
        rid = None if run_id is None else as_uuid(run_id, "run_id")
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
