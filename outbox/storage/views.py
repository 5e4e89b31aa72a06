"""Reads of the operator console, on the client's engine (no locks, short transactions).

Pages come back as :class:`Page`: the rows and the cursor of the next page
(``None`` on the last one). The statements are in :mod:`outbox.storage.sql.console`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any, Generic, TypeVar
from uuid import UUID

from sqlalchemy import Engine, select

from outbox.models import Effect, EffectAttempt, EffectStatus, RunRecord, StepRecord
from outbox.storage.engine import translate_errors
from outbox.storage.schema import effect_attempts, effects, runs
from outbox.storage.sql import console as sql
from outbox.storage.sql import runs as run_sql

__all__ = ["ConsoleViews", "Page", "RunDetail"]

T = TypeVar("T")

#: Rows shown on one page of a run's parts (steps, signals, ledger, effects).
PART_LIMIT = 500


@dataclass(frozen=True)
class Page(Generic[T]):
    """One page of a list and the cursor that continues it."""

    rows: list[T]
    next_cursor: str | None


@dataclass(frozen=True)
class RunDetail:
    """Everything the run page shows."""

    run: RunRecord
    steps: list[StepRecord]
    signals: list[dict[str, Any]]
    ledger: list[dict[str, Any]]
    effects: list[dict[str, Any]]
    #: Reservations given back (effects that failed or were cancelled), over the whole ledger.
    released: Decimal = Decimal(0)


def _rows(result: Any) -> list[dict[str, Any]]:
    return [dict(row._mapping) for row in result]


class ConsoleViews:
    """The console's reads on one engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def runs(
        self,
        *,
        agent: str | None = None,
        version: str | None = None,
        status: str | None = None,
        newer_than_s: float | None = None,
        older_than_s: float | None = None,
        cursor: str | None = None,
        limit: int = 50,
    ) -> Page[dict[str, Any]]:
        """A page of runs, newest first; ``cursor`` is the previous page's ``next_cursor``."""
        after = None
        if cursor:
            at, _, rid = cursor.partition("~")
            after = (datetime.fromisoformat(at), UUID(rid))
        query, params = sql.runs_page(
            agent=agent,
            version=version,
            status=status,
            newer_than_s=newer_than_s,
            older_than_s=older_than_s,
            after=after,
            limit=limit + 1,
        )
        with translate_errors("listing runs"), self.engine.begin() as conn:
            rows = _rows(conn.execute(query, params))
        more = len(rows) > limit
        rows = rows[:limit]
        last = rows[-1] if rows and more else None
        return Page(
            rows, None if last is None else f"{last['created_at'].isoformat()}~{last['id']}"
        )

    def effects(
        self,
        *,
        status: str | None = None,
        kind: str | None = None,
        cursor: str | None = None,
        limit: int = 50,
    ) -> Page[dict[str, Any]]:
        """A page of effects, newest first."""
        query, params = sql.effect_page(
            status=status, kind=kind, after=UUID(cursor) if cursor else None, limit=limit + 1
        )
        with translate_errors("listing effects"), self.engine.begin() as conn:
            rows = _rows(conn.execute(query, params))
        more = len(rows) > limit
        rows = rows[:limit]
        return Page(rows, str(rows[-1]["id"]) if rows and more else None)

    def queue(
        self, status: EffectStatus, *, cursor: str | None = None, limit: int = 50
    ) -> Page[dict[str, Any]]:
        """``unknown`` or ``failed`` effects, oldest first, with their last attempt."""
        query, params = sql.operator_queue(
            status.value, after=int(cursor) if cursor else None, limit=limit + 1
        )
        with translate_errors("listing the operator queue"), self.engine.begin() as conn:
            rows = _rows(conn.execute(query, params))
        more = len(rows) > limit
        rows = rows[:limit]
        return Page(rows, str(rows[-1]["seq"]) if rows and more else None)

    def find(self, text: str) -> tuple[str, UUID] | None:
        """What a search box names: ``("run", id)`` or ``("effect", id)``, or ``None``.

        A run id, an effect id, or an idempotency key (whose effect's run is
        returned, or the effect itself when it belongs to no run).
        """
        text = text.strip()
        with translate_errors("searching"), self.engine.begin() as conn:
            try:
                uid = UUID(text)
            except ValueError:
                uid = None
            if uid is not None:
                if conn.execute(select(runs.c.id).where(runs.c.id == uid)).first():
                    return ("run", uid)
                if conn.execute(select(effects.c.id).where(effects.c.id == uid)).first():
                    return ("effect", uid)
            row = conn.execute(sql.run_by_key(), {"key": text}).first()
        if row is None:
            return None
        return ("run", row.run_id) if row.run_id is not None else ("effect", row.id)

    def run(self, run_id: UUID) -> RunDetail | None:
        """The run with its steps, signals, budget ledger and effects (each capped)."""
        part = {"run_id": run_id, "lim": PART_LIMIT}
        with translate_errors("loading a run"), self.engine.begin() as conn:
            row = conn.execute(select(runs).where(runs.c.id == run_id)).first()
            if row is None:
                return None
            return RunDetail(
                run=RunRecord.model_validate(row._mapping),
                steps=[
                    StepRecord.model_validate(s._mapping)
                    for s in conn.execute(sql.steps_of_run(), part)
                ],
                signals=_rows(conn.execute(sql.signals_of_run(), part)),
                ledger=_rows(conn.execute(sql.ledger_of_run(), part)),
                effects=_rows(conn.execute(sql.effects_of_run(), part)),
                released=conn.execute(sql.released_of_run(), part).scalar_one(),
            )

    def effect(
        self, effect_id: UUID
    ) -> tuple[Effect, list[EffectAttempt], list[dict[str, Any]]] | None:
        """One effect, its attempt log, and the effects that compensate it."""
        with translate_errors("loading an effect"), self.engine.begin() as conn:
            row = conn.execute(select(effects).where(effects.c.id == effect_id)).first()
            if row is None:
                return None
            attempts = conn.execute(
                select(effect_attempts)
                .where(effect_attempts.c.effect_id == effect_id)
                .order_by(effect_attempts.c.id)
                .limit(PART_LIMIT)
            )
            return (
                Effect.model_validate(row._mapping),
                [EffectAttempt.model_validate(a._mapping) for a in attempts],
                _rows(conn.execute(sql.compensations_of(), {"effect_id": effect_id})),
            )

    def delivery_by_minute(self, seconds: float = 3600) -> list[dict[str, Any]]:
        """Succeeded effects per minute over the last ``seconds`` with p50/p95 latency."""
        with translate_errors("reading delivery rates"), self.engine.begin() as conn:
            return _rows(conn.execute(sql.delivery_by_minute(), {"seconds": seconds}))

    def versions(self) -> list[dict[str, Any]]:
        """Unfinished runs per agent, version and status."""
        with translate_errors("counting runs per version"), self.engine.begin() as conn:
            return _rows(conn.execute(run_sql.run_versions()))

    def revoke_session(self, digest: str, until: datetime) -> None:
        """Remember that the session ``digest`` was signed out (until it would expire)."""
        with translate_errors("signing out"), self.engine.begin() as conn:
            conn.execute(sql.revoke_session(), {"digest": digest, "until": until})

    def session_revoked(self, digest: str) -> bool:
        """Whether the session ``digest`` was signed out."""
        with translate_errors("checking a session"), self.engine.begin() as conn:
            return conn.execute(sql.session_revoked(), {"digest": digest}).first() is not None
