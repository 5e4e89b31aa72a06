"""One attempt at one effect: validate, call the deliverer, decide, and build the record.

Poll and stream mode both start attempts through :func:`perform_attempt`, so
payloads, outcomes and retries are treated the same way whatever the source.
"""

from __future__ import annotations

import asyncio
import json
import logging
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
from outbox.faults import crash_point
from outbox.models import AttemptOutcome, EffectStatus
from outbox.payloads import encode
from outbox.retry import RetryPolicy
from outbox.storage.async_store import ClaimedEffect, Completion

__all__ = ["RESULT_LIMIT", "Decision", "decide", "delivery_for", "perform_attempt", "released"]

log = logging.getLogger(__name__)

#: A sink's answer is recorded up to this size.
RESULT_LIMIT = 64 * 1024


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
    return Decision(
        EffectStatus.PENDING,
        AttemptOutcome.RETRY,
        delay=delay,
        error=outcome.reason,
        detail=outcome.detail,
    )


def delivery_for(
    effect: ClaimedEffect, payload: Any = None, notes: AttemptNotes | None = None
) -> Delivery:
    """What a deliverer sees of a claimed attempt (``payload`` parsed, else as stored)."""
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
    )


def released(effect: ClaimedEffect, reason: str, *, delay: float = 0.0) -> Completion:
    """Give an attempt back unstarted: ``pending`` again, the reason in the log."""
    return Completion(
        effect.id,
        effect.attempt,
        EffectStatus.PENDING,
        AttemptOutcome.RELEASED,
        error=reason,
        delay=delay,
        started_at=effect.started_iso,
    )


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
    context = {
        "effect_id": str(effect.id),
        "run_id": str(effect.run_id),
        "attempt": effect.attempt,
        "key": effect.idempotency_key,
        "kind": effect.kind,
    }
    if effect.schema_version not in deliverer.schema_versions:
        note = (
            f"payload schema version {effect.schema_version} of kind {effect.kind!r} is not "
            f"understood by this deliverer (knows {sorted(deliverer.schema_versions)}); "
            "left pending for a deliverer that does"
        )
        log.warning(note, extra=context)
        return released(effect, note, delay=schema_retry_seconds), None
    outcome = await _call(deliverer, effect, context, notes)
    crash_point("after_call")
    max_attempts = effect.max_attempts or deliverer.max_attempts or default_max_attempts
    decision = decide(outcome, attempt=effect.attempt, max_attempts=max_attempts, policy=policy)
    try:
        result_json = (
            None
            if decision.result is None
            else encode(decision.result, field="result", max_bytes=RESULT_LIMIT)
        )
    except Exception as exc:
        result_json = json.dumps({"unrecordable_result": str(exc)[:500]})
    # A success is the common case and logs at DEBUG: at thousands of effects a
    # second, a line each would cost more than the delivery.
    level = {
        EffectStatus.SUCCEEDED: logging.DEBUG,
        EffectStatus.FAILED: logging.WARNING,
    }.get(decision.status, logging.INFO)
    log.log(
        level,
        "effect %s attempt %d: %s%s",
        effect.id,
        effect.attempt,
        decision.outcome.value,
        f" ({decision.error})" if decision.error else "",
        extra=context,
    )
    completion = Completion(
        effect.id,
        effect.attempt,
        decision.status,
        decision.outcome,
        result_json=result_json,
        error=decision.error,
        delay=decision.delay,
        detail_json=_attempt_detail(decision.error, decision.detail),
        started_at=effect.started_iso,
    )
    return completion, outcome


async def _call(
    deliverer: Deliverer,
    effect: ClaimedEffect,
    context: dict[str, Any],
    notes: AttemptNotes | None,
) -> Outcome:
    try:
        payload = deliverer.parse_payload(effect.payload)
    except pydantic.ValidationError as exc:
        return Failed(
            f"payload does not match the schema of kind {effect.kind!r}: {_pydantic_summary(exc)}"
        )
    delivery = delivery_for(effect, payload, notes)
    try:
        if is_async(deliverer.deliver):
            outcome = await deliverer.deliver(delivery)  # type: ignore[misc]
        else:
            outcome = await asyncio.to_thread(deliverer.deliver, delivery)
    except RetryableError as exc:
        return Retry(str(exc), after=exc.retry_after, rate_limited=exc.rate_limited)
    except PermanentError as exc:
        return Failed(str(exc))
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.warning("deliverer raised %s: %s", type(exc).__name__, exc, extra=context)
        return Retry(f"{type(exc).__name__}: {exc}")
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
    return json.dumps(entry, default=str)


def _pydantic_summary(exc: pydantic.ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err["loc"]) or "payload"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)
