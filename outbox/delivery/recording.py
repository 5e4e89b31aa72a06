"""Writing attempt outcomes: one statement per batch, and a poison outcome isolated to its row.

Outcomes are made storable before they get here (:mod:`outbox.delivery.storable`),
so a batch's completion statement should not fail on what it records. If it
still does, the error is read:

- **transient** (a lost connection, a deadlock, a server shutting down, a write
  that ran out of time): nothing is wrong with the batch; what was not written
  is handed back to be written again later;
- **anything else** (a value PostgreSQL refuses, a trigger that raises, a role
  without a privilege): the batch is split in halves until the failing rows
  stand alone, so every other outcome of the batch is recorded. A failing row
  is written again in a minimal form (:func:`substitute`); when even that fails
  (the role may not write outcomes at all) the row is *abandoned*: nothing is
  written, and the caller stops renewing its lease so that the reconciler
  resolves it when the lease runs out.

A write may carry the claim of the next batch (:class:`ClaimRider`): the first
statement of the batch then runs in one transaction with that claim, so a
steady stream of batches costs one commit each. The daemon's background
duties may ride along too (a renewal of held leases, the duty probe). If that
transaction fails for any reason, nothing of it stays, and the batch is written
as above without the claim (the daemon's take loop claims instead, and its
rounds do the duties).

A batch of ``n`` outcomes with ``k`` poison rows costs at most about
``2k·log2(n)`` extra statements; a batch that fails as a whole (a missing
privilege) costs ``2n - 1``, once.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from uuid import UUID

from outbox.delivery.seam import DeliveryStore
from outbox.delivery.storable import storable_text
from outbox.errors import DatabaseError
from outbox.models import AttemptOutcome, EffectStatus
from outbox.storage.attempts import (
    Batched,
    ClaimedEffect,
    Completion,
    DutyAsk,
    DutyFindings,
    OutcomesLeft,
)
from outbox.storage.sql.queue import EFFECT_QUEUE, Rate

__all__ = [
    "ClaimRider",
    "OutcomeWriter",
    "Ride",
    "Written",
    "is_transient",
    "one_per_effect",
    "substitute",
]

log = logging.getLogger(__name__)


def is_transient(exc: BaseException) -> bool:
    """True when the same write may well succeed later (nothing is wrong with what it writes)."""
    if isinstance(exc, DatabaseError):
        return exc.transient
    return isinstance(exc, TimeoutError | ConnectionError)


def describe(exc: BaseException) -> str:
    """One storable line naming a write's error (with its SQLSTATE when the server gave one)."""
    code = getattr(exc, "sqlstate", None)
    text = storable_text(f"{type(exc).__name__}: {exc}", max_bytes=1024)
    return f"{text} [SQLSTATE {code}]" if code else text


def substitute(completion: Completion, error: BaseException) -> Completion | None:
    """A minimal record of an attempt whose outcome could not be written (None: no call was made).

    It keeps no result and no detail from the deliverer, only our own words,
    so it fails only where nothing can be written at all.

    The status it records: ``failed`` when the deliverer reported ``failed``
    (the sink refused the effect; nothing is lost by ending it), otherwise
    ``unknown``. The call was made, so ``pending`` would send it again on an
    outcome we could not even store, and likely hit the same wall every
    attempt; ``succeeded`` would hand a run awaiting the effect a result it
    never got; ``failed`` would release its budget and tell compensation that
    nothing happened, when the sink may have applied it (a 5xx after applying,
    a success whose result is the poison). ``unknown`` holds the budget and any
    cancellation, is listed by ``outbox reconcile``, and is resolved by an
    operator who reads the error here (``--as retry`` redelivers with the same
    key). An attempt given back unstarted (``released``) made no call: it gets
    no substitute, and is abandoned to the reconciler instead.
    """
    if completion.outcome == AttemptOutcome.RELEASED:
        return None
    failed = completion.status == EffectStatus.FAILED
    status = EffectStatus.FAILED if failed else EffectStatus.UNKNOWN
    why = describe(error)
    note = (
        f"the outcome of attempt {completion.attempt} could not be recorded ({why}); "
        f"the deliverer reported {completion.status} ({completion.outcome})"
    )
    if not failed:
        note += ": the call was made, so an operator decides (outbox reconcile)"
    return Completion(
        completion.effect_id,
        completion.attempt,
        status,
        AttemptOutcome.FAILED if failed else AttemptOutcome.UNKNOWN,
        error=note,
        detail_json=json.dumps(
            {
                "unrecordable": why,
                "reported_status": str(completion.status),
                "reported_outcome": str(completion.outcome),
            }
        ),
        started_at=completion.started_at,
        shard=completion.shard,
    )


@dataclass
class Ride:
    """What one batch transaction carries besides its outcomes and claim."""

    #: (id, attempt) of the held leases to push out.
    extend: list[tuple[UUID, int]] = field(default_factory=list)
    #: The duty probe to run, if one is due.
    probe: DutyAsk | None = None
    #: When the transaction began (monotonic): its now() is no earlier.
    sent: float = 0.0


@dataclass(frozen=True)
class ClaimRider:
    """A claim to make in the same transaction as a batch's outcomes."""

    quotas: list[tuple[dict[str, str], int]]
    lease_seconds: float
    #: Declared rates by kind (see :meth:`AsyncStore.claim_many`).
    rates: Mapping[str, Rate] | None = None
    #: Held leases to push out in the same transaction (a heartbeat riding along).
    extend: list[tuple[UUID, int]] = field(default_factory=list)
    #: The duty probe to run in the same transaction, if one is due.
    probe: DutyAsk | None = None

    @property
    def has_duties(self) -> bool:
        """Whether background duties ride along."""
        return bool(self.extend) or self.probe is not None


@dataclass
class Written:
    """What one :meth:`OutcomeWriter.write` did with a batch."""

    #: Rows written: effect id -> the attempt-log outcome (``stale`` when fenced off).
    logged: dict[UUID, str] = field(default_factory=dict)
    #: Rows written in their minimal form instead: effect id -> why the full one failed.
    substituted: dict[UUID, str] = field(default_factory=dict)
    #: Rows nothing could be written for: effect id -> why.
    abandoned: dict[UUID, str] = field(default_factory=dict)
    #: Rows not written because a transient failure stopped the write (write them later).
    left: list[Completion] = field(default_factory=list)
    #: That transient failure.
    error: BaseException | None = None
    #: What the rider claimed (committed with the outcomes, or on Citus beside them:
    #: then even when they failed); empty when it did not ride.
    claimed: list[ClaimedEffect] = field(default_factory=list)
    #: Of the rider's ``extend``, the leases still ours (extended), when it rode.
    kept: set[UUID] = field(default_factory=set)
    #: The rider's duty probe's answer, when it rode with one.
    findings: DutyFindings | None = None
    #: The rider carried duties and its transaction failed.
    duties_failed: bool = False
    #: The duties offered to ride with the claim (None: none were).
    ride: Ride | None = None
    #: Whether they rode (False: on Citus a session lost after the outcomes left them
    #: to the daemon's own rounds; their answers are not in ``kept`` and ``findings``).
    rode: bool = True


class OutcomeWriter:
    """Writes batches of outcomes for ``owner``, isolating the rows a statement cannot take."""

    def __init__(self, store: DeliveryStore, owner: str) -> None:
        self.store = store
        self.owner = owner

    async def _complete(
        self, part: list[Completion], timeout: float | None
    ) -> list[tuple[UUID, str]]:
        if timeout is None:
            return await self.store.complete(self.owner, part)
        return await asyncio.wait_for(self.store.complete(self.owner, part), timeout)

    async def _complete_and_claim(
        self, part: list[Completion], rider: ClaimRider, timeout: float | None
    ) -> Batched:
        call = self.store.complete_and_claim(
            self.owner,
            part,
            EFFECT_QUEUE,
            rider.quotas,
            lease_seconds=rider.lease_seconds,
            rates=rider.rates,
            extend=rider.extend,
            probe=rider.probe,
        )
        return await (call if timeout is None else asyncio.wait_for(call, timeout))

    async def write(
        self,
        batch: list[Completion],
        *,
        timeout: float | None = None,
        rider: ClaimRider | None = None,
    ) -> Written:
        """Write ``batch``; each statement gets at most ``timeout`` seconds (None: no limit).

        With a ``rider``, the whole batch is first written together with its claim.
        """
        written = Written()
        if rider is not None and rider.quotas and batch:
            try:
                batched = await self._complete_and_claim(batch, rider, timeout)
                written.claimed = batched.claimed
                if batched.unwritten is not None:
                    raise batched.unwritten
                written.logged.update(batched.logged)
                written.kept, written.findings = batched.kept, batched.findings
                written.rode = batched.rode
                return written
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # not written: written again below, without the claim
                written.duties_failed = rider.has_duties
                if isinstance(exc, OutcomesLeft):  # (on Citus) the others' parts were written
                    written.logged.update(exc.logged)
                    batch = exc.left
                log.debug("outcomes with a claim failed (%s); writing them alone", describe(exc))
        # A stack: the next part to write is on top. On Citus a part per shard: a
        # node that is down leaves only its own. On one server the whole batch is
        # one statement, whatever shards its rows name (32 parts made a stream
        # deliverer's batch of 100 thirty writes).
        by_shard: dict[int | None, list[Completion]] = {}
        split = self.store.distributed
        for completion in batch:
            by_shard.setdefault(completion.shard if split else None, []).append(completion)
        parts = list(by_shard.values())[::-1]
        while parts:
            part = parts.pop()
            try:
                written.logged.update(await self._complete(part, timeout))
                continue
            except asyncio.CancelledError:
                raise
            except Exception as failure:
                cause: Exception = failure
                if isinstance(failure, OutcomesLeft):  # (on Citus) the others' parts were written
                    written.logged.update(failure.logged)
                    part, cause = failure.left, failure.error
                if is_transient(cause) and part[0].shard is not None:
                    # every row of a part is of one shard: its node's rows wait, the
                    # other shards' are written
                    written.left += part
                    written.error = cause
                    continue
                if is_transient(cause):
                    written.left = written.left + part + [c for p in reversed(parts) for c in p]
                    written.error = cause
                    return written
                if len(part) > 1:
                    middle = len(part) // 2
                    parts += [part[middle:], part[:middle]]
                    continue
                error: BaseException = cause
            # One row the statement cannot take: write it in its minimal form.
            poison = part[0]
            minimal = substitute(poison, error)
            if minimal is None:
                written.abandoned[poison.effect_id] = describe(error)
                continue
            try:
                written.logged.update(await self._complete([minimal], timeout))
                written.substituted[poison.effect_id] = describe(error)
                log.warning(
                    "the outcome of effect %s attempt %d could not be recorded (%s): "
                    "recorded as %s instead",
                    poison.effect_id,
                    poison.attempt,
                    describe(error),
                    minimal.status,
                    extra={"effect_id": str(poison.effect_id), "attempt": poison.attempt},
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if is_transient(exc):
                    written.left = [poison] + [c for p in reversed(parts) for c in p]
                    written.error = exc
                    return written
                written.abandoned[poison.effect_id] = describe(exc)
        return written


def one_per_effect(done: list[Completion]) -> tuple[list[Completion], list[Completion]]:
    """A batch naming each effect once, and the rest (written by the next batch).

    Two attempts of one effect (the first's lease lost, the effect claimed again
    here) may end together; a write reports outcomes by effect, so each goes in
    a batch of its own.
    """
    batch: list[Completion] = []
    later: list[Completion] = []
    seen: set[UUID] = set()
    for completion in done:
        (later if completion.effect_id in seen else batch).append(completion)
        seen.add(completion.effect_id)
    return batch, later
