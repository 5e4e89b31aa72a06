"""One attempt at one effect: validate, call the deliverer, decide, and build the record.

Poll and stream mode both start attempts through :func:`perform_attempt`, so
payloads, outcomes and retries are treated the same way whatever the source.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from dataclasses import dataclass
from typing import Any

import pydantic

from outbox.delivery.contract import (
    AttemptNotes,
    Deliverer,
    Delivery,
    Failed,
    Outcome,
    PermanentError,
    Retry,
    RetryableError,
    Succeeded,
    Unknown,
    is_async,
)
from outbox.delivery.storable import MAX_DETAIL_BYTES, storable_json, storable_text
from outbox.faults import crash_point
from outbox.models import AttemptOutcome, EffectStatus
from outbox.retry import RetryPolicy
from outbox.storage.async_store import ClaimedEffect, Completion
from outbox.tracing import SpanHandle, current_traceparent, delivery_span

__all__ = [
    "MAX_DELAY_SECONDS",
    "RESULT_LIMIT",
    "Decision",
    "decide",
    "delivery_for",
    "perform_attempt",
    "record_of",
    "released",
]

log = logging.getLogger(__name__)

#: A sink's answer is recorded up to this size.
RESULT_LIMIT = 64 * 1024
#: The longest wait before a retry, whatever a sink or the policy asks: one
#: week. Longer answers are bounded here, not refused (a week is already far
#: past any real Retry-After), and a delay stays within PostgreSQL's interval range.
MAX_DELAY_SECONDS = 7 * 86400.0


@dataclass(frozen=True)
class Decision:
    """What to record: the new status, the delay before the next attempt, why."""

    status: EffectStatus
    outcome: AttemptOutcome
    delay: float = 0.0
    result: Any = None
    error: str | None = None
    detail: Any = None


def decide(
    outcome: Outcome,
    *,
    attempt: int,
    max_attempts: int,
    policy: RetryPolicy,
    rng: random.Random | None = None,
) -> Decision:
    """Turn a deliverer's outcome for attempt number ``attempt`` into a decision (pure)."""
    if isinstance(outcome, Succeeded):
        return Decision(
            EffectStatus.SUCCEEDED,
            AttemptOutcome.SUCCEEDED,
            result=outcome.result,
            detail=outcome.detail,
        )
    if isinstance(outcome, Failed):
        return Decision(
            EffectStatus.FAILED, AttemptOutcome.FAILED, error=outcome.reason, detail=outcome.detail
        )
    if isinstance(outcome, Unknown):
        return Decision(
            EffectStatus.UNKNOWN,
            AttemptOutcome.UNKNOWN,
            error=outcome.reason,
            detail=outcome.detail,
        )
    assert isinstance(outcome, Retry)
    if attempt >= max_attempts:
        return Decision(
            EffectStatus.FAILED,
            AttemptOutcome.RETRY,
            error=f"gave up after {attempt} attempts: {outcome.reason}",
            detail=outcome.detail,
        )
    delay = policy.backoff(attempt, rng)
    if outcome.after is not None:
        delay = max(delay, outcome.after)
    if not math.isfinite(delay) or delay > MAX_DELAY_SECONDS:
        delay = MAX_DELAY_SECONDS
    return Decision(
        EffectStatus.PENDING,
        AttemptOutcome.RETRY,
        delay=delay,
        error=outcome.reason,
        detail=outcome.detail,
    )


def delivery_for(
    effect: ClaimedEffect,
    payload: Any = None,
    notes: AttemptNotes | None = None,
    *,
    span: SpanHandle | None = None,
) -> Delivery:
    """What a deliverer sees of a claimed attempt (``payload`` parsed, else as stored).

    ``span``: the attempt's (:func:`~outbox.tracing.delivery_span`), whose context
    it sends on; without one, the span current here.
    """
    return Delivery(
        effect_id=effect.id,
        run_id=effect.run_id,
        kind=effect.kind,
        payload=effect.payload if payload is None else payload,
        idempotency_key=effect.idempotency_key,
        attempt=effect.attempt,
        schema_version=effect.schema_version,
        ordering_key=effect.ordering_key,
        created_at=effect.created_at,
        notes=notes,
        note=effect.attempt_note,
        traceparent=current_traceparent() if span is None else span.traceparent,
    )


def released(effect: ClaimedEffect, reason: str, *, delay: float = 0.0) -> Completion:
    """Give an attempt back unstarted: ``pending`` again, the reason in the log."""
    # the reason may quote a broker's or a sink's words
    return Completion.released(effect, storable_text(reason), delay=delay)


async def perform_attempt(
    deliverer: Deliverer,
    effect: ClaimedEffect,
    *,
    policy: RetryPolicy,
    default_max_attempts: int,
    schema_retry_seconds: float,
    notes: AttemptNotes | None = None,
) -> tuple[Completion, Outcome | None]:
    """Make the attempt ``effect`` stands for; return its record and the raw outcome.

    The outcome is ``None`` when no call was made (a payload schema version
    this deliverer does not know: the effect goes back to ``pending`` with a
    note, for a deliverer that does).
    """
    if effect.schema_version not in deliverer.schema_versions:
        note = (
            f"payload schema version {effect.schema_version} of kind {effect.kind!r} is not "
            f"understood by this deliverer (knows {sorted(deliverer.schema_versions)}); "
            "left pending for a deliverer that does"
        )
        log.warning(note, extra=_context(effect))
        return released(effect, note, delay=schema_retry_seconds), None
    with delivery_span(
        traceparent=effect.trace_parent,
        kind=effect.kind,
        key=effect.idempotency_key,
        attempt=effect.attempt,
        effect_id=effect.id,
        run_id=effect.run_id,
    ) as span:
        outcome = await _call(deliverer, effect, notes, span)
        crash_point("after_call", effect.kind, run=effect.run_id)
        max_attempts = effect.max_attempts or deliverer.max_attempts or default_max_attempts
        decision = decide(outcome, attempt=effect.attempt, max_attempts=max_attempts, policy=policy)
        span.outcome(
            decision.outcome.value,
            error=None if decision.status == EffectStatus.SUCCEEDED else decision.error,
        )
    completion = record_of(effect, decision)
    # A success is the common case and logs at DEBUG: at thousands of effects a
    # second, a line each would cost more than the delivery (and so would the
    # context of a line nobody writes).
    level = _LEVELS.get(decision.status, logging.INFO)
    if log.isEnabledFor(level):
        log.log(
            level,
            "effect %s attempt %d: %s%s",
            effect.id,
            effect.attempt,
            decision.outcome.value,
            f" ({completion.error})" if completion.error else "",
            extra=_context(effect),
        )
    return completion, outcome


_LEVELS = {EffectStatus.SUCCEEDED: logging.DEBUG, EffectStatus.FAILED: logging.WARNING}


def _context(effect: ClaimedEffect) -> dict[str, Any]:
    """The structured fields of an attempt's log lines."""
    return {
        "effect_id": str(effect.id),
        "run_id": str(effect.run_id),
        "attempt": effect.attempt,
        "key": effect.idempotency_key,
        "kind": effect.kind,
    }


def record_of(effect: ClaimedEffect, decision: Decision) -> Completion:
    """The completion to write for ``decision``: every part made storable (see :mod:`.storable`).

    Whatever the deliverer put in its outcome (a NUL-laden error page, a lone
    surrogate, ``NaN``, megabytes) is escaped and capped here, so one outcome
    cannot fail the statement that records its whole batch.
    """
    error = None if decision.error is None else storable_text(decision.error)
    return Completion(
        effect.id,
        effect.attempt,
        decision.status,
        decision.outcome,
        result_json=storable_json(decision.result, max_bytes=RESULT_LIMIT),
        error=error,
        delay=decision.delay,
        detail_json=_attempt_detail(error, decision.detail),
        started_at=effect.started_iso,
        shard=effect.shard,
    )


async def _call(
    deliverer: Deliverer,
    effect: ClaimedEffect,
    notes: AttemptNotes | None,
    span: SpanHandle,
) -> Outcome:
    try:
        payload = deliverer.parse_payload(effect.payload)
    except pydantic.ValidationError as exc:
        return Failed(
            f"payload does not match the schema of kind {effect.kind!r}: {_pydantic_summary(exc)}"
        )
    delivery = delivery_for(effect, payload, notes, span=span)
    try:
        if is_async(deliverer.deliver):
            outcome = await deliverer.deliver(delivery)  # type: ignore[misc]
        else:
            outcome = await asyncio.to_thread(deliverer.deliver, delivery)
    except RetryableError as exc:
        return Retry(storable_text(exc), after=exc.retry_after, rate_limited=exc.rate_limited)
    except PermanentError as exc:
        return Failed(storable_text(exc))
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        # storable_text: the message may hold anything, and its __str__ may even raise
        reason = f"{type(exc).__name__}: {storable_text(exc)}"
        log.warning("deliverer raised %s", reason, extra=_context(effect))
        return Retry(reason)
    if not isinstance(outcome, Succeeded | Retry | Failed | Unknown):
        return Failed(f"deliverer returned {type(outcome).__name__}, not an outcome")
    return outcome


def _attempt_detail(error: str | None, detail: Any) -> str | None:
    """What the attempt log keeps: the reason, and what the sink said (status, body excerpt)."""
    if error is None and detail is None:
        return None
    entry: dict[str, Any] = dict(detail) if isinstance(detail, dict) else {}
    if detail is not None and not isinstance(detail, dict):
        entry["info"] = detail
    if error is not None:
        entry["error"] = error
    return storable_json(entry, max_bytes=MAX_DETAIL_BYTES)


def _pydantic_summary(exc: pydantic.ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err["loc"]) or "payload"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)
