"""Deciding about effects held by an approval gate: approve, reject, and deadlines.

An approval names the effect *and the digest of its payload* (the sha256 of the
canonical payload, ``Effect.payload_hash``): approving one payload can never
release another, even one written into the same row later. A decision is a
compare-and-set on ``awaiting_approval``, so each is taken once; every decision
and every refusal (a wrong digest, a second decision, a late one) is written to
the effect's attempt log with who and why, and so joins its hash chain.

A deadline that passed is acted on by whoever looks first: the delivery
daemon's sweep (:func:`expire_approvals`), or an approval that arrives late
(refused, and the gate's ``on_timeout`` applied in its place).

Every function takes a :class:`~outbox.storage.run_tx.RunTx` inside one
transaction; the sync client, its async twin and ``outbox serve`` share them.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

from outbox.errors import EffectNotFound, ReplayRefused, RunTerminal
from outbox.governance.gates import OnTimeout
from outbox.models import AttemptOutcome, EffectStatus
from outbox.payloads import content_hash, encode
from outbox.runs.stopping import advance_stopping_run, cancel_run
from outbox.storage.run_tx import RunTx

__all__ = ["ApprovalDecision", "decide", "expire_approvals", "payload_digest"]

log = logging.getLogger(__name__)

#: Who the attempt log names for a deadline acted on by a sweep.
DEADLINE_WORKER = "approval-deadline"


@dataclass(frozen=True)
class ApprovalDecision:
    """What a decision did: ``refusal`` is None when it was applied."""

    effect_id: uuid.UUID
    status: str
    refusal: str | None = None


def payload_digest(payload: Any) -> str:
    """The digest an approval names of a payload written before migration 0023.

    Since then a payload's digest is the sha256 of its text as PostgreSQL renders
    its ``jsonb`` (computed there, as it is written: ``payload_hash``); before, the
    sha256 of its canonical JSON.
    """
    return content_hash(encode(payload, field="payload", max_bytes=2**31))


def decide(
    tx: RunTx,
    effect_id: uuid.UUID,
    *,
    approve: bool,
    digest: str | None,
    note: str,
    by: str,
    via: str,
    request_id: str | None = None,
) -> ApprovalDecision:
    """Approve (or reject) one held effect; a refusal is logged and returned, never raised here.

    The caller commits, then raises :class:`~outbox.ApprovalRefused` for a
    refusal: what the refusal did (its log row, a deadline acted on) stays.
    """
    # A deadline passed may cancel the run, which locks the run's unstarted effects
    # and then the run: they are taken first here, before this one, in that order.
    run_id = tx.effect_run(effect_id)
    if run_id is not None:
        tx.lock_unstarted(run_id)
    row = tx.lock_effect(effect_id)
    if row is None:
        raise EffectNotFound(effect_id)
    if request_id is not None and not tx.mark_replay(request_id):
        raise ReplayRefused("request_id", request_id)
    decision = "approve" if approve else "reject"
    detail = {"decision": decision, "digest": digest, "note": note, "by": by, "via": via}

    def refuse(reason: str, status: str = row.status) -> ApprovalDecision:
        tx.log_effect_event(
            effect_id, by, AttemptOutcome.APPROVAL_REFUSED, {**detail, "reason": reason}
        )
        log.info("effect %s: %s refused: %s", effect_id, decision, reason)
        return ApprovalDecision(effect_id, status, reason)

    if row.status != EffectStatus.AWAITING_APPROVAL:
        return refuse(f"it is {row.status}, not awaiting approval (a decision is taken once)")
    if digest is not None and digest != row.payload_hash:
        return refuse(
            f"digest {digest[:16]}... names another payload (this one is {row.payload_hash})"
        )
    if row.payload_hash not in (row.payload_digest, payload_digest(row.payload)):
        return refuse("the stored payload no longer matches its recorded digest: it was altered")
    if row.due:
        status = _on_timeout(tx, row)
        return refuse(
            f"its approval deadline passed: on_timeout applied, it is now {status}", status
        )
    if approve:
        tx.approve_held(effect_id, by, detail)
        log.info("effect %s approved by %s", effect_id, by, extra={"effect_id": str(effect_id)})
        return ApprovalDecision(effect_id, EffectStatus.PENDING)
    tx.reject_held(effect_id, by, note, detail)
    log.info("effect %s rejected by %s", effect_id, by, extra={"effect_id": str(effect_id)})
    return ApprovalDecision(effect_id, EffectStatus.REJECTED)


def expire_approvals(tx: RunTx, max_rows: int = 100) -> dict[str, int]:
    """Apply ``on_timeout`` to held effects whose deadline passed; counts per action."""
    counts: dict[str, int] = {}
    for effect_id, run_id in tx.due_approvals(max_rows):
        if run_id is not None:  # in the order a cancel takes them (see decide)
            tx.lock_unstarted(run_id)
        row = tx.lock_effect(effect_id)
        if row is None or row.status != EffectStatus.AWAITING_APPROVAL or not row.due:
            continue
        status = _on_timeout(tx, row)
        counts[status] = counts.get(status, 0) + 1
    return counts


def _on_timeout(tx: RunTx, row: Any) -> str:
    """Act on a held effect whose deadline passed (the row is locked); returns its new status."""
    policy = row.approval or {}
    action = OnTimeout(policy.get("on_timeout") or OnTimeout.REJECT)
    detail = {
        "on_timeout": action.value,
        "gate": policy.get("gate"),
        "deadline": None if row.approval_deadline is None else row.approval_deadline.isoformat(),
    }
    context = {"effect_id": str(row.id), "run_id": str(row.run_id)}
    if action == OnTimeout.ESCALATE:
        detail["escalate_to"] = policy.get("escalate_to")
        tx.escalate_held(row.id, DEADLINE_WORKER, detail)
        log.warning(
            "effect %s: approval deadline passed; escalated to %s (it keeps waiting)",
            row.id,
            policy.get("escalate_to") or "nobody named",
            extra=context,
        )
        return EffectStatus.AWAITING_APPROVAL
    if action == OnTimeout.CANCEL_RUN and row.run_id is not None:
        tx.log_effect_event(row.id, DEADLINE_WORKER, AttemptOutcome.TIMED_OUT, detail)
        try:
            reason = f"approval deadline of effect {row.id} passed"
            cancel_run(tx, row.run_id, reason, by=DEADLINE_WORKER, via="gate")
            advance_stopping_run(tx, row.run_id)
        except RunTerminal:
            pass  # the run ended meanwhile: the effect is rejected below
        after = tx.lock_effect(row.id)
        if after is not None and after.status != EffectStatus.AWAITING_APPROVAL:
            log.warning("effect %s: approval deadline passed; run cancelled", row.id, extra=context)
            return str(after.status)
    note = "approval deadline passed"
    tx.reject_held(row.id, DEADLINE_WORKER, note, detail, outcome=AttemptOutcome.TIMED_OUT)
    log.warning("effect %s: approval deadline passed; rejected", row.id, extra=context)
    return EffectStatus.REJECTED
