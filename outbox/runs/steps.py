"""What a step writes besides the caller's rows: state, plan, budget debits and its intents.

:class:`StepWrites` gathers them while the step function runs (the intents
through :mod:`outbox.runs.intents`) and :func:`step_checkpoint` hands them to
the one write function as a typed :class:`~outbox.storage.writes.StepCheckpoint`.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from outbox.errors import ValidationError
from outbox.governance.gates import ApprovalPolicy
from outbox.governance.intent_rules import MAX_AMOUNT
from outbox.models import (
    Effect,
    Lease,
)
from outbox.payloads import Encoded, encode_value
from outbox.runs.intents import (
    Intents,
    OutboxTransaction,
    PreparedIntent,
    RunHandle,
    intend_options,
)
from outbox.storage import Connection
from outbox.storage.writes import StepCheckpoint
from outbox.validation import name_field

__all__ = [
    "StepTransaction",
    "StepWrites",
    "committed_values",
    "pending_intents",
    "step_checkpoint",
]


class StepWrites:
    """What a step writes besides the caller's rows: state, plan, debits and intents (both twins).

    ``intents_connection`` is the sync ``Connection`` the step's transaction
    runs on; the async twin passes its ``AsyncConnection.sync_connection`` and
    uses it only inside ``run_sync``.
    """

    def __init__(self, run: RunHandle, intents_connection: Connection, step_id: str) -> None:
        self.run = run
        self.step_id = step_id
        self._state: Encoded | None = None
        self._plan: Encoded | None = None
        self._spends: list[tuple[str, Decimal]] = []
        self._reserve = Decimal(0)
        self._intents = Intents(run.context, intents_connection)

    def set_state(self, state: Any) -> None:
        """Replace the run's state when this step commits."""
        self._state = self._encode(state, "state")

    def set_plan(self, plan: Any) -> None:
        """Replace the run's plan (task list) when this step commits."""
        self._plan = self._encode(plan, "plan")

    def _encode(self, value: Any, field: str) -> Encoded:
        return encode_value(
            value, field=field, max_bytes=self.run.context.settings.max_payload_bytes
        )

    def _prepare_intent(
        self, kind: str, payload: Any, options: dict[str, Any]
    ) -> tuple[PreparedIntent | Effect, int]:
        before = self._intents.pending
        record = self.run.record
        prepared = self._intents.prepare(
            run_id=self.run.id,
            step_id=self.step_id,
            kind=kind,
            payload=payload,
            options=options,
            lane=(record.priority, record.fairness_key),
            dry_run=self.run.dry_run,
        )
        return prepared, before

    def _record_intent(
        self, prepared: PreparedIntent | Effect, existing: Effect | None, before: int
    ) -> Effect:
        if isinstance(prepared, Effect):
            effect = prepared
        else:
            effect = self._intents.record(prepared, existing)
        if effect.cost is not None and self._intents.pending > before:
            # Reserved when the intent commits; the effect's outcome settles it.
            self._reserve += effect.cost
        return effect

    def spend(self, amount: float | Decimal, reason: str) -> None:
        """Debit the run's budget by ``amount`` for ``reason`` (a model call, say) if this commits.

        Keyed by (run, step, reason): a step records its debits once, so a
        replay or a retry cannot spend twice. If the run's budget cannot cover
        every debit and reservation of the step, the step commits nothing and
        raises :class:`~outbox.BudgetExceeded`.
        """
        value = _amount(amount)
        name_field(reason, "reason")
        if any(spent == reason for spent, _ in self._spends):
            raise ValidationError("reason", reason, "already spent for in this step")
        self._spends.append((reason, value))


class StepTransaction(StepWrites):
    """What an atomic step's function receives: one open transaction.

    ``connection`` is a SQLAlchemy ``Connection`` in that transaction: rows the
    caller writes on it commit (or roll back) together with the checkpoint and
    the intents. Do not commit or roll back on it yourself.
    """

    def __init__(self, run: RunHandle, connection: Connection, step_id: str) -> None:
        super().__init__(run, connection, step_id)
        self.connection = connection

    def intend(
        self,
        kind: str,
        payload: Any,
        *,
        key: str | None = None,
        ordering_key: str | None = None,
        max_attempts: int | None = None,
        delay_seconds: float = 0.0,
        schema_version: int = 1,
        compensate: tuple[str, Any] | None = None,
        cost: float | None = None,
        priority: int | None = None,
        fairness_key: str | None = None,
        approval: bool | ApprovalPolicy | dict[str, Any] | None = None,
    ) -> Effect:
        """Record that effect ``kind`` with ``payload`` must happen, once, if this step commits.

        The idempotency key defaults to one derived from (run, step, index of
        this intent in the step), so a replayed step re-derives the same key.
        A caller's own ``key`` names one intent across all runs: reusing it
        returns the existing intent when kind, payload and run all match, and
        raises :class:`~outbox.IdempotencyConflict` otherwise. What a payload
        may contain: ``outbox.governance.intent_rules`` (no credentials, no framing headers).
        ``priority`` and ``fairness_key`` default to the run's: deliverers claim
        higher priorities first and share their capacity between fairness keys.
        A payload over ``Settings.blob_threshold_bytes`` is stored once, by reference.

        ``approval`` (``True``, or ``{"timeout": 3600, "on_timeout": "reject"}``,
        see :class:`~outbox.ApprovalPolicy`) holds the effect as
        ``awaiting_approval`` until a person approves its payload; a gate of the
        deliverers config may hold it without asking (``outbox.governance.gates``).
        """
        options = intend_options(
            key=key,
            ordering_key=ordering_key,
            max_attempts=max_attempts,
            delay_seconds=delay_seconds,
            schema_version=schema_version,
            compensate=compensate,
            cost=cost,
            priority=priority,
            fairness_key=fairness_key,
            approval=approval,
        )
        prepared, before = self._prepare_intent(kind, payload, options)
        existing = None
        if not isinstance(prepared, Effect) and prepared.caller_key:
            existing = self._intents.lookup(prepared.key)
        return self._record_intent(prepared, existing, before)


def step_checkpoint(
    tx: StepWrites, kind: str, result: Encoded, *, lease: Lease | None, wake: bool | None
) -> StepCheckpoint:
    """What the step ``tx`` commits, as the write function takes it."""
    return StepCheckpoint(
        run_id=tx.run.id,
        step_id=tx.step_id,
        kind=kind,
        result_json=result.json,
        state_json=None if tx._state is None else tx._state.json,
        plan_json=None if tx._plan is None else tx._plan.json,
        intents=tuple(tx._intents.rows),
        spends=tuple(tx._spends),
        lease=lease,
        wake=wake,
    )


def pending_intents(tx: StepWrites | OutboxTransaction) -> int:
    """How many intents ``tx`` will write when it commits."""
    return tx._intents.pending


def committed_values(tx: StepWrites) -> dict[str, Any]:
    """The run record's fields the committed step ``tx`` changed (as the function moved them)."""
    record = tx.run.record
    changed: dict[str, Any] = {"current_step": tx.step_id}
    if tx._state is not None:
        changed["state"] = tx._state.value()
    if tx._plan is not None:
        changed["plan"] = tx._plan.value()
    if tx._spends:
        changed["spent"] = record.spent + sum((a for _, a in tx._spends), Decimal(0))
    if tx._reserve:
        changed["reserved"] = record.reserved + tx._reserve
    return changed


def _amount(amount: Any) -> Decimal:
    """A positive, finite amount of at most ``MAX_AMOUNT``, or a :class:`ValidationError`."""
    if isinstance(amount, bool) or not isinstance(amount, int | float | Decimal):
        raise ValidationError("amount", amount, "must be a number")
    try:
        value = Decimal(amount) if isinstance(amount, int) else Decimal(str(amount))
    except ValueError:
        raise ValidationError("amount", amount, "must be a number") from None
    if not value.is_finite() or value <= 0 or value > MAX_AMOUNT:
        raise ValidationError(
            "amount", amount, f"must be a positive, finite number of at most {MAX_AMOUNT:.0e}"
        )
    return value
