"""A client's operations on effects: read them, settle them by hand, approve them, audit them."""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime
from typing import Any

from outbox.errors import (
    ApprovalRefused,
    EffectNotFound,
    RunNotFound,
    RunStateError,
    ValidationError,
)
from outbox.governance.audit_record import record_from_rows
from outbox.governance.chain import Break, stored_values, value_breaks, verify_record
from outbox.governance.gates import Gate
from outbox.governance.intent_rules import MAX_KEY_LENGTH
from outbox.models import STOPPING_RUN_STATUSES, Effect, EffectStatus
from outbox.payloads import encode
from outbox.runs.approvals import decide, expire_approvals
from outbox.validation import as_uuid, name_field, row_limit

from .base import ClientBase

__all__ = ["EffectOperations", "effect_filters"]

#: An operator's ``resolve`` outcome -> the status it sets.
_RESOLVED = {"succeeded": "succeeded", "failed": "failed", "retry": "pending"}


class EffectOperations(ClientBase):
    """Effects and the tamper-evident record, as both clients operate on them."""

    # -- the tamper-evident record --------------------------------------------------

    def audit_record(self, run_id: uuid.UUID | str) -> dict[str, Any]:
        """A self-contained record of a run: inputs, steps, effects, attempts, approvals (unsigned).

        Read in one snapshot; ``outbox.governance.chain_signing.sign_record`` signs it
        and ``outbox.governance.chain.verify_record`` (or the script in
        ``docs/reference/audit.md``) checks it.
        """
        return self.checked_record(run_id)[0]

    def checked_record(self, run_id: uuid.UUID | str) -> tuple[dict[str, Any], list[Break]]:
        """A run's record (:meth:`audit_record`) and every break in it, read in one snapshot.

        The breaks are those of its chains and digests (``verify_record``) and of
        its values stored by reference: a blob whose text does not hash to its
        sha256 is a break wherever the run uses it.
        """
        rid = as_uuid(run_id, "run_id")
        rows = self.store.audit_rows(rid)
        if not rows:
            raise RunNotFound(rid)
        record = record_from_rows(rows, exported_at=datetime.now(UTC))
        return record, verify_record(record) + value_breaks(stored_values(rows), rows["blobs"])

    def verify_run(self, run_id: uuid.UUID | str) -> list[Break]:
        """Recompute a run's hash chains and value digests from the database: every break."""
        return self.checked_record(run_id)[1]

    def audited_runs(self, limit: int = 100_000) -> list[uuid.UUID]:
        """Run ids, newest first: what ``outbox audit verify`` checks when no run is named."""
        return self.store.run_ids(row_limit(limit))

    # -- effects ----------------------------------------------------------------

    def effect(self, effect_id: uuid.UUID | str) -> Effect:
        """One effect by id."""
        eid = as_uuid(effect_id, "effect_id")
        found = self.store.get_effect(eid)
        if found is None:
            raise EffectNotFound(eid)
        return found

    def effects(
        self,
        *,
        run_id: uuid.UUID | str | None = None,
        step_id: str | None = None,
        status: str | None = None,
        kind: str | None = None,
        limit: int = 100,
    ) -> list[Effect]:
        """Effects in intent order, filtered by run (and step of that run), status or kind."""
        filters = effect_filters(
            run_id=run_id, step_id=step_id, status=status, kind=kind, limit=limit
        )
        return self.store.list_effects(**filters)

    def resolve_effect(
        self, effect_id: uuid.UUID | str, *, outcome: str, note: str, operator: str
    ) -> Effect:
        """Close an ``unknown`` effect after checking the outside world by hand.

        ``outcome`` is ``succeeded`` (it did happen), ``failed`` (it did not and
        must not be retried) or ``retry`` (it did not: deliver it again, same key).
        Recorded in the attempt log with ``operator`` and ``note``.
        """
        if outcome not in _RESOLVED:
            raise ValidationError("outcome", outcome, f"must be one of {sorted(_RESOLVED)}")
        if not note.strip():
            raise ValidationError("note", note, "say why (it is kept in the attempt log)")
        detail = encode({"as": outcome, "note": note, "by": operator}, field="note")
        effect = self.effect(effect_id)
        params = {"new_status": _RESOLVED[outcome], "operator": operator, "detail": detail}
        if not self.store.operator_change("resolve", {"effect_id": effect.id, **params}):
            now = self._refused_reopen(
                effect.id,
                EffectStatus.UNKNOWN,
                "resolve it as succeeded (it is then compensated if it declares a "
                "compensation) or as failed",
            )
            raise RunStateError(
                f"effect_id={str(effect.id)!r} is {now.value}, not unknown: "
                "only unknown effects are resolved"
            )
        if outcome == "retry":
            self._effects_wakeup.committed(None)
        return self.effect(effect.id)

    def _refused_reopen(
        self, effect_id: uuid.UUID, status: EffectStatus, instead: str
    ) -> EffectStatus:
        """Why a reopen changed nothing: raise when the effect's run is stopping.

        Otherwise the effect's status now (it was not ``status``).
        """
        effect = self.effect(effect_id)
        if effect.status != status or effect.run_id is None or effect.compensates is not None:
            return effect.status
        loaded = self.store.load_run(effect.run_id, step_id="")  # the run, no steps
        run = None if loaded is None else loaded[0]
        if run is not None and run.status in STOPPING_RUN_STATUSES:
            raise RunStateError(
                f"effect_id={str(effect_id)!r}: its run is {run.status.value}, so it is not "
                f"delivered again; {instead}"
            )
        return effect.status

    def retry_effect(
        self,
        effect_id: uuid.UUID | str,
        *,
        operator: str,
        extra_attempts: int = 3,
        note: str | None = None,
    ) -> Effect:
        """Put a ``failed`` effect back to ``pending`` (same key) with ``extra_attempts`` tries.

        Recorded in the attempt log with ``operator`` and, when given, ``note`` (why).
        """
        if extra_attempts < 1:
            raise ValidationError("extra_attempts", extra_attempts, "must be at least 1")
        if note is not None and not note.strip():
            raise ValidationError("note", note, "say why, or leave the note out")
        entry: dict[str, Any] = {"extra_attempts": extra_attempts, "by": operator}
        if note is not None:
            entry["note"] = note
        detail = encode(entry, field="detail")
        effect = self.effect(effect_id)
        params = {"extra_attempts": extra_attempts, "operator": operator, "detail": detail}
        if not self.store.operator_change("retry", {"effect_id": effect.id, **params}):
            now = self._refused_reopen(effect.id, EffectStatus.FAILED, "it stays failed")
            raise RunStateError(
                f"effect_id={str(effect.id)!r} is {now.value}, not failed: "
                "only failed effects are retried (resolve unknown ones)"
            )
        self._effects_wakeup.committed(None)
        return self.effect(effect.id)

    # -- approvals ----------------------------------------------------------------

    def approve_effect(
        self,
        effect_id: uuid.UUID | str,
        *,
        digest: str,
        note: str,
        by: str,
        request_id: str | None = None,
        via: str = "api",
    ) -> Effect:
        """Release an effect held for approval, if ``digest`` is its payload's (``Effect.digest``).

        Used once: the effect goes to ``pending`` and deliverers take it now.
        Raises :class:`~outbox.ApprovalRefused` (nothing released) when the
        digest names another payload, the effect is not awaiting approval, or
        its deadline passed (its ``on_timeout`` is applied instead). Approvals
        and refusals are kept in the attempt log with ``by`` and ``note``.
        """
        effect = self._decide(effect_id, True, digest, note, by, via, request_id)
        self._effects_wakeup.committed(None)
        return effect

    def reject_effect(
        self,
        effect_id: uuid.UUID | str,
        *,
        note: str,
        by: str,
        digest: str | None = None,
        request_id: str | None = None,
        via: str = "api",
    ) -> Effect:
        """End an effect held for approval as ``rejected``: it never reaches the sink.

        A run awaiting it raises :class:`~outbox.EffectRejected`. With ``digest``,
        the rejection applies only to that payload. Refusals as in :meth:`approve_effect`.
        """
        effect = self._decide(effect_id, False, digest, note, by, via, request_id)
        self._runs_wakeup.committed(None)
        return effect

    def _decide(
        self,
        effect_id: uuid.UUID | str,
        approve: bool,
        digest: str | None,
        note: str,
        by: str,
        via: str,
        request_id: str | None,
    ) -> Effect:
        """Validate an approval or rejection and decide it in one run transaction."""
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
        with self.store.run_tx() as tx:
            decision = decide(
                tx,
                eid,
                approve=approve,
                digest=digest,
                note=note,
                by=by,
                via=via,
                request_id=request_id,
            )
        # Raised after the commit: a refusal is kept in the attempt log.
        if decision.refusal is not None:
            raise ApprovalRefused(decision.effect_id, decision.refusal)
        return self.effect(decision.effect_id)

    def expire_approvals(self, max_rows: int = 100) -> dict[str, int]:
        """Apply ``on_timeout`` to held effects past their deadline (deliverers do it too)."""
        with self.store.run_tx() as tx:
            return expire_approvals(tx, row_limit(max_rows))

    def apply_gates(self, gates: list[Gate], *, prune: bool = False) -> list[str]:
        """Store approval gates (replacing those of the same name); ``prune`` removes the rest.

        Returns the names stored. Intents written from now on are checked
        against them (``outbox gates apply --config`` does this from a file).
        """
        return self.store.apply_gates([g.row() for g in gates], prune=prune)

    def gates(self) -> list[Gate]:
        """The approval gates in force, by name."""
        return [Gate.from_row(row) for row in self.store.list_gates()]

    def remove_gates(self, names: list[str]) -> list[str]:
        """Remove gates by name; returns those that existed."""
        return self.store.remove_gates(names)


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
