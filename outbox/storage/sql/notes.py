"""Notes on pending effects no deliverer takes: an unknown kind, or held behind their ordering key.

A note goes in the effect's ``last_error`` and leaves its status alone; the
maintenance round writes and clears them, never the claim path.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from sqlalchemy import (
    ARRAY,
    ColumnElement,
    Float,
    Integer,
    SmallInteger,
    Text,
    all_,
    and_,
    bindparam,
    case,
    cast,
    func,
    null,
    select,
)
from sqlalchemy.dialects.postgresql import distinct_on

from outbox.models import OPEN_EFFECT_STATUSES
from outbox.storage.schema import effects
from outbox.storage.sql.common import SECONDS, const, in_statuses

__all__ = ["BLOCKED_NOTE_PREFIX", "mark_unknown_kinds", "note_blocked_by_order"]


def _of_shard(sharded: bool) -> list[ColumnElement[bool]]:
    """Of shard ``:on_shard`` only, when ``sharded`` (Citus: a statement names its shard)."""
    return [effects.c.shard == bindparam("on_shard", type_=SmallInteger)] if sharded else []


@cache
def mark_unknown_kinds(sharded: bool = False) -> Any:
    """Note on pending effects that no deliverer here knows their kind (status unchanged).

    Parameters: ``known`` (array of kinds), ``grace_seconds``, ``max_rows``, ``note_prefix``,
    and ``on_shard`` when ``sharded``.
    """
    note = func.concat(bindparam("note_prefix", type_=Text), effects.c.kind)
    # The note is made in the SELECT: Citus refuses a STABLE function (concat) over a
    # column in an UPDATE's SET.
    target = (
        select(effects.c.id, note.label("note"))
        .where(
            effects.c.status == const("pending"),
            effects.c.kind != all_(bindparam("known", type_=ARRAY(Text))),
            effects.c.created_at < func.now() - bindparam("grace_seconds", type_=Float) * SECONDS,
            effects.c.last_error.is_distinct_from(note),
            *_of_shard(sharded),
        )
        .limit(bindparam("max_rows", type_=Integer))
        .cte("target")
    )
    return (
        effects.update()
        .where(effects.c.id == target.c.id, *_of_shard(sharded))
        .values(last_error=target.c.note, updated_at=func.now())
        .returning(effects.c.id)
    )


#: How a note on an effect held back by its ordering key begins (so a later
#: round recognises its own note and clears it when the block is gone).
BLOCKED_NOTE_PREFIX = "waiting behind effect "


@cache
def note_blocked_by_order(sharded: bool = False) -> Any:
    """Note on pending effects held back by their ordering key which effect holds them, and why.

    Parameters: ``grace_seconds`` (how long an effect must have been due
    before it is noted), ``max_rows``. The claim skips an effect while an
    earlier one of its ordering key is still open (pending, in flight,
    dispatched, unknown), whatever its kind: compensations rely on one key
    across kinds. So an undeliverable kind, an ``unknown`` effect or a long
    delay at the head of a key holds every later effect of that key. This
    statement makes that visible: such an effect's ``last_error`` names the
    head of its key (the earliest open effect), its kind, its state and its
    own last error. A note whose block is gone is cleared. Status unchanged;
    rows being claimed are skipped. Runs on the maintenance interval, never
    on the claim path. As the claim does, it holds a key across runs on one
    server, and to its shard with ``sharded`` (Citus; of shard ``:on_shard`` only).
    """
    e = effects
    p = effects.alias("open_keyed")
    # The head of each key: its earliest open effect. One pass over the partial
    # ordering index and a hash join beat an index probe per held effect (measured:
    # 200k held effects on 5k keys, a round that changes nothing: 0.66 s vs 1.6 s).
    keyed = [p.c.shard, p.c.ordering_key] if sharded else [p.c.ordering_key]
    head = (
        select(p.c.shard, p.c.ordering_key, p.c.seq, p.c.id, p.c.kind, p.c.status)
        .add_columns(p.c.available_at, p.c.last_error)
        .ext(distinct_on(*keyed))
        .where(
            p.c.ordering_key.is_not(None),
            in_statuses(p.c.status, OPEN_EFFECT_STATUSES),
            *([p.c.shard == bindparam("on_shard", type_=SmallInteger)] if sharded else []),
        )
        .order_by(*keyed, p.c.seq)
        .cte("head")
    )
    when = func.to_char(
        func.timezone(const("UTC"), head.c.available_at), const('YYYY-MM-DD"T"HH24:MI:SS"Z"')
    )
    retry_at = case(
        (
            and_(head.c.status == const("pending"), head.c.available_at > func.now()),
            func.concat(const(", next attempt at "), when),
        ),
        else_=const(""),
    )
    why = case(
        (
            and_(
                head.c.last_error.is_not(None),
                ~head.c.last_error.startswith(BLOCKED_NOTE_PREFIX, autoescape=True),
            ),
            func.concat(const(": "), func.left(head.c.last_error, 300)),
        ),
        else_=const(""),
    )
    note = case(
        (
            head.c.id.is_not(None),
            func.concat(
                const(BLOCKED_NOTE_PREFIX),
                cast(head.c.id, Text),
                const(" (kind "),
                head.c.kind,
                const(", "),
                head.c.status,
                retry_at,
                why,
                const(
                    "): effects sharing an ordering_key are delivered one at a time, "
                    "in intent order"
                ),
            ),
        ),
        (e.c.last_error.startswith(BLOCKED_NOTE_PREFIX, autoescape=True), null()),
        else_=e.c.last_error,
    )
    target = (
        select(e.c.id, note.label("note"))
        .select_from(
            e.outerjoin(
                head,
                and_(
                    *([head.c.shard == e.c.shard] if sharded else []),
                    head.c.ordering_key == e.c.ordering_key,
                    head.c.seq < e.c.seq,
                ),
            )
        )
        .where(
            *_of_shard(sharded),
            e.c.status == const("pending"),
            e.c.ordering_key.is_not(None),
            e.c.available_at < func.now() - bindparam("grace_seconds", type_=Float) * SECONDS,
            e.c.last_error.is_distinct_from(note),
        )
        .limit(bindparam("max_rows", type_=Integer))
        .with_for_update(of=e, skip_locked=True)
        .cte("target")
    )
    return (
        effects.update()
        # status again: the row may have been claimed since the snapshot was taken
        .where(
            effects.c.id == target.c.id, effects.c.status == const("pending"), *_of_shard(sharded)
        )
        .values(last_error=target.c.note, updated_at=func.now())
        .returning(effects.c.id)
    )
