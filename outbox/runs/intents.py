"""The intents a transaction writes besides the caller's rows: gathered, checked, keyed.

Intents are gathered in memory while the step function runs, as typed rows
(:class:`~outbox.storage.writes.IntentRow`), and written at its end by the one
write function every client calls (``outbox_commit_step``; ``outbox_intend_all``
for intents of no run), which checks them again: the database is the one
enforcer of the rules. What is checked here first gives the caller its error at
``tx.intend``, where it can still act on it, and lets ``tx.intend`` answer with
the effect (its id, key and payload hash) before the step commits.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Protocol

from outbox.errors import IdempotencyConflict, PayloadError, ValidationError
from outbox.governance.gates import ApprovalPolicy
from outbox.governance.intent_rules import check_payload
from outbox.ids import uuid7
from outbox.keys import derive_key
from outbox.models import (
    DRY_RUN_KIND_PREFIX,
    Compensation,
    Effect,
    EffectIntent,
    EffectStatus,
    RunRecord,
)
from outbox.payloads import encode_value, jsonb_sized
from outbox.runs.context import RunContext
from outbox.shards import key_shard, on_shard, shard_of
from outbox.storage import Connection, writes
from outbox.storage.writes import IntentRow
from outbox.tracing import current_traceparent
from outbox.validation import validated


class RunHandle(Protocol):
    """What a step transaction needs of its run (``Run`` and its async twin satisfy it)."""

    @property
    def id(self) -> uuid.UUID:
        """The run's id."""
        ...

    @property
    def context(self) -> RunContext:
        """The store, settings and wake-ups the run writes through."""
        ...

    @property
    def record(self) -> RunRecord:
        """The run as last read or written."""
        ...

    @property
    def dry_run(self) -> bool:
        """Whether the run's effects go to the recording deliverer."""
        ...


__all__ = ["Intents", "OutboxTransaction", "PreparedIntent", "RunHandle", "intend_options"]


@dataclass(frozen=True, slots=True)
class PreparedIntent:
    """A checked intent, not yet gathered (a caller's key may still name an existing one)."""

    row: IntentRow
    effect: Effect
    size: int
    caller_key: bool

    @property
    def key(self) -> str:
        """The intent's idempotency key."""
        return self.effect.idempotency_key


class Intents:
    """Intents gathered during one transaction, written by one call at its end."""

    def __init__(self, ctx: RunContext, conn: Connection) -> None:
        self._ctx = ctx
        self._conn = conn
        self.rows: list[IntentRow] = []
        self._effects: dict[str, Effect] = {}
        self._bytes = 0
        self.count = 0

    @property
    def pending(self) -> int:
        """How many intents are gathered and not written yet."""
        return len(self.rows)

    def add(
        self,
        *,
        run_id: uuid.UUID | None,
        step_id: str | None,
        kind: str,
        payload: Any,
        options: dict[str, Any],
    ) -> Effect:
        """Check and gather one intent (the sync twin: a caller's key is looked up here)."""
        prepared = self.prepare(
            run_id=run_id, step_id=step_id, kind=kind, payload=payload, options=options
        )
        if isinstance(prepared, Effect):
            return prepared
        existing = self.lookup(prepared.key) if prepared.caller_key else None
        return self.record(prepared, existing)

    def prepare(
        self,
        *,
        run_id: uuid.UUID | None,
        step_id: str | None,
        kind: str,
        payload: Any,
        options: dict[str, Any],
        lane: tuple[int, str] = (0, ""),
        dry_run: bool = False,
    ) -> PreparedIntent | Effect:
        """Everything of :meth:`add` but the look-up: the checks, the encoding, the key (no I/O).

        Returns the intent already gathered in this transaction under the same
        key and payload, if any. Both twins call it, then look a caller's key up
        their own way (:meth:`lookup`), then :meth:`record`. ``lane`` is the
        priority and fairness key an intent that names none takes (its run's).

        In a dry run the kind (and a compensation's) goes to the dry-run namespace,
        where no real deliverer claims it, and a caller's key is made the run's own,
        so a dry run never takes a key a real intent will need. It asks for no
        approval: nothing it intends can reach the world. (The write function
        does the same; this is the answer ``tx.intend`` returns.)
        """
        settings = self._ctx.settings
        intent: EffectIntent = validated(EffectIntent, kind=kind, payload=payload, **options)
        check_payload(intent.payload, "payload")
        encoded = encode_value(
            intent.payload, field="payload", max_bytes=settings.max_payload_bytes
        )
        size = encoded.size
        kind = DRY_RUN_KIND_PREFIX + intent.kind if dry_run else intent.kind
        compensate_json = None
        compensation = None
        if intent.compensate is not None:
            check_payload(intent.compensate.payload, "compensate.payload")
            compensate_kind = intent.compensate.kind
            compensate_json, extra = jsonb_sized(
                {"kind": compensate_kind, "payload": intent.compensate.payload},
                field="compensate",
                max_bytes=settings.max_payload_bytes,
            )
            size += extra
            if dry_run:
                compensate_kind = DRY_RUN_KIND_PREFIX + compensate_kind
            compensation = Compensation(
                kind=compensate_kind, payload=json.loads(compensate_json)["payload"]
            )
        if self.count >= settings.max_step_intents:
            raise ValidationError(
                "intents",
                self.count + 1,
                f"a step or transaction may intend at most {settings.max_step_intents} effects "
                "(Settings.max_step_intents)",
            )
        if self._bytes + size > settings.max_step_bytes:
            raise PayloadError(
                "intents",
                f"<{self._bytes + size} bytes>",
                f"the payloads of one step or transaction may total at most "
                f"{settings.max_step_bytes} bytes (Settings.max_step_bytes)",
            )
        index = self.count
        self.count += 1
        effect_id = uuid7()
        if run_id is not None:  # on its run's shard, where it lives: the id names it
            effect_id = on_shard(effect_id, shard_of(run_id))
        elif (shard_key := intent.key or intent.ordering_key) is not None:
            # of no run: on the shard of its key (or ordering key), if any
            effect_id = on_shard(effect_id, key_shard(settings.namespace, shard_key))
        if intent.key is not None:
            key = intent.key
            if dry_run:
                key = f"{DRY_RUN_KIND_PREFIX}{run_id}:{key}"
        elif run_id is not None and step_id is not None:
            key = derive_key(run_id, step_id, index)
        else:  # the write function derives it from the id the same way
            key = effect_id.hex
        if key in self._effects:
            gathered = self._effects[key]
            if (gathered.kind, gathered.payload_hash) != (kind, encoded.hash):
                raise IdempotencyConflict(
                    key, "intended twice in this step with a different kind or payload"
                )
            return gathered
        approval = None if intent.approval is None or dry_run else intent.approval
        row = IntentRow(
            id=effect_id,
            kind=intent.kind,
            payload_json=encoded.json,
            key=intent.key,
            ordering_key=intent.ordering_key,
            max_attempts=intent.max_attempts,
            delay_seconds=intent.delay_seconds,
            schema_version=intent.schema_version,
            compensate_json=compensate_json,
            cost=None if intent.cost is None else Decimal(str(intent.cost)),
            approval_json=None
            if intent.approval is None
            else intent.approval.model_dump_json(exclude_none=True),
            priority=lane[0] if intent.priority is None else intent.priority,
            fairness_key=lane[1] if intent.fairness_key is None else intent.fairness_key,
            # The trace current at tx.intend: every delivery attempt is a span of it.
            trace_parent=current_traceparent(),
        )
        effect = Effect.model_construct(
            id=row.id,
            run_id=run_id,
            step_id=step_id,
            step_index=index if run_id is not None else None,
            kind=kind,
            payload=encoded.value(),
            payload_hash=encoded.hash,
            schema_version=row.schema_version,
            idempotency_key=key,
            ordering_key=row.ordering_key,
            # as written by this intent: a config gate may still hold it (``ob.effect(id)``)
            status=EffectStatus.PENDING if approval is None else EffectStatus.AWAITING_APPROVAL,
            max_attempts=row.max_attempts,
            compensate=compensation,
            cost=row.cost,
            priority=row.priority,
            fairness_key=row.fairness_key,
            approval=None
            if approval is None
            else {"gate": "intent", **approval.model_dump(mode="json")},
            trace_parent=row.trace_parent,
        )
        return PreparedIntent(row, effect, size, caller_key=intent.key is not None)

    def lookup(self, key: str) -> Effect | None:
        """The effect already holding a caller's ``key``, in this transaction (sync; I/O).

        A caller's key may already be taken by any run: wait for a racing
        transaction holding it, then look (so two racers make one row). The
        async twin runs this same method through ``AsyncConnection.run_sync``.
        """
        self._ctx.store.lock_key(self._conn, key)
        return self._ctx.store.effect_by_key(self._conn, key, self._ctx.settings.namespace)

    def record(self, prepared: PreparedIntent, existing: Effect | None) -> Effect:
        """Gather a prepared intent, or return the existing one that holds its caller's key."""
        if existing is not None:
            _same_intent(existing, prepared.effect)
            return existing
        self.rows.append(prepared.row)
        self._effects[prepared.key] = prepared.effect
        self._bytes += prepared.size
        return prepared.effect


def _same_intent(existing: Effect, new: Effect) -> None:
    """A caller's key names one intent: the same kind, payload and owner, or a conflict (G5)."""
    key = new.idempotency_key
    if existing.run_id != new.run_id:
        raise IdempotencyConflict(key, "already intended by another owner")
    if existing.kind != new.kind:
        raise IdempotencyConflict(
            key, f"already intended as kind {existing.kind!r}, not {new.kind!r}"
        )
    if existing.payload_hash != new.payload_hash and existing.payload != new.payload:
        raise IdempotencyConflict(key)


class OutboxTransaction:
    """Run-less intents inside one transaction: ``tx.connection`` and ``tx.intend``."""

    def __init__(self, ctx: RunContext, connection: Connection) -> None:
        self.connection = connection
        self._ctx = ctx
        self._intents = Intents(ctx, connection)
        self._notified: float | None = None

    def intend(self, kind: str, payload: Any, *, key: str | None = None, **options: Any) -> Effect:
        """Record that effect ``kind`` with ``payload`` must happen once this commits."""
        return self._intents.add(
            run_id=None, step_id=None, kind=kind, payload=payload, options={"key": key, **options}
        )

    def _flush(self) -> None:
        self._flush_on(self.connection)

    def _flush_on(self, connection: Connection) -> None:
        """Write the gathered intents (sync; the async twin runs it through ``run_sync``)."""
        if not self._intents.pending:
            return
        self._notified = self._ctx.effects_wakeup.inline()
        writes.intend(
            connection,
            self._intents.rows,
            wake=self._notified is not None,
            namespace=self._ctx.settings.namespace,
        )


def intend_options(
    *,
    key: str | None,
    ordering_key: str | None,
    max_attempts: int | None,
    delay_seconds: float,
    schema_version: int,
    compensate: tuple[str, Any] | None,
    cost: float | None,
    priority: int | None = None,
    fairness_key: str | None = None,
    approval: bool | ApprovalPolicy | dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The options of ``StepTransaction.intend`` (and its async twin) as ``EffectIntent`` fields."""
    options: dict[str, Any] = {
        "key": key,
        "ordering_key": ordering_key,
        "max_attempts": max_attempts,
        "delay_seconds": delay_seconds,
        "schema_version": schema_version,
        "cost": cost,
        "priority": priority,
        "fairness_key": fairness_key,
    }
    if approval is True:
        options["approval"] = {}
    elif approval is not None and approval is not False:
        options["approval"] = approval
    if compensate is not None:
        if not isinstance(compensate, tuple | list) or len(compensate) != 2:
            raise ValidationError("compensate", compensate, "must be a (kind, payload) pair")
        options["compensate"] = {"kind": compensate[0], "payload": compensate[1]}
    return options
