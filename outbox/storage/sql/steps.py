"""The SQL of the client library, as pure functions returning SQLAlchemy Core statements.

Nothing here touches a connection; :mod:`outbox.storage.store` executes these. The hot
statement is :func:`commit_step`: one round trip that checks the run, writes
the step checkpoint and every intent, and (when asked) sends the wake-up
``NOTIFY``. The queue statements shared by runs and effects live in
:mod:`outbox.storage.sql.queue`.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

from sqlalchemy import (
    Boolean,
    Float,
    Integer,
    Numeric,
    Text,
    bindparam,
    case,
    cast,
    column,
    func,
    literal,
    literal_column,
    null,
    select,
    text,
    true,
    tuple_,
)
from sqlalchemy.dialects.postgresql import ARRAY as postgresql_array
from sqlalchemy.dialects.postgresql import BYTEA, JSONB, UUID
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.sql.expression import ColumnElement, TableValuedAlias, TextClause

from outbox.models import TERMINAL_EFFECT_STATUSES, RunStatus
from outbox.storage.schema import budget_ledger, effects, gates, runs, steps
from outbox.storage.sql.common import (
    ACTIVE_CONDITION,
    EFFECTS_CHANNEL,
    RUNS_CHANNEL,
    AnySelect,
    const,
    in_statuses,
    json_param,
)

__all__ = [
    "commit_step",
    "effect_by_key",
    "finished_effects",
    "insert_run",
    "intend_for_stopping_run",
    "intend_without_run",
    "list_effects",
    "list_runs",
    "next_step_head",
    "run_with_steps",
]

_RUN_ID = bindparam("run_id", type_=UUID(as_uuid=True))


def insert_run(*, notify: bool) -> AnySelect:
    """Insert one run (parameters named like the columns) and return it.

    A run with a ``key`` another run holds is not inserted (no row returned):
    one run per business key.
    """
    ins = (
        pg_insert(runs)
        .values(
            id=bindparam("id"),
            agent=bindparam("agent"),
            agent_version=bindparam("agent_version"),
            inputs=json_param("inputs"),
            inputs_hash=bindparam("inputs_hash"),
            status=const(RunStatus.RUNNABLE.value),
            budget=bindparam("budget", type_=Numeric),
            key=bindparam("key", type_=Text),
            priority=bindparam("priority", type_=Integer),
            fairness_key=bindparam("fairness_key", type_=Text),
            dry_run=bindparam("dry_run"),
            trace_parent=bindparam("trace_parent", type_=Text),
        )
        .on_conflict_do_nothing(index_elements=[runs.c.key], index_where=runs.c.key.isnot(None))
        .returning(*runs.c)
        .cte("ins")
    )
    columns: list[ColumnElement[object]] = list(ins.c)
    if notify:
        columns.append(func.pg_notify(RUNS_CHANNEL, "").label("notified"))
    return select(*columns)


_EFFECT_FIELDS = (
    column("id", UUID(as_uuid=True)),
    column("step_index", Integer),
    column("kind", Text),
    column("payload", JSONB),
    column("payload_hash", Text),
    column("schema_version", Integer),
    column("idempotency_key", Text),
    column("ordering_key", Text),
    column("max_attempts", Integer),
    column("compensate", JSONB),
    column("compensates", UUID(as_uuid=True)),
    column("cost", Numeric),
    column("delay_seconds", Float),
    column("priority", Integer),
    column("fairness_key", Text),
    # the intent's own approval policy (JSON), if it asked for one
    column("approval", JSONB),
    column("trace_parent", Text),
)

_EFFECT_INSERT_COLUMNS = [
    "id",
    "run_id",
    "step_id",
    "step_index",
    "kind",
    "payload",
    "payload_hash",
    "schema_version",
    "idempotency_key",
    "ordering_key",
    "max_attempts",
    "compensate",
    "compensates",
    "cost",
    "priority",
    "fairness_key",
    "status",
    "available_at",
    "approval",
    "approval_deadline",
    "trace_parent",
]


def _effect_rows() -> TableValuedAlias:
    """The ``:effects`` parameter (a JSON array of intents) as a typed row set."""
    return (
        func.jsonb_to_recordset(json_param("effects"))
        .table_valued(*_EFFECT_FIELDS)
        .render_derived(name="e", with_types=True)
    )


def _effect_select(
    rows: TableValuedAlias,
    run_id: ColumnElement[Any],
    status: ColumnElement[Any] | None = None,
    *,
    after: Sequence[Any] = (),
) -> AnySelect:
    """The rows to insert: each intent, held as ``awaiting_approval`` when a gate applies.

    The gates of ``outbox_gates`` are evaluated here, in the statement that
    writes the intent: no round trip, and no writer can skip them. A matching
    config gate wins over the intent's own policy (an intent can add a gate,
    never loosen one). With no gate for the kind this is one probe of an
    index on a small table. ``status`` is the status of an intent no gate
    holds (``pending``, or ``paused`` while a pause waits for its step);
    ``after`` are the row sets (one row each) the insert must follow.
    """
    # The gate's policy is built once, in the lateral row (never NULL when a gate
    # matched). Spelled out four times, the statement grew past the length psycopg
    # caches the parsing of (4096 characters), which cost every step client CPU.
    gate = (
        select(
            func.jsonb_build_object(
                const("gate"),
                gates.c.name,
                const("timeout"),
                gates.c.timeout_seconds,
                const("on_timeout"),
                gates.c.on_timeout,
                const("escalate_to"),
                gates.c.escalate_to,
                type_=JSONB,
            ).label("policy")
        )
        .where(
            gates.c.kind == rows.c.kind,
            func.outbox_gate_matches(gates.c.conditions, rows.c.payload, type_=Boolean),
        )
        .order_by(gates.c.name)
        .limit(literal_column("1", Integer))
        .lateral("gate")
    )
    policy = func.coalesce(gate.c.policy, rows.c.approval, type_=JSONB)
    held = policy.is_not(None)
    source = rows.outerjoin(gate, true())
    for earlier in after:
        source = source.join(earlier, true())
    return select(
        rows.c.id,
        run_id,
        bindparam("step_id", type_=Text),
        rows.c.step_index,
        rows.c.kind,
        # A JSON null payload reads back from the recordset as SQL NULL: store it as JSON.
        func.coalesce(rows.c.payload, literal_column("'null'::jsonb", JSONB)),
        rows.c.payload_hash,
        rows.c.schema_version,
        rows.c.idempotency_key,
        rows.c.ordering_key,
        rows.c.max_attempts,
        rows.c.compensate,
        rows.c.compensates,
        rows.c.cost,
        rows.c.priority,
        rows.c.fairness_key,
        case(
            (held, const("awaiting_approval")),
            else_=const("pending") if status is None else status,
        ),
        func.now() + rows.c.delay_seconds * text("interval '1 second'"),
        policy,
        case(
            (
                held,
                func.now()
                + cast(policy.op("->>")(const("timeout")), Float) * text("interval '1 second'"),
            ),
            else_=null(),
        ),
        rows.c.trace_parent,
    ).select_from(source)


def next_step_head(
    step_id: Any, kind: Any, result: Any, error: Any, state: Any = None, plan: Any = None
) -> ColumnElement[Any]:
    """The run's new step-chain head once this step completes (an ``outbox_runs`` SET value).

    Computed by the statement that records the step, so chaining costs no round
    trip; the step row stores the same value as its ``hash``. ``state`` and
    ``plan`` are what the step row stores (``None``: SQL NULL, as a wait's row
    has): the link covers them (``outbox_step_hash_v2``), so a fork cannot be
    made to restart from values edited by hand.
    """
    previous = func.coalesce(
        runs.c.step_head, func.outbox_run_genesis(runs.c.id, runs.c.agent, runs.c.inputs_hash)
    )
    return func.outbox_step_hash_v2(
        previous,
        runs.c.id,
        step_id,
        kind,
        result,
        error,
        null() if state is None else state,
        null() if plan is None else plan,
        func.now(),
        type_=BYTEA,
    )


@cache
def commit_step(*, fenced: bool, notify: bool, ledger: bool = False) -> AnySelect:
    """Checkpoint one step and insert its intents, all in one statement.

    Parameters: ``run_id``, ``step_id``, ``kind``, ``step_result``,
    ``new_state`` and ``new_plan`` (JSON text; ``NULL`` keeps the stored
    value), ``effects`` (JSON array), ``debit`` (budget spent by the step),
    ``reserve`` (budget held for costly intents); with ``fenced``, also
    ``fence_owner`` and ``fence_attempt``; with ``ledger``, also ``ledger``
    (JSON array of budget ledger entries). (No parameter is named like a
    column of ``outbox_runs``: SQLAlchemy would add it to the UPDATE's SET.)

    Returns one row ``(run_ok, step_seq, inserted, paused)``: ``run_ok`` is 0
    when the run is missing, ended, paused, over budget or (fenced) leased by
    someone else; ``step_seq`` is the new step's; ``inserted`` counts intents written;
    ``paused`` is true when a pause waits for this step (its intents are then
    written ``paused``, not ``pending``). Each part only happens when the one
    before it did, so a failed check writes nothing. The step row keeps the
    state and plan it set, so a fork can start from any step.

    A step recorded already (a racing process won) or an intent key another
    effect holds fails the statement with a unique violation on
    ``outbox_steps_pkey`` or ``outbox_effects_idempotency_key``: the
    transaction is lost either way, and plain inserts write less WAL than
    ``ON CONFLICT`` (whose speculative insertions log a confirm record per row).
    """
    conditions: list[ColumnElement[bool] | TextClause] = [
        runs.c.id == _RUN_ID,
        ACTIVE_CONDITION,
        (runs.c.budget.is_(None))
        | (
            runs.c.spent
            + runs.c.reserved
            + bindparam("debit", type_=Numeric)
            + bindparam("reserve", type_=Numeric)
            <= runs.c.budget
        ),
    ]
    if fenced:
        conditions += [
            runs.c.lease_owner == bindparam("fence_owner"),
            runs.c.attempt == bindparam("fence_attempt"),
        ]
    run_upd = (
        runs.update()
        .where(*conditions)
        .values(
            state=func.coalesce(json_param("new_state"), runs.c.state),
            plan=func.coalesce(json_param("new_plan"), runs.c.plan),
            current_step=bindparam("step_id", type_=Text),
            spent=runs.c.spent + bindparam("debit", type_=Numeric),
            reserved=runs.c.reserved + bindparam("reserve", type_=Numeric),
            # updated_at is left alone: it is indexed, and a step's update must stay
            # HOT (no index touched); it tracks lifecycle changes, steps have their own time.
            step_head=next_step_head(
                bindparam("step_id", type_=Text),
                bindparam("kind", type_=Text),
                json_param("step_result"),
                null(),
                json_param("new_state"),
                json_param("new_plan"),
            ),
        )
        .returning(runs.c.id, runs.c.step_head, runs.c.paused_at.isnot(None).label("paused"))
        .cte("run_upd")
    )
    step_ins = (
        pg_insert(steps)
        .from_select(
            ["run_id", "step_id", "kind", "result", "state", "plan", "hash"],
            select(
                run_upd.c.id,
                bindparam("step_id", type_=Text),
                bindparam("kind", type_=Text),
                json_param("step_result"),
                json_param("new_state"),
                json_param("new_plan"),
                run_upd.c.step_head,
            ),
        )
        # No ON CONFLICT: a step recorded before is a replay the caller detects, and a
        # racing writer's step is a unique violation (Store.commit_step says which);
        # a speculative insertion costs WAL (a confirm record per row) on every step.
        .returning(steps.c.seq)
        .cte("step_ins")
    )
    rows = _effect_rows()
    # A pause that waits for this step holds its intents (resume releases them).
    paused = case((run_upd.c.paused, const("paused")), else_=const("pending"))
    eff_ins = (
        pg_insert(effects)
        .from_select(
            _EFFECT_INSERT_COLUMNS,
            _effect_select(rows, _RUN_ID, paused, after=(step_ins, run_upd)),
        )
        # A key taken already is a conflict (G5), raised as a unique violation.
        .returning(effects.c.id)
        .cte("eff_ins")
    )
    columns: list[ColumnElement[object]] = [
        select(func.count()).select_from(run_upd).scalar_subquery().label("run_ok"),
        select(step_ins.c.seq).scalar_subquery().label("step_seq"),
        select(func.count()).select_from(eff_ins).scalar_subquery().label("inserted"),
        select(run_upd.c.paused).scalar_subquery().label("paused"),
    ]
    if ledger:
        entries = (
            func.jsonb_to_recordset(json_param("ledger"))
            .table_valued(
                column("entry", Text),
                column("reason", Text),
                column("amount", Numeric),
                column("effect_id", UUID(as_uuid=True)),
            )
            .render_derived(name="l", with_types=True)
        )
        ledger_ins = (
            pg_insert(budget_ledger)
            .from_select(
                ["run_id", "step_id", "effect_id", "reason", "entry", "amount"],
                select(
                    _RUN_ID,
                    bindparam("step_id", type_=Text),
                    entries.c.effect_id,
                    entries.c.reason,
                    entries.c.entry,
                    entries.c.amount,
                )
                .select_from(entries)
                .join(step_ins, true()),
            )
            .returning(budget_ledger.c.id)
            .cte("ledger_ins")
        )
        columns.append(
            select(func.count()).select_from(ledger_ins).scalar_subquery().label("ledger")
        )
    if notify:
        columns.append(func.pg_notify(EFFECTS_CHANNEL, "").label("notified"))
    return select(*columns)


@cache
def intend_without_run(*, notify: bool) -> AnySelect:
    """Insert intents that belong to no run (plain outbox use); returns the ids inserted."""
    rows = _effect_rows()
    eff_ins = (
        pg_insert(effects)
        .from_select(
            _EFFECT_INSERT_COLUMNS,
            _effect_select(rows, literal(None, UUID(as_uuid=True))),
        )
        .on_conflict_do_nothing(constraint="outbox_effects_idempotency_key")
        .returning(effects.c.id)
        .cte("eff_ins")
    )
    columns: list[ColumnElement[object]] = [
        select(func.count()).select_from(eff_ins).scalar_subquery().label("inserted")
    ]
    if notify:
        columns.append(func.pg_notify(EFFECTS_CHANNEL, "").label("notified"))
    return select(*columns)


@cache
def intend_for_stopping_run() -> AnySelect:
    """Insert intents of a run that no longer takes steps (its compensations)."""
    rows = _effect_rows()
    eff_ins = (
        pg_insert(effects)
        .from_select(_EFFECT_INSERT_COLUMNS, _effect_select(rows, _RUN_ID))
        .on_conflict_do_nothing(constraint="outbox_effects_idempotency_key")
        .returning(effects.c.id)
        .cte("eff_ins")
    )
    return select(
        select(func.count()).select_from(eff_ins).scalar_subquery().label("inserted"),
        func.pg_notify(EFFECTS_CHANNEL, "").label("notified"),
    )


def effect_by_key() -> AnySelect:
    """The effect holding ``:key``, if any."""
    return select(effects).where(effects.c.idempotency_key == bindparam("key"))


def run_with_steps(*, one_step: bool = False) -> tuple[AnySelect, AnySelect]:
    """The run ``:run_id`` and its recorded steps in order (``one_step``: only ``:step_id``)."""
    steps_q = select(steps).where(steps.c.run_id == bindparam("run_id"))
    if one_step:
        steps_q = steps_q.where(steps.c.step_id == bindparam("step_id"))
    return (select(runs).where(runs.c.id == bindparam("run_id")), steps_q.order_by(steps.c.seq))


def list_runs(
    *,
    status: str | None = None,
    agent: str | None = None,
    limit: int = 100,
    before: object = None,
) -> AnySelect:
    """Most recent runs first, optionally filtered; ``before`` (a run id): the page after it."""
    query = select(runs).order_by(runs.c.created_at.desc(), runs.c.id.desc()).limit(limit)
    if before is not None:
        since = select(runs.c.created_at).where(runs.c.id == before).scalar_subquery()
        query = query.where(tuple_(runs.c.created_at, runs.c.id) < tuple_(since, before))
    if status is not None:
        query = query.where(runs.c.status == status)
    if agent is not None:
        query = query.where(runs.c.agent == agent)
    return query


def list_effects(
    *,
    run_id: object = None,
    step_id: str | None = None,
    status: str | None = None,
    kind: str | None = None,
    limit: int = 100,
    newest_first: bool = False,
    before: object = None,
) -> AnySelect:
    """Effects in intent order, optionally filtered by run (and step), status or kind.

    ``newest_first`` reverses the order; ``before`` (an effect id) starts the
    page after that effect, in the same order.
    """
    order = effects.c.seq.desc() if newest_first else effects.c.seq
    query = select(effects).order_by(order).limit(limit)
    if before is not None:
        anchor = select(effects.c.seq).where(effects.c.id == before).scalar_subquery()
        query = query.where(effects.c.seq < anchor if newest_first else effects.c.seq > anchor)
    if run_id is not None:
        query = query.where(effects.c.run_id == run_id)
    if step_id is not None:
        query = query.where(effects.c.step_id == step_id)
    if status is not None:
        query = query.where(effects.c.status == status)
    if kind is not None:
        query = query.where(effects.c.kind == kind)
    return query


def finished_effects() -> AnySelect:
    """Of the effects ``:ids``, those that can no longer change by delivery (one index probe each).

    Awaiting effects (``outbox serve``'s long poll) asks this for every awaited
    id at once, so a hundred waiters cost one query per poll, not a hundred.
    """
    ids = bindparam("ids", type_=postgresql_array(UUID(as_uuid=True)))
    return select(effects).where(
        effects.c.id == func.any(ids),
        in_statuses(effects.c.status, TERMINAL_EFFECT_STATUSES),
    )
