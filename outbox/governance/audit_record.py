"""The run record ``outbox audit export`` writes: the rows ``Store.audit_rows`` read, as JSON.

Each value is carried with its own text and each link as hex, so that
:func:`outbox.governance.chain.verify_record` (or the independent verifier in
``docs/reference/audit.md``) can recompute the chains from the record alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from outbox.governance.chain import RECORD_FORMAT, STEP_VALUES, us

__all__ = ["APPROVAL_OUTCOMES", "effect_records", "record_from_rows"]


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _hex(value: bytes | None) -> str | None:
    return None if value is None else bytes(value).hex()


#: Attempt-log outcomes that are decisions about an approval.
APPROVAL_OUTCOMES = ("approved", "rejected", "approval_refused", "timed_out")


def effect_records(
    effect_rows: Iterable[Mapping[str, Any]], attempt_rows: Iterable[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Effects as a record holds them, each with its attempt-log rows (``detail_text`` read)."""
    attempts: dict[str, list[dict[str, Any]]] = {}
    for a in attempt_rows:
        attempts.setdefault(str(a["effect_id"]), []).append(
            {
                "id": a["id"],
                "effect_id": str(a["effect_id"]),
                "attempt": a["attempt"],
                "worker": a["worker"],
                "started_at": _iso(a["started_at"]),
                "started_us": us(a["started_at"]),
                "finished_at": _iso(a["finished_at"]),
                "finished_us": us(a["finished_at"]),
                "outcome": a["outcome"],
                "detail": a["detail"],
                "detail_text": a["detail_text"],
                "effect_status": a.get("effect_status"),
                "result_hash": a.get("result_hash"),
                "hash": _hex(a["hash"]),
            }
        )
    return [
        {
            "id": str(e["id"]),
            "run_id": None if e["run_id"] is None else str(e["run_id"]),
            "step_id": e["step_id"],
            "step_index": e["step_index"],
            "kind": e["kind"],
            "idempotency_key": e["idempotency_key"],
            "payload": e["payload"],
            "payload_text": e.get("payload_text"),
            "payload_hash": e["payload_hash"],
            "compensates": None if e.get("compensates") is None else str(e["compensates"]),
            "status": e["status"],
            "attempt": e["attempt"],
            "result": e["result"],
            "result_text": e.get("result_text"),
            "approval": e["approval"],
            "created_at": _iso(e["created_at"]),
            "attempts": attempts.get(str(e["id"]), []),
        }
        for e in effect_rows
    ]


def record_from_rows(rows: Mapping[str, Any], *, exported_at: datetime) -> dict[str, Any]:
    """A self-contained run record from the rows ``Store.audit_rows`` read (unsigned)."""
    run = rows["run"]
    rid = str(run["id"])
    effects = effect_records(rows["effects"], rows["attempts"])
    approvals = [
        {
            "effect_id": row["effect_id"],
            "outcome": row["outcome"],
            "by": row["worker"],
            "at": row["finished_at"],
            **{k: (row["detail"] or {}).get(k) for k in ("digest", "note", "via", "reason")},
        }
        for effect in effects
        for row in effect["attempts"]
        if row["outcome"] in APPROVAL_OUTCOMES
    ]
    return {
        "format": RECORD_FORMAT,
        "exported_at": exported_at.isoformat(),
        "run": {
            "id": rid,
            "agent": run["agent"],
            "agent_version": run["agent_version"],
            "mode": "dry_run" if run["dry_run"] else "live",
            "inputs": run["inputs"],
            "inputs_text": run.get("inputs_text"),
            "inputs_hash": run["inputs_hash"],
            "status": run["status"],
            "result": run["result"],
            "error": run["error"],
            "created_at": _iso(run["created_at"]),
            "step_head": _hex(run["step_head"]),
        },
        "steps": [
            {
                "step_id": s["step_id"],
                "seq": s["seq"],
                "kind": s["kind"],
                "status": s["status"],
                "result": s["result"],
                "result_text": s["result_text"],
                "error": s["error"],
                "error_text": s["error_text"],
                "state": s["state"],
                "state_text": s["state_text"],
                "plan": s["plan"],
                "plan_text": s["plan_text"],
                **{f"{f}_value_text": s.get(f"{f}_value_text") for f in STEP_VALUES},
                **{
                    f"{f}_rendered_text": s[f"{f}_rendered_text"]
                    for f in STEP_VALUES
                    if s.get(f"{f}_rendered_text") is not None
                },
                "completed_at": _iso(s["completed_at"]),
                "completed_us": us(s["completed_at"]),
                "hash": _hex(s["hash"]),
            }
            for s in rows["steps"]
        ],
        "effects": effects,
        "approvals": approvals,
    }
