"""Which offsets a stream deliverer may commit: never past a record whose fate is open.

A record read from Kafka is *open* from the moment it is read until its fate
is settled in PostgreSQL:

- a record whose claim has not succeeded yet (the claim statement failed, or
  has not run) stays open: committing past it could skip its effect;
- a record through which this process claimed its effect stays open until the
  effect's outcome is recorded;
- a copy of a record naming an effect this process holds (claimed through an
  earlier record, outcome not yet recorded) joins that claim: it closes when
  the outcome is recorded, not when the copy is skipped;
- any other record (finished already, claimed elsewhere, not an envelope) is
  closed once its claim says so.

A partition may be committed up to its oldest open record, or past everything
read when none is open. Offsets need not arrive in order: after a rebalance the
group hands a partition back from its committed offset, and a record read
twice is open twice (reference counts).

This module is pure bookkeeping (no Kafka, no database), so it is tested
exhaustively on its own (``tests/unit/test_stream_offsets.py``).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar
from uuid import UUID

__all__ = ["Offsets", "Read"]

P = TypeVar("P", bound=Hashable)


@dataclass(eq=False)
class _Partition:
    """One partition since it was (re)assigned: what was read, what is still open."""

    #: One past the highest offset read.
    next: int = 0
    #: Open offsets -> how many reads of that offset are open.
    open: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Read:
    """One record read and still open: where it is, and the effect it names."""

    part: _Partition
    offset: int
    effect_id: UUID


class Offsets(Generic[P]):
    """Open records per partition; :meth:`committable` never passes the oldest of them."""

    def __init__(self) -> None:
        self._parts: dict[P, _Partition] = {}
        #: Effects claimed here whose outcomes are not recorded -> the reads that wait on them.
        self._claims: dict[UUID, list[Read]] = {}

    def read(self, tp: P, offset: int, effect_id: UUID | None) -> Read | None:
        """A record was read: open until :meth:`decide` (None: it names no effect, never open)."""
        part = self._parts.get(tp)
        if part is None:
            part = self._parts[tp] = _Partition()
        if offset >= part.next:
            part.next = offset + 1
        if effect_id is None:
            return None
        part.open[offset] = part.open.get(offset, 0) + 1
        return Read(part, offset, effect_id)

    def decide(self, reads: Iterable[Read], claimed: set[UUID]) -> int:
        """The claim of ``reads`` took ``claimed``: each read waits on its claim or closes.

        Returns how many reads were skipped (their effect not claimed by this claim).
        """
        skipped = 0
        claims = self._claims
        for read in reads:
            if read.effect_id in claimed:
                claims.setdefault(read.effect_id, []).append(read)
                continue
            skipped += 1
            waiting = claims.get(read.effect_id)
            if waiting is not None:  # a copy of an effect held here: closes with it
                waiting.append(read)
            else:
                _close(read)
        return skipped

    def holds(self, effect_id: UUID) -> bool:
        """True while an effect claimed here has no recorded outcome."""
        return effect_id in self._claims

    def recorded(self, effect_id: UUID) -> None:
        """The outcome of ``effect_id`` is committed in PostgreSQL: its reads close."""
        for read in self._claims.pop(effect_id, ()):
            _close(read)

    def reset(self, tps: Iterable[P]) -> None:
        """A rebalance moved these partitions: start them afresh from what the group committed.

        Reads of the old assignment still waiting on claims close harmlessly
        when their outcomes are recorded; a record read again joins its claim.
        """
        for tp in tps:
            self._parts.pop(tp, None)

    def committable(self) -> dict[P, int]:
        """Per partition read, the offset a commit may name: its oldest open record, or ``next``."""
        return {tp: min(part.open, default=part.next) for tp, part in self._parts.items()}

    def __len__(self) -> int:
        """Open reads, all partitions together (bounded by what the daemon may hold)."""
        return sum(sum(part.open.values()) for part in self._parts.values())

    @property
    def claims(self) -> int:
        """Effects claimed here whose outcomes are not recorded."""
        return len(self._claims)


def _close(read: Read) -> None:
    refs = read.part.open.get(read.offset, 0)
    if refs > 1:
        read.part.open[read.offset] = refs - 1
    elif refs == 1:
        del read.part.open[read.offset]
