"""What the sync and async clients share: their arguments checked and the rows they build.

``Outbox`` and ``AsyncOutbox`` differ only in how they wait; everything a
call checks or derives before it reaches the store lives here once.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from outbox.blobs import store_value
from outbox.errors import (
    ApprovalRefused,
    ReplayRefused,
    RunStateError,
    ValidationError,
)
from outbox.ids import uuid7
from outbox.intent_rules import MAX_KEY_LENGTH
from outbox.models import (
    Effect,
    EffectStatus,
    RunMode,
    RunRecord,
    RunStart,
    RunStatus,
)
from outbox.payloads import Encoded, encode, encode_value
from outbox.runs.approvals import ApprovalDecision, decide
from outbox.runs.signals import SignalReceipt, send_signal
from outbox.settings import Settings
from outbox.shards import key_shard, on_shard, shard_of
from outbox.storage.run_tx import RunTx
from outbox.storage.writes import RunStart as RunStartRow
from outbox.validation import as_uuid, name_field, row_limit, validated

__all__ = [
    "NewRun",
    "approval_decider",
    "cancel_args",
    "connect_settings",
    "diff_args",
    "effect_filters",
    "fork_args",
    "new_run",
    "not_changed",
    "reason_args",
    "refused",
    "resolve_params",
    "retry_params",
    "run_args",
    "run_filters",
    "signal_sender",
    "started_run",
]


def connect_settings(
    dsn: str | None, settings: Settings | None, overrides: dict[str, Any]
) -> Settings:
    """The settings ``connect(dsn, settings=..., **overrides)`` means (both twins)."""
    if settings is None:
        return Settings.from_env(dsn=dsn, **overrides)
    if dsn is not None or overrides:
        return settings.model_copy(update={"dsn": dsn or settings.dsn, **overrides})
    return settings


@dataclass(frozen=True)
class NewRun:
    """A validated new run: what ``outbox_begin_run`` takes, and its inputs encoded."""

    start: RunStartRow
    inputs: Encoded


def new_run(
    settings: Settings,
    agent: str,
    version: str,
    inputs: Any,
    *,
    budget: float | None,
    run_id: uuid.UUID | str | None,
    key: str | None = None,
    on_conflict: str = "return_existing",
    priority: int = 0,
    fairness_key: str = "",
    mode: str = "live",
) -> NewRun:
    """The validated row of a new run (``start_run`` in both twins)."""
    start = validated(
        RunStart,
        agent=agent,
        version=version,
        inputs=inputs,
        budget=budget,
        key=key,
        on_conflict=on_conflict,
        priority=priority,
        fairness_key=fairness_key,
        mode=mode,
    )
    encoded = encode_value(start.inputs, field="inputs", max_bytes=settings.max_payload_bytes)
    if run_id is not None:
        chosen = as_uuid(run_id, "run_id")
    elif start.key is not None:  # on its key's shard: the start touches one shard
        chosen = on_shard(uuid7(), key_shard(settings.namespace, start.key))
    else:
        chosen = uuid7()
    row = RunStartRow(
        id=chosen,
        namespace=settings.namespace,
        agent=start.agent,
        version=start.version,
        inputs_json=encoded.json,
        budget=None if start.budget is None else Decimal(str(start.budget)),
        key=start.key,
        priority=start.priority,
        fairness_key=start.fairness_key,
        dry_run=start.mode == RunMode.DRY_RUN,
        on_conflict=start.on_conflict.value,
    )
    return NewRun(row, encoded)


def started_run(new: NewRun, record: RunRecord, created: bool) -> RunRecord:
    """The run ``start_run`` returns, with its inputs as given (a large one is stored apart)."""
    if created:
        return record.model_copy(update={"inputs": new.inputs.value()})
    return record


def run_args(run_id: uuid.UUID | str, step_id: str | None) -> uuid.UUID:
    """Validated arguments of ``run()`` (both twins); returns the run id."""
    rid = as_uuid(run_id, "run_id")
    if step_id is not None:
        name_field(step_id, "step_id", max_length=MAX_KEY_LENGTH)
    return rid


def effect_filters(
    *,
    run_id: uuid.UUID | str | None,
    status: str | None,
    kind: str | None,
    limit: int,
    step_id: str | None = None,
) -> dict[str, Any]:
    """Validated filters of ``effects()``."""
    if status is not None and status not in EffectStatus.__members__.values():
        raise ValidationError("status", status, f"not one of {[s.value for s in EffectStatus]}")
    if kind is not None:
        name_field(kind, "kind")
    rid = None if run_id is None else as_uuid(run_id, "run_id")
    filters: dict[str, Any] = {"run_id": rid, "status": status, "kind": kind}
    if step_id is not None:
        # A step id means something only within its run (and the run's index finds it).
        if rid is None:
            raise ValidationError("step_id", step_id, "filter by run_id too")
        filters["step_id"] = name_field(step_id, "step_id", max_length=MAX_KEY_LENGTH)
    return {**filters, "limit": row_limit(limit)}


def run_filters(*, status: str | None, agent: str | None, limit: int) -> dict[str, Any]:
    """Validated filters of ``runs()``."""
    if status is not None and status not in RunStatus.__members__.values():
        raise ValidationError("status", status, f"not one of {[s.value for s in RunStatus]}")
    if agent is not None:
        name_field(agent, "agent")
    return {"status": status, "agent": agent, "limit": row_limit(limit)}


def resolve_params(*, outcome: str, note: str, operator: str) -> dict[str, Any]:
    """Validated parameters of an operator's ``resolve`` (all but the effect id)."""
    choices = {"succeeded": "succeeded", "failed": "failed", "retry": "pending"}
    if outcome not in choices:
        raise ValidationError("outcome", outcome, f"must be one of {sorted(choices)}")
    if not note.strip():
        raise ValidationError("note", note, "say why (it is kept in the attempt log)")
    detail = encode({"as": outcome, "note": note, "by": operator}, field="note")
    return {"new_status": choices[outcome], "operator": operator, "detail": detail}


def retry_params(*, extra_attempts: int, operator: str, note: str | None = None) -> dict[str, Any]:
    """Validated parameters of an operator's ``retry`` (all but the effect id)."""
    if extra_attempts < 1:
        raise ValidationError("extra_attempts", extra_attempts, "must be at least 1")
    if note is not None and not note.strip():
        raise ValidationError("note", note, "say why, or leave the note out")
    entry: dict[str, Any] = {"extra_attempts": extra_attempts, "by": operator}
    if note is not None:
        entry["note"] = note
    detail = encode(entry, field="detail")
    return {"extra_attempts": extra_attempts, "operator": operator, "detail": detail}


def not_changed(effect: Effect, which: str) -> RunStateError:
    """Why an operator's compare-and-set changed nothing."""
    if which == "resolve":
        return RunStateError(
            f"effect_id={str(effect.id)!r} is {effect.status.value}, not unknown: "
            "only unknown effects are resolved"
        )
    return RunStateError(
        f"effect_id={str(effect.id)!r} is {effect.status.value}, not failed: "
        "only failed effects are retried (resolve unknown ones)"
    )


def diff_args(run_a: uuid.UUID | str, run_b: uuid.UUID | str) -> tuple[uuid.UUID, uuid.UUID]:
    """Validated run ids of ``diff_runs`` (both twins)."""
    return as_uuid(run_a, "run_a"), as_uuid(run_b, "run_b")


def approval_decider(
    effect_id: uuid.UUID | str,
    *,
    approve: bool,
    digest: str | None,
    note: str,
    by: str,
    via: str,
    request_id: str | None = None,
) -> Callable[[RunTx], ApprovalDecision]:
    """Validate an approval or rejection; return what decides it in a run transaction."""
    eid = as_uuid(effect_id, "effect_id")
    if approve and digest is None:
        raise ValidationError(
            "digest", digest, "an approval names the digest of the payload it approves"
        )
    if digest is not None and (
        not isinstance(digest, str) or re.fullmatch(r"[0-9a-f]{64}", digest) is None
    ):
        raise ValidationError("digest", digest, "must be 64 lowercase hex characters (sha256)")
    if not isinstance(note, str) or not note.strip():
        raise ValidationError("note", note, "say why (it is kept in the attempt log)")
    name_field(note, "note", max_length=2000)
    name_field(by, "by")
    if request_id is not None:
        name_field(request_id, "request_id", max_length=MAX_KEY_LENGTH)

    def decide_in(tx: RunTx) -> ApprovalDecision:
        return decide(
            tx,
            eid,
            approve=approve,
            digest=digest,
            note=note,
            by=by,
            via=via,
            request_id=request_id,
        )

    return decide_in


def refused(decision: ApprovalDecision) -> None:
    """Raise :class:`ApprovalRefused` for a refused decision (after its transaction committed)."""
    if decision.refusal is not None:
        raise ApprovalRefused(decision.effect_id, decision.refusal)


def signal_sender(
    settings: Settings,
    run_id: uuid.UUID | str,
    name: str,
    payload: Any,
    dedup_key: str | None,
    request_id: str | None,
) -> Callable[[RunTx], SignalReceipt]:
    """Validate a signal; return what stores it in a run transaction (both twins)."""
    rid = as_uuid(run_id, "run_id")
    name_field(name, "name")
    if dedup_key is not None:
        name_field(dedup_key, "dedup_key", max_length=MAX_KEY_LENGTH)
    if request_id is not None:
        name_field(request_id, "request_id", max_length=MAX_KEY_LENGTH)
    stored = store_value(payload, field="payload", limits=settings.value_limits)
    key = dedup_key or uuid.uuid4().hex

    def send(tx: RunTx) -> SignalReceipt:
        if request_id is not None and not tx.mark_replay(request_id):
            raise ReplayRefused("request_id", request_id)
        return send_signal(tx, rid, name, stored.json, key, stored.blob)

    return send


def cancel_args(run_id: uuid.UUID | str, reason: str) -> uuid.UUID:
    """Validate a cancellation; returns the run id."""
    return reason_args(run_id, reason, "cancelled")


def reason_args(run_id: uuid.UUID | str, reason: str, done: str) -> uuid.UUID:
    """Validate an operator's action on a run that must say why (cancel, pause)."""
    rid = as_uuid(run_id, "run_id")
    if not isinstance(reason, str) or not reason.strip():
        raise ValidationError("reason", reason, f"say why the run is {done}")
    name_field(reason, "reason", max_length=2000)
    return rid


def fork_args(
    run_id: uuid.UUID | str,
    from_step: str,
    version: str | None,
    fork_id: uuid.UUID | str | None,
) -> tuple[uuid.UUID, uuid.UUID, str, str | None]:
    """Validate a fork: (original, fork id, step, version)."""
    original = as_uuid(run_id, "run_id")
    name_field(from_step, "from_step")
    if version is not None:
        name_field(version, "version", max_length=100)
    # on the original's shard: the copy touches one shard
    new_id = (
        on_shard(uuid7(), shard_of(original)) if fork_id is None else as_uuid(fork_id, "fork_id")
    )
    return original, new_id, from_step, version
