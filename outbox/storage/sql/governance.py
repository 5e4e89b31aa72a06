"""The SQL of effect governance: approval gates, decisions and deadlines, read-back notes, audit.

Every decision about a held effect is a compare-and-set on ``awaiting_approval``
written to the attempt log in the same statement, so a decision is taken once
and is part of the effect's hash chain.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Integer,
    SmallInteger,
    Text,
    and_,
    any_,
    bindparam,
    delete,
    func,
    null,
    select,
)
from sqlalchemy.dialects.postgresql import JSONB, UUID
from sqlalchemy.dialects.postgresql import insert as pg_insert

from outbox.storage.schema import blobs, effect_attempts, effects, gates, runs, steps
from outbox.storage.sql.attempt_log import log_changes
from outbox.storage.sql.common import (
    AnySelect,
    const,
    json_param,
    shard_of,
    woken_run,
)

__all__ = [
    "approve_held",
    "attempts_of_effects",
    "attempts_of_run",
    "audit_run",
    "delete_gates",
    "due_approvals",
    "effect_run",
    "effect_shard",
    "effects_outside_runs",
    "escalate_held",
    "list_gates",
    "lock_effect",
    "log_effect_event",
    "note_attempt",
    "recorded_result",
    "reject_held",
    "run_effects",
    "run_steps",
    "upsert_gate",
]

_EFFECT_ID = bindparam("effect_id", type_=UUID(as_uuid=True))
# Every statement on one held effect names its shard too (RunTx looks it up once):
# on Citus a row locked or changed by id alone would be a statement on every shard.
_EFFECT_SHARD = bindparam("effect_shard", type_=SmallInteger)
_ONE_EFFECT = and_(effects.c.id == _EFFECT_ID, effects.c.shard == _EFFECT_SHARD)
_RUN_ID = bindparam("run_id", type_=UUID(as_uuid=True))
_RUN_SHARD = shard_of(_RUN_ID)


@cache
def effect_shard(*, named: bool = False) -> AnySelect:
    """The shard ``:effect_id`` is stored on (no row: none).

    ``named``: only if that is ``:effect_shard`` (on Citus a read of that shard
    alone, where the effect's id says it lives).
    """
    return select(effects.c.shard).where(_ONE_EFFECT if named else effects.c.id == _EFFECT_ID)


def effect_run() -> AnySelect:
    """The run of the effect ``:effect_id`` (read, not locked)."""
    return select(effects.c.run_id).where(_ONE_EFFECT)


def lock_effect() -> AnySelect:
    """The effect ``:effect_id`` locked until commit, with whether its approval deadline passed."""
    return (
        select(
            effects.c.id,
            effects.c.run_id,
            effects.c.kind,
            effects.c.status,
            effects.c.payload,
            effects.c.payload_hash,
            # what payload_hash must be: the sha256 of the payload's own text, now
            func.encode(
                func.sha256(func.convert_to(_value_text(effects.c.payload, _EFFECT_SHARD), "UTF8")),
                "hex",
            ).label("payload_digest"),
            effects.c.attempt,
            effects.c.approval,
            effects.c.approval_deadline,
            func.coalesce(effects.c.approval_deadline <= func.now(), False).label("due"),
        )
        .where(_ONE_EFFECT)
        .with_for_update()
    )


def _held_change(values: dict[str, Any]) -> Any:
    return (
        effects.update()
        .where(_ONE_EFFECT, effects.c.status == const("awaiting_approval"))
        .values(**values, updated_at=func.now())
        .returning(
            effects.c.id,
            effects.c.attempt,
            effects.c.attempt_started_at,
            effects.c.awaited_by,
            effects.c.shard,
        )
        .cte("changed")
    )


@cache
def approve_held(sharded: bool = False) -> Any:
    """Release a held effect to ``pending`` (deliverers claim it now); logged as ``approved``.

    Parameters: ``effect_id``, ``approver``, ``detail`` (JSON). Returns one row when it changed.
    """
    changed = _held_change(
        {"status": const("pending"), "available_at": func.now(), "approval_deadline": null()}
    )
    return log_changes(
        changed,
        worker=bindparam("approver", type_=Text),
        outcome=const("approved"),
        detail=json_param("detail"),
        sharded=sharded,
    )


@cache
def reject_held(sharded: bool = False) -> Any:
    """End a held effect as ``rejected``; a run parked on it goes on (and sees the rejection).

    Parameters: ``effect_id``, ``approver``, ``note``, ``outcome`` (``rejected`` or
    ``timed_out``), ``detail`` (JSON).
    """
    changed = _held_change(
        {
            "status": const("rejected"),
            "completed_at": func.now(),
            "approval_deadline": null(),
            "last_error": bindparam("note", type_=Text),
        }
    )
    woken = (
        runs.update()
        .where(
            runs.c.id == changed.c.awaited_by,
            # on Citus the effect's shard, named so the statement is routed: a run there
            # wakes when it awaits an effect of its own shard (docs/howto/citus.md)
            runs.c.shard == (_EFFECT_SHARD if sharded else shard_of(changed.c.awaited_by)),
            runs.c.status == const("waiting"),
            runs.c.wait_effect == changed.c.id,
        )
        .values(woken_run("wait_effect"))
        .returning(runs.c.id)
        .cte("woken")
    )
    return log_changes(
        changed,
        worker=bindparam("approver", type_=Text),
        outcome=bindparam("outcome", type_=Text),
        detail=json_param("detail"),
        sharded=sharded,
    ).add_cte(woken)


@cache
def escalate_held(sharded: bool = False) -> Any:
    """A held effect's deadline passed with ``on_timeout = escalate``: it waits on, undated.

    Parameters: ``effect_id``, ``approver`` (who logs it), ``detail`` (JSON).
    """
    changed = _held_change(
        {
            "approval_deadline": null(),
            "approval": effects.c.approval.op("||")(
                func.jsonb_build_object("escalated_at", func.now())
            ),
        }
    )
    return log_changes(
        changed,
        worker=bindparam("approver", type_=Text),
        outcome=const("timed_out"),
        detail=json_param("detail"),
        sharded=sharded,
    )


@cache
def log_effect_event() -> Any:
    """Log a row about an effect that changes nothing else (a refused approval, a timeout).

    Parameters: ``effect_id``, ``worker``, ``outcome``, ``detail`` (JSON).
    """
    return pg_insert(effect_attempts).from_select(
        ["effect_id", "attempt", "worker", "outcome", "detail", "shard"],
        select(
            effects.c.id,
            effects.c.attempt,
            bindparam("worker", type_=Text),
            bindparam("outcome", type_=Text),
            json_param("detail"),
            effects.c.shard,
        ).where(_ONE_EFFECT),
    )


def due_approvals(sharded: bool = False) -> AnySelect:
    """Held effects whose approval deadline passed (by index), at most ``max_rows``.

    Returns id, shard and run_id, oldest deadline first (then by id, so two sweeps
    meet them in one order). Not locked: the caller locks each one's run's unstarted
    effects first and then the effect, as every path that may cancel the run does.
    ``sharded`` (Citus): of shard ``:on_shard`` only.
    """
    return (
        select(effects.c.id, effects.c.shard, effects.c.run_id)
        .where(
            effects.c.status == const("awaiting_approval"),
            effects.c.approval_deadline <= func.now(),
            *([effects.c.shard == bindparam("on_shard", type_=SmallInteger)] if sharded else []),
        )
        .order_by(effects.c.approval_deadline, effects.c.id)
        .limit(bindparam("max_rows", type_=Integer))
    )


# -- gates ------------------------------------------------------------------------------


@cache
def upsert_gate() -> Any:
    """Insert or replace one gate (parameters named like the columns, ``conditions`` as JSON)."""
    ins = pg_insert(gates).values(
        name=bindparam("name", type_=Text),
        kind=bindparam("kind", type_=Text),
        conditions=json_param("conditions"),
        timeout_seconds=bindparam("timeout_seconds"),
        on_timeout=bindparam("on_timeout", type_=Text),
        escalate_to=bindparam("escalate_to", type_=Text),
        # in VALUES, not in DO UPDATE SET: Citus refuses a non-immutable function there
        updated_at=func.now(),
    )
    return ins.on_conflict_do_update(
        index_elements=[gates.c.name],
        set_={
            "kind": ins.excluded.kind,
            "conditions": ins.excluded.conditions,
            "timeout_seconds": ins.excluded.timeout_seconds,
            "on_timeout": ins.excluded.on_timeout,
            "escalate_to": ins.excluded.escalate_to,
            "updated_at": ins.excluded.updated_at,
        },
    ).returning(gates.c.name)


def delete_gates(*, keep: bool) -> Any:
    """Delete the gates named in ``:names`` (or, with ``keep``, every gate not named there)."""
    named = gates.c.name == any_(bindparam("names", type_=ARRAY(Text)))
    return delete(gates).where(~named if keep else named).returning(gates.c.name)


def list_gates() -> AnySelect:
    """Every gate by name."""
    return select(gates).order_by(gates.c.name)


# -- read-back notes --------------------------------------------------------------------


@cache
def note_attempt(named: bool = False) -> Any:
    """A deliverer notes what it needs to ask the sink later, before it calls (fenced).

    Parameters: ``effect_id``, ``expected_attempt``, ``owner``, ``note`` (JSON with
    ``attempt``), and when ``named`` ``effect_shard`` (where the claim found it).
    Returns the id when the attempt is still this owner's.
    """
    return (
        effects.update()
        .where(
            _ONE_EFFECT if named else effects.c.id == _EFFECT_ID,
            effects.c.attempt == bindparam("expected_attempt", type_=Integer),
            effects.c.status == const("in_flight"),
            effects.c.lease_owner == bindparam("owner", type_=Text),
        )
        .values(attempt_note=json_param("note"))
        .returning(effects.c.id)
    )


# -- dry runs ---------------------------------------------------------------------------


def recorded_result() -> AnySelect:
    """The result a real run recorded for the intent a dry-run effect stands for.

    The real run is the newest live run of the same agent with the same inputs
    (``inputs_hash``) that has a succeeded effect at the same step and index.
    """
    dry = effects.alias("dry")
    dry_run = runs.alias("dry_run")
    real = effects.alias("real")
    real_run = runs.alias("real_run")
    return (
        select(real.c.result)
        .select_from(
            dry.join(dry_run, dry_run.c.id == dry.c.run_id)
            .join(
                real_run,
                and_(
                    real_run.c.agent == dry_run.c.agent,
                    real_run.c.inputs_hash == dry_run.c.inputs_hash,
                    real_run.c.dry_run.is_(False),
                ),
            )
            .join(
                real,
                and_(
                    real.c.run_id == real_run.c.id,
                    real.c.step_id == dry.c.step_id,
                    real.c.step_index == dry.c.step_index,
                    real.c.status == const("succeeded"),
                ),
            )
        )
        .where(dry.c.id == _EFFECT_ID)
        .order_by(real_run.c.created_at.desc())
        .limit(1)
    )


# -- audit ------------------------------------------------------------------------------


def _stored(column: Any, shard: Any) -> Any:
    """The text of the blob a reference names, on ``shard`` (NULL for a value, or one gone).

    Given as the statement's own shard (a parameter), not the row's column, Citus
    routes even a ``FOR UPDATE`` to that one shard: the value's owner keeps it there.
    """
    return (
        select(blobs.c.data)
        .where(blobs.c.shard == shard, blobs.c.sha256 == func.outbox_reference_sha(column))
        .limit(1)
        .scalar_subquery()
    )


def _value_text(column: Any, shard: Any) -> Any:
    """The text a link hashes for a stored value: its own, or its blob's as stored (v3 links).

    (``outbox_value_text``'s, read here unchecked: the audit hashes every
    referenced blob itself and reports an altered or missing one as a break,
    rather than stop at the first; a reference whose blob is gone keeps its own
    text, which no link matches.)
    """
    return func.coalesce(_stored(column, shard), column.cast(Text))


def _rendered_text(column: Any, shard: Any) -> Any:
    """A reference's blob as PostgreSQL renders it (``data::jsonb::text``); NULL for a value.

    What a wait's or a fork's link hashed before migration 0036, for a value the
    client stored as canonical JSON: such links still verify by it.
    """
    return _stored(column, shard).cast(JSONB).cast(Text)


def _effect_texts(shard: Any) -> list[Any]:
    """An effect's payload's own text (its digest's) and its result's (the attempt log's)."""
    return [
        _value_text(effects.c.payload, shard).label("payload_text"),
        effects.c.result.cast(Text).label("result_text"),
    ]


def audit_run() -> AnySelect:
    """The run ``:run_id`` with its inputs' own text (what ``inputs_hash`` is the sha256 of)."""
    return select(runs, _value_text(runs.c.inputs, _RUN_SHARD).label("inputs_text")).where(
        runs.c.id == _RUN_ID, runs.c.shard == _RUN_SHARD
    )


def run_steps() -> AnySelect:
    """A run's steps with the ``jsonb`` texts their chain hashes (result, error, state, plan).

    ``<field>_text`` is the text as stored (v1 and v2 links), ``<field>_value_text``
    the value's own (v3 links: a reference read back).
    """
    return (
        select(
            steps,
            steps.c.result.cast(Text).label("result_text"),
            steps.c.error.cast(Text).label("error_text"),
            steps.c.state.cast(Text).label("state_text"),
            steps.c.plan.cast(Text).label("plan_text"),
            _value_text(steps.c.result, _RUN_SHARD).label("result_value_text"),
            _value_text(steps.c.error, _RUN_SHARD).label("error_value_text"),
            _value_text(steps.c.state, _RUN_SHARD).label("state_value_text"),
            _value_text(steps.c.plan, _RUN_SHARD).label("plan_value_text"),
            *(
                _rendered_text(steps.c[f], _RUN_SHARD).label(f"{f}_rendered_text")
                for f in ("result", "error", "state", "plan")
            ),
        )
        .where(*_of_run(steps))
        .order_by(steps.c.seq)
    )


def run_effects() -> AnySelect:
    """A run's effects in intent order, with their payload's and result's texts (``:run_id``)."""
    return (
        select(effects, *_effect_texts(_RUN_SHARD)).where(*_of_run(effects)).order_by(effects.c.seq)
    )


def attempts_of_run() -> AnySelect:
    """The attempt-log rows of a run's effects, with ``detail::text``, by effect then id."""
    return (
        select(effect_attempts, effect_attempts.c.detail.cast(Text).label("detail_text"))
        .select_from(
            effect_attempts.join(
                effects,
                and_(
                    effects.c.id == effect_attempts.c.effect_id,
                    effects.c.shard == effect_attempts.c.shard,
                ),
            )
        )
        .where(*_of_run(effects))
        .order_by(effect_attempts.c.effect_id, effect_attempts.c.id)
    )


def _of_run(table: Any) -> list[Any]:
    """Rows of the run ``:run_id``, on its shard (one shard's statement on Citus)."""
    return [table.c.run_id == _RUN_ID, table.c.shard == _RUN_SHARD]


def effects_outside_runs() -> AnySelect:
    """Effects of no run (``Outbox.transaction``), newest first, a page at a time.

    Parameters: ``before`` (the ``seq`` the previous page ended at; the first
    page passes one above any) and ``page_size``. Found by the ``(run_id, seq)`` index.
    """
    return (
        select(effects, *_effect_texts(effects.c.shard))
        .where(effects.c.run_id.is_(None), effects.c.seq < bindparam("before", type_=BigInteger))
        .order_by(effects.c.seq.desc())
        .limit(bindparam("page_size", type_=Integer))
    )


def attempts_of_effects() -> AnySelect:
    """The attempt-log rows of the effects ``:ids``, with ``detail::text``, by effect then id."""
    return (
        select(effect_attempts, effect_attempts.c.detail.cast(Text).label("detail_text"))
        .where(
            effect_attempts.c.effect_id == any_(bindparam("ids", type_=ARRAY(UUID(as_uuid=True))))
        )
        .order_by(effect_attempts.c.effect_id, effect_attempts.c.id)
    )
