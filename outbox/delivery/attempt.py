"""One attempt at one effect: validate, call the deliverer, decide, and build the record.

Shared by the poll daemon (:mod:`outbox.delivery.daemon`) and the Kafka stream
deliverer, so both treat payloads, outcomes and retries the same way.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pydantic

from outbox.delivery import (
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
from outbox.payloads import encode
from outbox.retry import RetryPolicy, decide
from outbox.storage.async_store import Completion

__all__ = ["RESULT_LIMIT", "perform_attempt"]

log = logging.getLogger(__name__)

#: A sink's answer is recorded up to this size.
RESULT_LIMIT = 64 * 1024


async def perform_attempt(
    deliverer: Deliverer,
    row: Any,
    *,
    policy: RetryPolicy,
    default_max_attempts: int,
    schema_retry_seconds: float,
) -> tuple[Completion, Outcome | None]:
    """Make the attempt the claimed ``row`` stands for; return its record and the raw outcome.

    The outcome is ``None`` when no call was made (a payload schema version
    this deliverer does not know: the effect goes back to ``pending`` with a
    note, for a deliverer that does).
    """
    effect_id, attempt, kind = row["id"], row["attempt"], row["kind"]
    started = row["attempt_started_at"]
    started_iso = started.isoformat() if started else None
    context = {
        "effect_id": str(effect_id),
        "run_id": str(row["run_id"]),
        "attempt": attempt,
        "key": row["idempotency_key"],
        "kind": kind,
    }
    if row["schema_version"] not in deliverer.schema_versions:
        note = (
            f"payload schema version {row['schema_version']} of kind {kind!r} is not "
            f"understood by this deliverer (knows {sorted(deliverer.schema_versions)}); "
            "left pending for a deliverer that does"
        )
        log.warning(note, extra=context)
        return Completion(
            effect_id,
            attempt,
            "pending",
            "released",
            error=note,
            delay=schema_retry_seconds,
            started_at=started_iso,
        ), None
    outcome = await _call(deliverer, row, context)
    crash_point("after_call")
    max_attempts = row["max_attempts"] or deliverer.max_attempts or default_max_attempts
    decision = decide(outcome, attempt=attempt, max_attempts=max_attempts, policy=policy)
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
    level = {"succeeded": logging.DEBUG, "failed": logging.WARNING}.get(
        decision.status, logging.INFO
    )
    log.log(
        level,
        "effect %s attempt %d: %s%s",
        effect_id,
        attempt,
        decision.outcome,
        f" ({decision.error})" if decision.error else "",
        extra=context,
    )
    completion = Completion(
        effect_id,
        attempt,
        decision.status,
        decision.outcome,
        result_json=result_json,
        error=decision.error,
        delay=decision.delay,
        detail_json=_attempt_detail(decision.error, decision.detail),
        started_at=started_iso,
    )
    return completion, outcome


async def _call(deliverer: Deliverer, row: Any, context: dict[str, Any]) -> Outcome:
    try:
        payload = deliverer.parse_payload(row["payload"])
    except pydantic.ValidationError as exc:
        return Failed(
            f"payload does not match the schema of kind {row['kind']!r}: {_pydantic_summary(exc)}"
        )
    delivery = Delivery(
        effect_id=row["id"],
        run_id=row["run_id"],
        kind=row["kind"],
        payload=payload,
        idempotency_key=row["idempotency_key"],
        attempt=row["attempt"],
        schema_version=row["schema_version"],
        ordering_key=row["ordering_key"],
        created_at=row["created_at"],
    )
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
