"""The four writes (start a run, commit a step, intend outside a run, end a run) as typed values.

Each write has one implementation, in PostgreSQL (``outbox/storage/functions``);
every client calls it. This module turns the values a run or a transaction
gathered (:class:`IntentRow`, :class:`StepCheckpoint`, :class:`RunStart`) into one
prepared call of that function on the caller's connection, and its refusals
into typed errors. The payloads travel as the JSON text the client rendered
(:func:`outbox.payloads.jsonb_text`), spliced in unparsed.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import psycopg
from sqlalchemy import Connection
from sqlalchemy.util import await_only

from outbox.errors import StepAlreadyRecorded
from outbox.models import Lease
from outbox.shards import DEFAULT_NAMESPACE, shard_of
from outbox.storage.engine import distributed, translate_errors

__all__ = [
    "IntentRow",
    "RunStart",
    "StepCheckpoint",
    "StepTaken",
    "StepWritten",
    "begin_run",
    "commit_step",
    "finish_run",
    "intend",
    "intend_compensations",
    "takes_keys",
    "untouched",
]


class StepTaken(Exception):
    """Internal: another transaction recorded this step first (ours is lost; replay it)."""


@dataclass(frozen=True, slots=True)
class IntentRow:
    """One intent as the write functions take it: ``outbox_intend``'s arguments, validated."""

    id: uuid.UUID
    kind: str
    #: The payload's JSON text (as ``jsonb`` renders it).
    payload_json: str
    #: A caller's key; ``None`` lets the function derive it from (run, step, index).
    key: str | None = None
    ordering_key: str | None = None
    max_attempts: int | None = None
    delay_seconds: float = 0.0
    schema_version: int = 1
    #: ``{"kind": ..., "payload": ...}`` as JSON text.
    compensate_json: str | None = None
    cost: Decimal | None = None
    #: The intent's own approval policy (``outbox.governance.gates.policy_json``), as JSON text.
    approval_json: str | None = None
    priority: int = 0
    fairness_key: str = ""
    trace_parent: str | None = None

    def json(self) -> str:
        """The intent as one JSON object; payload, compensation, policy and cost spliced in."""
        fields: dict[str, Any] = {"id": str(self.id), "kind": self.kind}
        for name in ("key", "ordering_key", "max_attempts", "trace_parent"):
            value = getattr(self, name)
            if value is not None:
                fields[name] = value
        if self.delay_seconds:
            fields["delay_seconds"] = self.delay_seconds
        if self.schema_version != 1:
            fields["schema_version"] = self.schema_version
        fields["priority"] = self.priority
        fields["fairness_key"] = self.fairness_key
        parts = [json.dumps(fields, ensure_ascii=False)[:-1], f', "payload": {self.payload_json}']
        if self.compensate_json is not None:
            parts.append(f', "compensate": {self.compensate_json}')
        if self.approval_json is not None:
            parts.append(f', "approval": {self.approval_json}')
        if self.cost is not None:
            parts.append(f', "cost": {_number(self.cost)}')  # exact: a Decimal, not a float
        parts.append("}")
        return "".join(parts)


def _number(amount: Decimal) -> str:
    """A Decimal as a JSON number, digit for digit."""
    return format(amount, "f")


def _spends_json(spends: Sequence[tuple[str, Decimal]]) -> str:
    items = (
        f'{{"reason": {json.dumps(r, ensure_ascii=False)}, "amount": {_number(a)}}}'
        for r, a in spends
    )
    return "[" + ", ".join(items) + "]"


def intents_json(rows: Sequence[IntentRow]) -> str:
    """A JSON array of intents (what ``outbox_commit_step(intents => ...)`` takes)."""
    return "[" + ", ".join(row.json() for row in rows) + "]"


@dataclass(frozen=True, slots=True)
class StepCheckpoint:
    """What a step commits besides the caller's rows: its result, state, plan, intents, debits."""

    run_id: uuid.UUID
    step_id: str
    #: ``transaction`` or ``call``.
    kind: str
    result_json: str
    #: ``None`` keeps the run's state (plan).
    state_json: str | None = None
    plan_json: str | None = None
    intents: tuple[IntentRow, ...] = ()
    #: (reason, amount) of each budget debit.
    spends: tuple[tuple[str, Decimal], ...] = ()
    #: A worker's lease on the run: the step is refused once another holds it (G4).
    lease: Lease | None = None
    #: Send the deliverers' NOTIFY (True), never (False), or leave it to the database (None).
    wake: bool | None = None


@dataclass(frozen=True, slots=True)
class StepWritten:
    """What :func:`commit_step` reports: the step's sequence number, its effects, a pause."""

    step_seq: int
    effect_ids: tuple[uuid.UUID, ...]
    #: A pause waits for this step: the run stops after it (its intents were held).
    paused: bool


@dataclass(frozen=True, slots=True)
class RunStart:
    """A run to start (``outbox_begin_run``'s arguments, validated)."""

    id: uuid.UUID
    agent: str
    version: str
    inputs_json: str
    budget: Decimal | None = None
    key: str | None = None
    priority: int = 0
    fairness_key: str = ""
    dry_run: bool = False
    trace_parent: str | None = None
    #: ``return_existing`` or ``reject``: what a business key another run holds means.
    on_conflict: str = "return_existing"
    wake: bool | None = None
    namespace: str = DEFAULT_NAMESPACE


# The write function itself, on the run's shard (computed here: on Citus the
# call then goes to the node that holds it, in one round trip).
_COMMIT_STEP = (
    "SELECT step_seq, effect_ids, paused, notify FROM outbox_write_step("
    "%s::smallint, %s, %s, %s::jsonb, %s::jsonb, %s::jsonb, %s::jsonb, %s, %s::jsonb, %s, %s, %s)"
)
_INTEND = (
    "SELECT effect_id, idempotency_key, created"
    " FROM outbox_intend_all(NULL, NULL, %s::jsonb, %s, true, %s)"
)
_BEGIN_RUN = (
    "SELECT (b.run).*, b.created FROM outbox_begin_run("
    "%s, %s, %s::jsonb, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) AS b"
)
# On Citus the step's write runs on its run's shard alone: callers' keys are taken
# on their own shards first, and the deliverers are woken from the coordinator.
_TAKE_KEYS = "SELECT outbox_take_keys(%s, %s::jsonb)"
_TAKE_KEYS_OF_NO_RUN = "SELECT outbox_take_keys(NULL, %s::jsonb, %s)"
# The payload names the shard, so an idle deliverer asks it first (ShardTurns.plan).
_WAKE_DELIVERERS = "SELECT pg_notify('outbox_effects', %s::text)"
_FINISH_RUN = "SELECT outbox_finish_run(%s, %s, %s::jsonb, %s::jsonb, %s, %s)"
_COMPENSATE = "SELECT outbox_intend_compensations(%s, %s)"


def _call(
    conn: Connection,
    query: str,
    params: Sequence[Any],
    *,
    alone: bool = False,
    then: tuple[str, Sequence[Any]] | None = None,
) -> _Rows:
    """Run one prepared call on ``conn``'s driver connection; its rows, fetched.

    The SQLAlchemy connection of the async client runs its sync code in a greenlet
    (``run_sync``): its driver connection is psycopg's async one, awaited in place.
    With ``alone`` the connection is in autocommit for this call only. ``then``:
    a statement sent after it in the same round trip (a pipeline), run only if
    the call succeeds and in its transaction (alone: the implicit one both share).
    """
    driver = conn.connection.driver_connection
    if isinstance(driver, psycopg.AsyncConnection):
        rows: _Rows = await_only(_call_async(driver, query, params, alone, then))
        return rows
    assert isinstance(driver, psycopg.Connection)
    if alone:
        driver.autocommit = True
    try:
        if then is None:
            return _Rows(driver.execute(query, params, prepare=True))
        with driver.pipeline():
            cursor = driver.execute(query, params, prepare=True)
            driver.execute(*then, prepare=True)
        return _Rows(cursor)
    finally:
        if alone and not driver.closed:
            driver.autocommit = False


async def _call_async(
    driver: psycopg.AsyncConnection[Any],
    query: str,
    params: Sequence[Any],
    alone: bool,
    then: tuple[str, Sequence[Any]] | None,
) -> _Rows:
    if alone:
        await driver.set_autocommit(True)
    try:
        if then is None:
            cursor = await driver.execute(query, params, prepare=True)
            return _Rows(cursor, await cursor.fetchall())
        async with driver.pipeline():
            cursor = await driver.execute(query, params, prepare=True)
            await driver.execute(*then, prepare=True)
        return _Rows(cursor, await cursor.fetchall())
    finally:
        if alone and not driver.closed:
            await driver.set_autocommit(False)


class _Rows:
    """A call's rows and column names, whichever driver connection ran it."""

    def __init__(self, cursor: Any, rows: list[Any] | None = None) -> None:
        self.rows: list[Any] = cursor.fetchall() if rows is None else rows
        self.names = [c.name for c in cursor.description or ()]

    def one(self) -> Any:
        assert len(self.rows) == 1, self.rows
        return self.rows[0]


def untouched(conn: Connection) -> bool:
    """True while ``conn``'s transaction has sent nothing yet (no BEGIN on the wire).

    A call sent then may commit on its own: one round trip instead of three
    (BEGIN, the call, COMMIT).
    """
    driver = conn.connection.driver_connection
    assert isinstance(driver, psycopg.Connection | psycopg.AsyncConnection)
    return bool(driver.info.transaction_status == psycopg.pq.TransactionStatus.IDLE)


def takes_keys(conn: Connection, step: StepCheckpoint) -> bool:
    """Whether the step's callers' keys are taken first, by a statement of their own.

    On Citus only, where the step's write reaches its run's shard alone and a key
    lives on its own. On one server the write takes them itself: a statement
    first would do it twice (2.4 ms of server CPU a step with one keyed intent).
    Asks :func:`~outbox.storage.engine.distributed` whatever the step, so that
    :func:`commit_step` never has to: our engines know the answer from the
    connection's start, but on a caller's own engine it is a question sent, and
    sent after :func:`untouched` it would make a call meant to commit alone fail.
    """
    return distributed(conn) and any(i.key is not None for i in step.intents)


def commit_step(conn: Connection, step: StepCheckpoint, *, alone: bool = False) -> StepWritten:
    """Call ``outbox_commit_step`` for ``step`` in ``conn``'s transaction.

    With ``alone`` (the transaction is the caller's own and :func:`untouched`) the
    call commits by itself: the function writes all of the step or none of it.
    Raises the run's refusal as a typed error, :class:`StepTaken` when another
    transaction recorded the step first, :class:`~outbox.IdempotencyConflict`.
    """
    lease = step.lease
    intents = intents_json(step.intents) if step.intents else None
    if takes_keys(conn, step):
        assert not alone, "the keys and the step are written in one transaction"
        with translate_errors("taking the callers' keys"):
            _call(conn, _TAKE_KEYS, (step.run_id, intents))
    params = (
        shard_of(step.run_id),
        step.run_id,
        step.step_id,
        step.result_json,
        step.state_json,
        step.plan_json,
        intents,
        step.kind,
        _spends_json(step.spends) if step.spends else None,
        None if lease is None else lease.owner,
        None if lease is None else lease.attempt,
        step.wake,
    )
    # On Citus the deliverers' NOTIFY goes with the call, in its round trip and
    # its transaction, whenever the step may have written a claimable intent.
    wake = None
    if step.intents and step.wake is not False and distributed(conn):
        wake = (_WAKE_DELIVERERS, (params[0],))
    try:
        with translate_errors("committing a step"):
            row = _call(conn, _COMMIT_STEP, params, alone=alone, then=wake).one()
    except StepAlreadyRecorded as exc:
        raise StepTaken from exc
    if row[3] and wake is None:
        _call(conn, _WAKE_DELIVERERS, (params[0],))
    return StepWritten(int(row[0]), tuple(row[1]), bool(row[2]))


def intend(
    conn: Connection, rows: Sequence[IntentRow], *, wake: bool | None, namespace: str
) -> list[tuple[uuid.UUID, str, bool]]:
    """Write intents of no run in ``conn``'s transaction: (effect id, key, created) each.

    Callers' keys are taken first on Citus, as a step's are (:func:`takes_keys`).
    """
    intents = intents_json(rows)
    if any(r.key is not None for r in rows) and distributed(conn):
        with translate_errors("taking the callers' keys"):
            _call(conn, _TAKE_KEYS_OF_NO_RUN, (intents, namespace))
    with translate_errors("writing intents"):
        found = _call(conn, _INTEND, (intents, wake, namespace)).rows
    return [(r[0], r[1], bool(r[2])) for r in found]


def begin_run(conn: Connection, start: RunStart) -> tuple[dict[str, Any], bool]:
    """Start a run (or find the one its key names): its row as stored, and whether it is new."""
    params = (
        start.agent,
        start.version,
        start.inputs_json,
        start.budget,
        start.id,
        start.key,
        start.on_conflict,
        start.priority,
        start.fairness_key,
        "dry_run" if start.dry_run else "live",
        start.trace_parent,
        start.wake,
        start.namespace,
    )
    with translate_errors("starting a run"):
        found = _call(conn, _BEGIN_RUN, params)
    mapping = dict(zip(found.names, found.one(), strict=True))
    created = bool(mapping.pop("created"))
    return mapping, created


def finish_run(
    conn: Connection,
    run_id: uuid.UUID,
    *,
    status: str,
    result_json: str | None,
    error_json: str | None,
    lease: Lease | None,
) -> None:
    """End a run as ``completed`` or ``failed`` (its refusal raised as a typed error)."""
    params = (
        run_id,
        status,
        result_json,
        error_json,
        None if lease is None else lease.owner,
        None if lease is None else lease.attempt,
    )
    with translate_errors("finishing a run"):
        _call(conn, _FINISH_RUN, params)


def intend_compensations(
    conn: Connection, run_id: uuid.UUID, originals: Sequence[uuid.UUID]
) -> int:
    """Intend the compensations of a stopping run's effects ``originals``; how many were new."""
    with translate_errors("intending compensations"):
        row = _call(conn, _COMPENSATE, (run_id, list(originals))).one()
    return int(row[0])
