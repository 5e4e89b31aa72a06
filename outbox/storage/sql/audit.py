"""Statements of ``outbox check``: the audit of a whole scratch database, and a dead owner's leases.

The audit reads every row of a table: it is meant for the small databases a
check or a chaos test makes, never for a production one.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from sqlalchemy import Text, bindparam, func, select

from outbox.models import EffectStatus, RunStatus
from outbox.storage.schema import effect_attempts, effects, runs, steps
from outbox.storage.sql.common import AnySelect, const

__all__ = [
    "all_attempts",
    "all_effects",
    "all_steps",
    "effect_kinds",
    "effect_status_counts",
    "expire_effect_leases",
    "expire_run_leases",
]


@cache
def all_effects() -> AnySelect:
    """Every intent, in intent order, with what an audit compares."""
    return select(
        effects.c.id,
        effects.c.idempotency_key,
        effects.c.kind,
        effects.c.status,
        effects.c.attempt,
        effects.c.payload,
        effects.c.run_id,
        effects.c.step_id,
    ).order_by(effects.c.seq)


@cache
def all_attempts() -> AnySelect:
    """Every attempt-log row, in the order it was written."""
    return select(
        effect_attempts.c.id,
        effect_attempts.c.effect_id,
        effect_attempts.c.attempt,
        effect_attempts.c.outcome,
        effect_attempts.c.worker,
        effect_attempts.c.detail,
    ).order_by(effect_attempts.c.id)


@cache
def all_steps() -> AnySelect:
    """Every step record (completed and waiting), in the order they were written."""
    return select(steps.c.run_id, steps.c.step_id, steps.c.kind, steps.c.status).order_by(
        steps.c.seq
    )


@cache
def effect_status_counts() -> AnySelect:
    """Effects per status (every status present)."""
    return select(effects.c.status, func.count()).group_by(effects.c.status)


@cache
def effect_kinds() -> AnySelect:
    """The effect kinds intended so far."""
    return select(effects.c.kind).distinct().order_by(effects.c.kind)


@cache
def expire_run_leases() -> Any:
    """End now the leases on runs held by owners matching ``:owner_pattern`` (SQL LIKE).

    For a process known to be dead (its exit was seen): its leases would run
    out anyway; ending them now lets the usual rescue take its runs at once.
    """
    return (
        runs.update()
        .where(
            runs.c.status == const(RunStatus.RUNNING),
            runs.c.lease_owner.like(bindparam("owner_pattern", type_=Text)),
        )
        .values(lease_expires_at=func.now())
        .returning(runs.c.id)
    )


@cache
def expire_effect_leases() -> Any:
    """The same for effects in flight: the reconciler resolves them at its next pass."""
    return (
        effects.update()
        .where(
            effects.c.status == const(EffectStatus.IN_FLIGHT),
            effects.c.lease_owner.like(bindparam("owner_pattern", type_=Text)),
        )
        .values(lease_expires_at=func.now())
        .returning(effects.c.id)
    )
