"""An effect's row in the in-memory delivery store, and which rows a claim takes."""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from outbox.models import OPEN_EFFECT_STATUSES, EffectStatus
from outbox.storage.attempts import ClaimedEffect

__all__ = ["MemoryEffect", "ready_effects"]

_OPEN = frozenset(OPEN_EFFECT_STATUSES)


@dataclass
class MemoryEffect:
    """One effect's row, and its attempt log: ``(attempt, worker, outcome, detail)``."""

    id: UUID
    seq: int
    kind: str
    payload: Any
    idempotency_key: str
    status: str = EffectStatus.PENDING
    attempt: int = 0
    max_attempts: int | None = None
    schema_version: int = 1
    ordering_key: str | None = None
    priority: int = 0
    fairness_key: str = ""
    run_id: UUID | None = None
    created_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    #: monotonic seconds, as every deadline here
    available_at: float = 0.0
    lease_owner: str | None = None
    lease_expires_at: float | None = None
    attempt_started_at: datetime | None = None
    attempt_note: Any = None
    result: Any = None
    last_error: str | None = None
    log: list[tuple[int, str, str, Any]] = field(default_factory=list)

    def claimed(self) -> ClaimedEffect:
        """What a deliverer gets of it."""
        note = self.attempt_note
        return ClaimedEffect(
            id=self.id,
            run_id=self.run_id,
            kind=self.kind,
            payload=self.payload,
            idempotency_key=self.idempotency_key,
            attempt=self.attempt,
            max_attempts=self.max_attempts,
            schema_version=self.schema_version,
            ordering_key=self.ordering_key,
            created_at=self.created_at,
            attempt_started_at=self.attempt_started_at,
            lease_owner=self.lease_owner,
            attempt_note=note
            if isinstance(note, dict) and note.get("attempt") == self.attempt
            else None,
        )

    @property
    def outcomes(self) -> list[str]:
        """The outcome of every logged attempt, in order."""
        return [outcome for _, _, outcome, _ in self.log]


def ready_effects(
    effects: Iterable[MemoryEffect], kind: str, limit: int, now: float
) -> list[MemoryEffect]:
    """Up to ``limit`` ready effects of ``kind``: priority first, round-robin between fairness keys.

    Never the next effect of an ordering key while an earlier one is open.
    """
    rows = list(effects)
    blocked = {(e.ordering_key, e.seq) for e in rows if e.ordering_key and e.status in _OPEN}
    first_open: dict[str, int] = {}
    for key, seq in blocked:
        first_open[key] = min(seq, first_open.get(key, seq))
    lanes: dict[tuple[int, str], list[MemoryEffect]] = defaultdict(list)
    for e in sorted(rows, key=lambda e: (e.available_at, e.seq)):
        if e.kind != kind or e.status != EffectStatus.PENDING or e.available_at > now:
            continue
        if e.ordering_key and first_open.get(e.ordering_key, e.seq) < e.seq:
            continue
        lanes[(e.priority, e.fairness_key)].append(e)
    picked: list[MemoryEffect] = []
    for priority in sorted({p for p, _ in lanes}, reverse=True):
        queues = [q for (p, _), q in sorted(lanes.items()) if p == priority]
        for turn in itertools.zip_longest(*queues):
            picked += [e for e in turn if e is not None]
    return picked[: max(limit, 0)]
