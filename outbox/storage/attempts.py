"""What the delivery side reads and writes: claimed attempts, their outcomes, duty probes.

Plain values, built from rows by the store (:mod:`outbox.storage.async_store`)
and handed to the daemons, which never see a row.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from outbox.errors import OutboxError
from outbox.models import AttemptOutcome, EffectStatus

__all__ = ["Batched", "ClaimedEffect", "Completion", "DutyAsk", "DutyFindings", "OutcomesLeft"]

#: One encoder for every completion (``json.dumps`` with options builds one per call).
_ENCODE = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


@dataclass(frozen=True, slots=True)
class ClaimedEffect:
    """A claimed attempt at one effect, as the delivery side sees it."""

    id: UUID
    run_id: UUID | None
    kind: str
    payload: Any
    idempotency_key: str
    attempt: int
    max_attempts: int | None
    schema_version: int
    ordering_key: str | None
    created_at: datetime
    attempt_started_at: datetime | None
    lease_owner: str | None
    #: what the deliverer noted before calling, for this attempt only (else None)
    attempt_note: Any = None
    #: The W3C traceparent stored with the intent (None: written outside any trace).
    trace_parent: str | None = None
    #: Its shard (``outbox.shards``): where its outcome is written.
    shard: int | None = None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> ClaimedEffect:
        """Build from a row of ``outbox_effects``."""
        return cls(
            id=row["id"],
            run_id=row["run_id"],
            kind=row["kind"],
            payload=row["payload"],
            idempotency_key=row["idempotency_key"],
            attempt=row["attempt"],
            max_attempts=row["max_attempts"],
            schema_version=row["schema_version"],
            ordering_key=row["ordering_key"],
            created_at=row["created_at"],
            attempt_started_at=row["attempt_started_at"],
            lease_owner=row["lease_owner"],
            attempt_note=_current_note(row.get("attempt_note"), row["attempt"]),
            trace_parent=row.get("trace_parent"),
            shard=row.get("shard"),
        )

    @property
    def started_iso(self) -> str | None:
        """When this attempt started, as the attempt log records it."""
        return None if self.attempt_started_at is None else self.attempt_started_at.isoformat()


@dataclass(frozen=True, slots=True)
class Completion:
    """The recorded end of one attempt (a row of ``complete_effects``'s ``done``)."""

    effect_id: UUID
    attempt: int
    status: str
    outcome: str
    result_json: str | None = None
    error: str | None = None
    delay: float = 0.0
    detail_json: str | None = None
    started_at: str | None = None
    #: The effect's shard, where the outcome is written (None: looked up).
    shard: int | None = None

    @classmethod
    def released(cls, effect: ClaimedEffect, reason: str, *, delay: float = 0.0) -> Completion:
        """An attempt given back unstarted: ``pending`` again, ``reason`` in the log."""
        return cls(
            effect.id,
            effect.attempt,
            EffectStatus.PENDING,
            AttemptOutcome.RELEASED,
            error=reason,
            delay=delay,
            started_at=effect.started_iso,
            shard=effect.shard,
        )

    def as_json(self) -> str:
        """One element of the ``done`` parameter; result and detail spliced in as JSON text."""
        # A non-finite delay fails here, in this one row, not in the batch's statement.
        head = _ENCODE(
            {
                "id": str(self.effect_id),
                "attempt": self.attempt,
                "status": self.status,
                "outcome": self.outcome,
                "error": self.error,
                "delay": self.delay,
                "started_at": self.started_at,
                "shard": self.shard,
            }
        )
        return (
            f'{head[:-1]},"result":{self.result_json or "null"},'
            f'"detail":{self.detail_json or "null"}}}'
        )


class OutcomesLeft(OutboxError):
    """Some of a batch's outcomes were written, the others not (on Citus each part commits alone).

    Between the store and the outcome writer: ``logged`` is committed, ``left``
    is to be written again, as a batch that failed whole would be, for ``error``.
    """

    def __init__(
        self, logged: list[tuple[UUID, str]], left: list[Completion], error: Exception
    ) -> None:
        super().__init__(f"{len(left)} outcomes not written: {error}")
        self.logged, self.left, self.error = logged, left, error


class ClaimCutShort(OutboxError):
    """On Citus: a claim's statement on one shard failed after others had committed theirs.

    ``rows``: what the claim's statements committed (every partition's so far);
    they are the caller's, or their leases would run out on effects nobody
    started. ``lost``: the failure was the session's own, not the shard's.
    ``left``: for a claim of named effects (a stream deliverer's), the ids no
    statement settled, to be claimed again.
    """

    def __init__(
        self,
        rows: list[Any],
        error: Exception,
        shard: int,
        *,
        lost: bool,
        left: Sequence[UUID] = (),
    ) -> None:
        super().__init__(f"claiming on shard {shard} failed after {len(rows)} rows: {error}")
        self.rows, self.error, self.shard, self.lost = rows, error, shard, lost
        self.left = list(left)


@dataclass(frozen=True, slots=True)
class DutyAsk:
    """What a daemon's duty probe asks (see :func:`outbox.storage.sql.duties.duty_probe`)."""

    #: Kinds whose ``unknown`` effects the reconciler settles by asking the sink.
    askable: tuple[str, ...] = ()
    #: Idempotent kinds early recovery puts back; empty: gone owners are not looked for.
    gone_kinds: tuple[str, ...] = ()
    restart_grace: float = 5.0

    def params(self) -> dict[str, Any]:
        """The probe's parameters."""
        return {
            "askable": list(self.askable),
            "kinds": list(self.gone_kinds),
            "gone": bool(self.gone_kinds),
            "restart_grace": self.restart_grace,
        }


@dataclass(frozen=True, slots=True)
class DutyFindings:
    """Which duties the probe found work for."""

    #: The reconciler has work: an expired lease or TTL, an askable ``unknown``.
    expired: bool = False
    #: An approval deadline passed.
    approvals: bool = False
    #: A run is being cancelled or compensated.
    stopping: bool = False
    #: Registered owners whose lock is free: (owner, holds an attempt of the asked kinds).
    gone: tuple[tuple[str, bool], ...] = ()

    @classmethod
    def from_row(cls, row: Any) -> DutyFindings:
        """Build from the probe's one row."""
        gone = row[3]
        if isinstance(gone, str):
            gone = json.loads(gone)
        return cls(
            bool(row[0]),
            bool(row[1]),
            bool(row[2]),
            tuple((str(owner), bool(holds)) for owner, holds in gone or ()),
        )


@dataclass(frozen=True, slots=True)
class Batched:
    """What :meth:`AsyncStore.complete_and_claim` did in its one transaction."""

    #: (effect id, logged outcome) of each outcome written.
    logged: list[tuple[UUID, str]]
    claimed: list[ClaimedEffect]
    #: Of the leases asked to be extended, the ids still ours (now extended).
    kept: set[UUID] = dataclasses.field(default_factory=set)
    #: The duty probe's answer, when one was asked.
    findings: DutyFindings | None = None
    #: Why the outcomes were not written (None: they were). On Citus the claim
    #: runs beside the outcomes' statements and commits on its own: what it
    #: claimed is in ``claimed`` even when the outcomes failed.
    unwritten: BaseException | None = None
    #: Whether the heartbeat and the probe asked of it ran (on Citus a claim cut
    #: short after the outcomes leaves them to the daemon's own rounds).
    rode: bool = True


def _current_note(note: Any, attempt: int) -> Any:
    """A stored note counts only for the attempt that wrote it."""
    if isinstance(note, dict) and note.get("attempt") == attempt:
        return note
    return None
