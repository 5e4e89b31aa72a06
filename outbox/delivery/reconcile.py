"""The reconciler: resolves attempts that started but never recorded an end.

An in-flight effect whose lease expired belongs to a deliverer that died or
stalled mid-call. Whether the outside world saw the call is unknown, so each
one is resolved by what its deliverer declares (DESIGN.md, "Sinks that are not
idempotent"):

- idempotent sink: back to ``pending`` with the same key (a redelivery is a no-op
  at the sink if the first call landed);
- the deliverer offers ``lookup``: ask the sink, then record ``succeeded`` or put
  it back to ``pending``; when the sink cannot be asked (the lookup raised or
  timed out), ``unknown``, asked again later with a growing pause
  (:class:`LookupBackoff`) so that a sink that cannot answer never stalls
  the reconciler;
- neither: ``unknown``, shown by ``outbox reconcile`` until an operator resolves it.

Every change is a compare-and-set on (status, attempt, lease expired), so two
reconcilers, or a reconciler racing a late completion, never both win.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from outbox.delivery.attempt import RESULT_LIMIT, delivery_for
from outbox.delivery.contract import Deliverer, Delivery, NotApplied, Succeeded, is_async
from outbox.delivery.seam import DeliveryStore
from outbox.delivery.storable import storable_json, storable_text
from outbox.ids import RELAY_OWNER_PREFIX
from outbox.models import REDISPATCH, AttemptOutcome, EffectStatus
from outbox.storage.attempts import ClaimedEffect, Completion

__all__ = ["LookupBackoff", "ReconcileItem", "ReconcileReport", "reconcile"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReconcileItem:
    """What happened (or, in a dry run, would happen) to one expired attempt."""

    effect_id: UUID
    kind: str
    attempt: int
    action: str
    note: str = ""


@dataclass
class ReconcileReport:
    """Every item, and counts per action."""

    items: list[ReconcileItem] = field(default_factory=list)
    dry_run: bool = False

    @property
    def counts(self) -> dict[str, int]:
        """Items per action."""
        return dict(Counter(item.action for item in self.items))

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "dry_run": self.dry_run,
            "counts": self.counts,
            "items": [
                {
                    "effect_id": str(i.effect_id),
                    "kind": i.kind,
                    "attempt": i.attempt,
                    "action": i.action,
                    "note": i.note,
                }
                for i in self.items
            ],
        }


class LookupBackoff:
    """When an effect whose lookup failed may be asked again (one reconciling process).

    A lookup can fail for as long as its sink is down, and one can take long
    (a Kafka read-back scans up to its timeout): asking every ``unknown``
    effect at every round would stall the reconciler behind them. Each failure
    doubles the pause before the next question, from ``floor`` up to ``ceiling``;
    an answer forgets the effect.
    """

    def __init__(self, floor: float = 1.0, ceiling: float = 300.0) -> None:
        self.floor = floor
        self.ceiling = ceiling
        #: effect id -> (failed lookups in a row, monotonic time it may be asked again)
        self._failed: dict[UUID, tuple[int, float]] = {}

    def due(self, effect_id: UUID) -> bool:
        """True when this effect's sink may be asked now."""
        entry = self._failed.get(effect_id)
        return entry is None or time.monotonic() >= entry[1]

    def failed(self, effect_id: UUID) -> float:
        """Note a failed lookup; return the pause before the next one."""
        count = self._failed.get(effect_id, (0, 0.0))[0] + 1
        pause = min(self.ceiling, math.ldexp(self.floor, min(count - 1, 60)))
        self._failed[effect_id] = (count, time.monotonic() + pause)
        return pause

    def forget(self, keep: set[UUID] | None = None) -> None:
        """Forget every effect (or every one not in ``keep``: settled by someone else)."""
        self._failed = {k: v for k, v in self._failed.items() if keep is not None and k in keep}


def _relay_held(row: ClaimedEffect) -> bool:
    return (row.lease_owner or "").startswith(RELAY_OWNER_PREFIX)


async def _lookup(deliverer: Deliverer, delivery: Delivery) -> Any:
    if is_async(deliverer.lookup):
        return await deliverer.lookup(delivery)
    return await asyncio.to_thread(deliverer.lookup, delivery)


async def reconcile(
    store: DeliveryStore,
    deliverers: Mapping[str, Deliverer],
    *,
    worker: str,
    dry_run: bool = False,
    max_rows: int = 1000,
    lease_seconds: float = 30.0,
    default_max_attempts: int = 10,
    report_skipped: bool = True,
    lookups: LookupBackoff | None = None,
) -> ReconcileReport:
    """Resolve every expired in-flight effect (up to ``max_rows``); report what was done.

    An expired attempt of a kind none of ``deliverers`` knows is left to a
    process that knows it (reported as ``skipped`` unless ``report_skipped`` is
    false), except one a Kafka relay held: publishing again needs no deliverer.
    ``lookups`` paces the questions to sinks that could not answer (a daemon
    keeps one across rounds; without it each call asks once).
    """
    report = ReconcileReport(dry_run=dry_run)
    lookups = lookups or LookupBackoff()
    redispatched, expired = await store.expired(max_rows, redispatch_as=None if dry_run else worker)
    if redispatched:
        log.info("%d dispatched effects were not delivered in time: re-dispatching", redispatched)
    for row in expired:
        if not report_skipped and row.kind not in deliverers and not _relay_held(row):
            continue
        item = await _resolve(
            store,
            deliverers,
            row,
            worker=worker,
            dry_run=dry_run,
            lease_seconds=lease_seconds,
            default_max_attempts=default_max_attempts,
            lookups=lookups,
        )
        if item is not None:
            report.items.append(item)
            log.info(
                "reconciled effect %s: %s",
                item.effect_id,
                item.action,
                extra={
                    "effect_id": str(item.effect_id),
                    "attempt": item.attempt,
                    "key": row.idempotency_key,
                    "run_id": str(row.run_id),
                },
            )
    # Effects left ``unknown`` by an ambiguous answer (a timeout after the request
    # was sent) are settled the same way when their sink can be asked; so are those
    # of idempotent kinds a cancel left unknown (a lost attempt may have happened).
    askable = [k for k, d in deliverers.items() if d.has_lookup]
    unknown = await store.unknown_of(askable, max_rows)
    lookups.forget(keep={row.id for row in unknown})
    for row in unknown:
        deliverer = deliverers[row.kind]
        why = f"attempt {row.attempt} ended unknown"
        if dry_run:
            item = ReconcileItem(row.id, row.kind, row.attempt, "lookup", f"{why}; would ask")
            report.items.append(item)
            continue
        if not lookups.due(row.id):
            continue
        max_attempts = row.max_attempts or deliverer.max_attempts or default_max_attempts
        item = await _ask(store, deliverer, row, worker=worker, why=why, max_attempts=max_attempts)
        if item.action == "lookup_failed":
            lookups.failed(row.id)
        report.items.append(item)
    return report


async def _ask(
    store: DeliveryStore,
    deliverer: Deliverer,
    row: ClaimedEffect,
    *,
    worker: str,
    why: str,
    max_attempts: int,
) -> ReconcileItem:
    """Ask the sink whether the key was applied, before any resend; log the answer."""
    effect_id, attempt, kind = row.id, row.attempt, row.kind

    def item(action: str, note: str = "") -> ReconcileItem:
        return ReconcileItem(effect_id, kind, attempt, action, note)

    try:
        answer = await _lookup(deliverer, delivery_for(await store.with_payload(row)))
    except Exception as exc:  # the lease runs out again and the next round retries
        reason = f"{type(exc).__name__}: {storable_text(exc)}"
        log.warning("lookup of effect %s failed: %s", effect_id, reason)
        return item("lookup_failed", reason)
    if isinstance(answer, Succeeded):
        completion = Completion(
            effect_id,
            attempt,
            EffectStatus.SUCCEEDED,
            AttemptOutcome.LOOKED_UP,
            # a sink's answer, like a delivery's: made storable before it reaches SQL
            result_json=storable_json(answer.result, max_bytes=RESULT_LIMIT),
            detail_json=json.dumps({"lookup": "applied", "asked": "before any resend"}),
            shard=row.shard,
        )
        action, note = "looked_up_succeeded", f"{why}; the sink has the key: succeeded"
    elif isinstance(answer, NotApplied):
        give_up = attempt >= max_attempts
        status = EffectStatus.FAILED if give_up else EffectStatus.PENDING
        completion = Completion(
            effect_id,
            attempt,
            status,
            AttemptOutcome.LOOKED_UP,
            error=f"{why}; the sink has no trace of the key"
            + (f"; gave up after {attempt} attempts" if give_up else ""),
            detail_json=json.dumps({"lookup": "not_applied", "asked": "before any resend"}),
            shard=row.shard,
        )
        action = "looked_up_failed" if give_up else "looked_up_redeliver"
        note = f"{why}; the sink has no trace: " + ("giving up" if give_up else "redelivering")
    else:
        return item("lookup_failed", f"lookup returned {answer!r}")
    logged = dict(await store.complete(worker, [completion]))
    if logged.get(effect_id) == AttemptOutcome.STALE:
        return item("stale", f"{why}; it changed meanwhile: the answer was logged, nothing else")
    return item(action, note)


async def _resolve(
    store: DeliveryStore,
    deliverers: Mapping[str, Deliverer],
    row: ClaimedEffect,
    *,
    worker: str,
    dry_run: bool,
    lease_seconds: float,
    default_max_attempts: int,
    lookups: LookupBackoff,
) -> ReconcileItem | None:
    effect_id, attempt, kind = row.id, row.attempt, row.kind

    def item(action: str, note: str = "") -> ReconcileItem:
        return ReconcileItem(effect_id, kind, attempt, action, note)

    lost = f"attempt {attempt} was lost (lease expired without a recorded outcome)"
    if _relay_held(row):
        # A relay only publishes to Kafka; a stream deliverer dedups by the effect's
        # state, so publishing again is always safe.
        note = f"{lost} by the Kafka relay; dispatching again"
        if dry_run:
            return item("redeliver", note)
        done = await store.expire(
            effect_id,
            attempt,
            new_status="pending",
            note=note,
            # no sink was called: unlike a deliverer's lost attempt, this leaves no
            # doubt that a cancel or a fork must keep (sql/attempt_log.py)
            resolution=REDISPATCH,
            worker=worker,
            shard=row.shard,
        )
        return item("redeliver", note) if done else None
    deliverer = deliverers.get(kind)
    if deliverer is None:
        return item("skipped", f"no deliverer for kind {kind!r} in this process")
    max_attempts = row.max_attempts or deliverer.max_attempts or default_max_attempts

    if deliverer.idempotent:
        if attempt >= max_attempts:
            action, status = "failed", "failed"
            note = f"{lost}; gave up after {attempt} attempts"
        else:
            action, status, note = "redeliver", "pending", f"{lost}; redelivering with the same key"
        if dry_run:
            return item(action, note)
        done = await store.expire(
            effect_id,
            attempt,
            new_status=status,
            note=note,
            resolution=action,
            worker=worker,
            shard=row.shard,
        )
        return item(action, note) if done else None

    if deliverer.has_lookup:
        if dry_run:
            return item("lookup", f"{lost}; would ask the sink about the key")
        if not await store.take_over(
            effect_id, attempt, owner=worker, lease_seconds=lease_seconds, shard=row.shard
        ):
            return None
        asked = await _ask(
            store, deliverer, row, worker=worker, why=lost, max_attempts=max_attempts
        )
        if asked.action != "lookup_failed":
            return asked
        # Not left in flight under our lease (re-taken and asked again at every
        # expiry, out of an operator's sight): unknown, asked again with a pause.
        pause = lookups.failed(effect_id)
        note = (
            f"{lost}; the sink could not be asked ({asked.note}): unknown until it answers "
            f"(asked again in {pause:.0f} s and less often after) or an operator resolves it"
        )
        unknown = Completion(
            effect_id,
            attempt,
            EffectStatus.UNKNOWN,
            AttemptOutcome.UNKNOWN,
            error=storable_text(note),
            detail_json=json.dumps({"lookup": "failed", "error": storable_text(asked.note)}),
            shard=row.shard,
        )
        logged = dict(await store.complete(worker, [unknown]))
        if logged.get(effect_id) == AttemptOutcome.STALE:
            return item("stale", f"{lost}; it changed meanwhile")
        return item("unknown", note)

    note = f"{lost}; the sink cannot dedup or be asked: an operator must resolve it"
    if dry_run:
        return item("unknown", note)
    done = await store.expire(
        effect_id,
        attempt,
        new_status="unknown",
        note=note,
        resolution="unknown",
        worker=worker,
        shard=row.shard,
    )
    return item("unknown", note) if done else None
