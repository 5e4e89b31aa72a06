"""The claim / lease / fence mechanism, written once for both queues.

Two queues live in PostgreSQL: runnable runs (claimed by agent workers) and
pending effects (claimed by deliverers). Both carry ``status``,
``available_at``, ``lease_owner``, ``lease_expires_at`` and ``attempt``. A
claim takes rows with ``FOR UPDATE SKIP LOCKED`` in one statement, marks them
claimed and increments ``attempt``: the attempt number is the fencing token.
Both queues carry a priority and a fairness key; a claim takes higher
priorities first and shares its batch between fairness keys (see :func:`claim`).
Every later write about that attempt (heartbeat, completion, rescue) is a
compare-and-set on (status, owner, attempt), so a worker whose lease was taken
over changes nothing (the heartbeat's statement: :mod:`outbox.storage.sql.leases`).

The statements are pure functions returning SQLAlchemy Core; no parameter is
named like a column (SQLAlchemy would add it to an UPDATE's SET).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any, NamedTuple

from sqlalchemy import (
    ARRAY,
    Float,
    Integer,
    Numeric,
    SmallInteger,
    Table,
    Text,
    all_,
    any_,
    bindparam,
    cast,
    exists,
    func,
    literal_column,
    not_,
    or_,
    select,
    true,
    tuple_,
    union_all,
)
from sqlalchemy.dialects.postgresql import UUID
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.sql.expression import ColumnElement

from outbox.models import OPEN_EFFECT_STATUSES, EffectStatus, RunStatus
from outbox.storage.schema import effects, rate_limits, runs
from outbox.storage.sql.common import SECONDS, AnySelect, const, in_statuses

__all__ = [
    "EFFECT_QUEUE",
    "LANE",
    "RUN_QUEUE",
    "QueueSpec",
    "Rate",
    "claim",
    "claim_params",
    "partition_params",
    "ready_on_shard",
]


@dataclass(frozen=True)
class QueueSpec:
    """What differs between the two queues."""

    table: Table
    ready: str
    claimed: str
    #: Columns a claim is scoped by (one claim per kind, or per agent and version).
    partition: tuple[str, ...]
    order: tuple[str, ...]
    records_attempt_start: bool = False
    per_key_ordering: bool = False
    #: Columns a claim returns (None: all of them).
    returning: tuple[str, ...] | None = None
    #: On Citus: a claim names the one shard it reads (``part_shard``), so that it
    #: runs on the node holding it (``outbox.storage.citus``).
    sharded: bool = False


#: Within a partition, a claim shares the batch between lanes: higher priority
#: first, and equal shares between the fairness keys of one priority.
LANE = ("priority", "fairness_key")

EFFECT_QUEUE = QueueSpec(
    table=effects,
    ready=EffectStatus.PENDING,
    claimed=EffectStatus.IN_FLIGHT,
    partition=("kind",),
    order=("available_at", "seq"),
    records_attempt_start=True,
    per_key_ordering=True,
    # What a deliverer needs (outbox.storage.async_store.ClaimedEffect) and the order:
    # never the compensation, the last result or error, which can be large.
    returning=(
        "id",
        "seq",
        "run_id",
        "kind",
        "payload",
        "idempotency_key",
        "attempt",
        "max_attempts",
        "schema_version",
        "ordering_key",
        "created_at",
        "attempt_started_at",
        "lease_owner",
        "available_at",
        "priority",
        "fairness_key",
        # the intent's trace: each attempt is a span of it (outbox.tracing)
        "trace_parent",
        "shard",
    ),
)
RUN_QUEUE = QueueSpec(
    table=runs,
    ready=RunStatus.RUNNABLE,
    claimed=RunStatus.RUNNING,
    partition=("agent", "agent_version"),
    order=("available_at", "created_at"),
)


def _ordering_free(spec: QueueSpec, t: Any) -> ColumnElement[bool]:
    """No earlier effect with the same ordering key, of any run, is still open."""
    prior = effects.alias("prior")
    # On Citus only those of the claim's shard (a run's, or a run-less key's): a
    # sharded claim names its shard, and Citus routes by a value, not a join.
    on_shard = (
        [prior.c.shard == bindparam("part_shard", type_=SmallInteger)] if spec.sharded else []
    )
    blocked = exists().where(
        prior.c.ordering_key == t.c.ordering_key,
        *on_shard,
        prior.c.seq < t.c.seq,
        in_statuses(prior.c.status, OPEN_EFFECT_STATUSES),  # an open effect holds back its key,
    )
    return or_(t.c.ordering_key.is_(None), ~blocked)


def _int(value: int) -> Any:
    """An integer written into the SQL: a generic plan then knows a LIMIT 1 is one row."""
    return literal_column(str(int(value)), Integer)


def _ready(spec: QueueSpec, t: Any) -> list[ColumnElement[bool]]:
    """Ready rows of the partition: the status literal keeps the partial index usable."""
    ready = [
        t.c.status == const(spec.ready),
        *(t.c[name] == bindparam(f"part_{name}", type_=Text) for name in spec.partition),
    ]
    if spec.sharded:
        ready.append(t.c.shard == bindparam("part_shard", type_=SmallInteger))
    return ready


def _lanes(spec: QueueSpec) -> Any:
    """The lanes (priority, fairness key) holding ready rows: a loose index scan, one probe each."""
    t = spec.table
    first = (
        select(*(t.c[c] for c in LANE))
        .where(*_ready(spec, t))
        .order_by(*(t.c[c] for c in LANE))
        .limit(_int(1))
    )
    lanes = first.cte("lanes", recursive=True)
    nl = t.alias("nl")
    after = (
        select(*(nl.c[c] for c in LANE))
        .where(
            *_ready(spec, nl),
            tuple_(*(nl.c[c] for c in LANE)) > tuple_(*(lanes.c[c] for c in LANE)),
        )
        .order_by(*(nl.c[c] for c in LANE))
        .limit(_int(1))
        .lateral("nxt")
    )
    return lanes.union_all(
        select(*(after.c[c] for c in LANE)).select_from(lanes.join(after, true()))
    )


def _lane_pick(spec: QueueSpec, lane: Any, limit: Any, *, exclude: Any = None) -> Any:
    """Up to ``limit`` available rows of one lane in queue order, locked (skipping locked ones)."""
    t = spec.table
    conditions = [
        *_ready(spec, t),
        *(t.c[c] == lane.c[c] for c in LANE),
        t.c.available_at <= func.now(),
    ]
    if exclude is not None:
        conditions.append(t.c.id != all_(exclude))
    if spec.per_key_ordering:
        conditions.append(_ordering_free(spec, t))
    return (
        select(t.c.id, *(t.c[name] for name in spec.order))
        .where(*conditions)
        .order_by(*(t.c[name] for name in spec.order))
        .limit(limit)
        .with_for_update(skip_locked=True)
    )


def _rate_bucket() -> tuple[Any, Any]:
    """A kind's shared rate (GCRA): the row it locks, and how many rows a claim may take now.

    Parameters ``rate`` (per second) and ``burst`` (tokens available after idling).
    The row of ``outbox_rate_limits`` is locked for the claim, so concurrent claims of
    the kind take turns; a kind claimed for the first time starts with a full burst.
    """
    held = (
        select(rate_limits.c.tat)
        .where(rate_limits.c.kind == bindparam("part_kind", type_=Text))
        .with_for_update()
        .cte("held")
    )
    base = func.greatest(
        func.coalesce(select(held.c.tat).scalar_subquery(), func.now()), func.now()
    )
    behind = func.extract("epoch", base - func.now())
    tokens = func.floor(bindparam("burst", type_=Float) - behind * bindparam("rate", type_=Float))
    allowed = func.least(bindparam("claim_limit", type_=Integer), func.greatest(tokens, _int(0)))
    budget = select(cast(allowed, Integer).label("n")).cte("budget")
    return held, budget


def _claim_rows(spec: QueueSpec, picked: Any, multi: Any, held: Any) -> AnySelect:
    """Claim the ``picked`` ids; one row per claimed row (at least one), with ``multi_lane``.

    The rows are claimed by id, as one array (a generic plan cannot misjudge
    the batch's size). A claim that found nothing still returns one row (its
    claimed columns NULL) so ``multi_lane`` always reaches the caller. With
    ``held`` (a rated claim), the kind's rate bucket is charged for the rows.
    """
    t = spec.table
    values: dict[str, Any] = {
        "status": const(spec.claimed),
        "lease_owner": bindparam("owner", type_=Text),
        "lease_expires_at": func.now() + bindparam("lease_seconds", type_=Float) * SECONDS,
        "attempt": t.c.attempt + 1,
        "updated_at": func.now(),
    }
    if spec.records_attempt_start:
        values["attempt_started_at"] = func.now()
    returned = t.c if spec.returning is None else [t.c[name] for name in spec.returning]
    # cast: "= ANY ((SELECT ...))" compares with one array; "= ANY (SELECT ...)" with rows
    ids = cast(select(func.array_agg(picked.c.id)).scalar_subquery(), ARRAY(UUID(as_uuid=True)))
    target = [t.c.id == any_(ids)]
    if spec.sharded:
        target.append(t.c.shard == bindparam("part_shard", type_=SmallInteger))
    claimed = t.update().where(*target).values(**values).returning(*returned).cte("claimed")
    flag = select(multi.label("multi_lane")).cte("flag")
    rows: Any
    if "pos" in picked.c:  # the order the batch was picked in: round-robin between lanes
        rows = claimed.join(picked, picked.c.id == claimed.c.id)
        order: list[Any] = [picked.c.pos]
    else:
        rows = claimed
        order = [claimed.c.priority.desc(), *(claimed.c[name] for name in spec.order)]
    result = (
        select(claimed, flag.c.multi_lane)
        .select_from(flag.outerjoin(rows, true()))
        .order_by(*order)
    )
    if held is not None:
        charged = select(func.count()).select_from(claimed).scalar_subquery()
        base = func.greatest(
            func.coalesce(select(held.c.tat).scalar_subquery(), func.now()), func.now()
        )
        step = charged / bindparam("rate", type_=Float) * SECONDS
        ins = pg_insert(rate_limits).from_select(
            ["kind", "tat"],
            select(bindparam("part_kind", type_=Text), base + step).where(charged > _int(0)),
        )
        charge = ins.on_conflict_do_update(
            index_elements=[rate_limits.c.kind],
            set_={"tat": func.greatest(rate_limits.c.tat, func.now()) + step},
        ).cte("charge")
        result = result.add_cte(charge)
    return result


def _limit(rated: bool) -> tuple[Any, Any]:
    """The batch size (a rated claim's is what its rate allows now) and the rate row held."""
    if not rated:
        return bindparam("claim_limit", type_=Integer), None
    held, budget = _rate_bucket()
    return select(budget.c.n).scalar_subquery(), held


@cache
def claim(spec: QueueSpec, *, rated: bool = False, lanes: bool = False) -> AnySelect:
    """Claim up to ``claim_limit`` ready rows of one partition for ``owner``.

    Parameters: ``part_<column>`` for each partition column, ``claim_limit``,
    ``owner``, ``lease_seconds``; with ``rated`` (effects only), ``rate`` and
    ``burst``: the kind's declared rate, shared through ``outbox_rate_limits``.
    Returns the claimed rows, attempt incremented, highest priority first (then
    in queue order, or round-robin between lanes), each with ``multi_lane``:
    more than one lane (priority and fairness key) holds ready rows. A claim
    that took nothing returns one row of NULLs and the flag.

    Two statements, one per case. The plain one (``lanes=False``) finds the
    partition's last lane and whether an earlier one holds ready rows (two
    index probes); when none does (no priorities or fairness keys in use, or
    just one of each) it takes that lane's rows in ``order``, the claim as it
    always was. When one does it takes nothing and says ``multi_lane``: the
    caller claims again with the lanes statement (:func:`_lanes_pick`), and
    keeps using it while more than one lane holds rows
    (:class:`outbox.storage.claims.ClaimMode`). So a claim costs what it did
    as long as there is only one lane.
    """
    limit, held = _limit(rated)
    if lanes:
        picked, multi = _lanes_pick(spec, limit)
    else:
        picked, multi = _single_lane_pick(spec, limit)
    return _claim_rows(spec, picked, multi, held)


def _single_lane_pick(spec: QueueSpec, limit: Any) -> tuple[Any, Any]:
    """The rows of the partition's only lane in queue order, if only one lane holds ready rows.

    The index is read from its newest end for the last lane, then from that
    lane's first entry backwards for the lane before it: that probe stops at
    once when there is none, so of the entries claimed rows leave dead at the
    oldest end (until VACUUM) only the scan that takes the rows walks, once.

    The earlier lane is looked up with ``ORDER BY ... LIMIT 1``, in a CTE of
    its own, rather than as ``NOT EXISTS``: the planner guesses a third of
    the rows pass a row comparison, so for an ``EXISTS`` it chose a
    sequential scan expected to stop early, which with one lane (none pass)
    read the whole backlog, twice per claim: 0.4 s a claim with a million
    pending effects. An ordered ``LIMIT 1`` is always the index's.
    """
    t = spec.table
    last = (
        select(*(t.c[c] for c in LANE))
        .where(*_ready(spec, t))
        .order_by(*(t.c[c].desc() for c in LANE))
        .limit(_int(1))
        .cte("last_lane")
    )
    lane = {c: select(last.c[c]).scalar_subquery() for c in LANE}
    earlier = t.alias("earlier")
    before = (
        select(*(earlier.c[c] for c in LANE))
        .where(
            *_ready(spec, earlier),
            tuple_(*(earlier.c[c] for c in LANE)) < tuple_(*(lane[c] for c in LANE)),
        )
        .order_by(*(earlier.c[c].desc() for c in LANE))
        .limit(_int(1))
        .cte("earlier_lane")
    )
    one_lane = ~exists(select(before.c.priority))
    conditions = [
        *_ready(spec, t),
        *(t.c[c] == lane[c] for c in LANE),
        one_lane,
        t.c.available_at <= func.now(),
    ]
    if spec.per_key_ordering:
        conditions.append(_ordering_free(spec, t))
    picked = (
        select(t.c.id)
        .where(*conditions)
        .order_by(*(t.c[name] for name in spec.order))
        .limit(limit)
        .with_for_update(skip_locked=True)
        .cte("picked")
    )
    return picked, not_(one_lane)


def _lanes_pick(spec: QueueSpec, limit: Any) -> tuple[Any, Any]:
    """A batch shared between lanes: higher priority first, round-robin between fairness keys.

    It lists the partition's lanes (distinct priority and fairness key among
    ready rows, a loose index scan: one probe each), takes from each lane its
    share of the batch (the batch split evenly between the lanes of one
    priority), then, when some lanes had less than their share, more from the
    lanes that had their full share. Of those it keeps the batch by priority,
    then round-robin between lanes (each lane's first row, then each one's
    second...), so a backlog under one fairness key never holds back another.
    """
    lanes = _lanes(spec)
    sized = select(
        *(lanes.c[c] for c in LANE),
        cast(
            func.ceil(cast(limit, Numeric) / func.count().over(partition_by=lanes.c.priority)),
            Integer,
        ).label("share"),
    ).cte("sized")
    pick = _lane_pick(spec, sized, sized.c.share).lateral("pick")
    first = (
        select(*(sized.c[c] for c in LANE), sized.c.share, *pick.c)
        .select_from(sized.join(pick, true()))
        .cte("first")
    )
    full = (
        select(*(first.c[c] for c in LANE), func.array_agg(first.c.id).label("ids"))
        .group_by(*(first.c[c] for c in LANE), first.c.share)
        .having(func.count() == first.c.share)
        .cte("full_lanes")
    )
    room = select((limit - func.count()).label("n")).select_from(first).cte("room")
    more_pick = _lane_pick(spec, full, room.c.n, exclude=full.c.ids).lateral("more_pick")
    more = (
        select(full.c.priority, *more_pick.c)
        .select_from(full.join(room, true()).join(more_pick, true()))
        .where(room.c.n > _int(0))
        .cte("more")
    )
    order = spec.order
    ranked = union_all(
        select(
            first.c.priority,
            _int(1).label("phase"),
            func.row_number()
            .over(
                partition_by=[first.c[c] for c in LANE],
                order_by=[first.c[name] for name in order],
            )
            .label("turn"),
            first.c.id,
            *(first.c[name] for name in order),
        ),
        select(
            more.c.priority,
            _int(2),
            _int(0),
            more.c.id,
            *(more.c[name] for name in order),
        ),
    ).subquery("ranked")
    turns = [ranked.c.priority.desc(), ranked.c.phase, ranked.c.turn]
    turns += [ranked.c[name] for name in order]
    picked = (
        select(ranked.c.id, func.row_number().over(order_by=turns).label("pos"))
        .order_by(*turns)
        .limit(limit)
        .cte("picked")
    )
    multi = select(func.count()).select_from(lanes).scalar_subquery() > _int(1)
    return picked, multi


@cache
def ready_on_shard(spec: QueueSpec) -> AnySelect:
    """On Citus: one row if the partition has a ready row on the shard ``part_shard``.

    A single-table read by the shard (Citus's fast path: about 0.6 ms against
    the claim's 3); an idle claim asks it of each shard and claims only where
    it answers, so an idle round costs 20 ms, not 110 (docs/howto/citus.md).
    """
    t = spec.table
    return select(t.c.shard).where(*_ready(spec, t), t.c.available_at <= func.now()).limit(1)


class Rate(NamedTuple):
    """A kind's declared rate: ``per_second`` calls, up to ``burst`` at once after idling."""

    per_second: float
    burst: int


def partition_params(partition: dict[str, Any]) -> dict[str, Any]:
    """A partition's values (its shard too, if named) as the ``part_<column>`` parameters."""
    return {f"part_{k}": v for k, v in partition.items()}


def claim_params(
    partition: dict[str, str],
    *,
    limit: int,
    owner: str,
    lease_seconds: float,
    rate: Rate | None = None,
    shard: int | None = None,
) -> dict[str, Any]:
    """Parameters of :func:`claim` for one partition.

    ``rate``: of ``claim(spec, rated=True)``; ``shard``: of a sharded spec's.
    """
    params = partition_params(partition)
    if shard is not None:
        params["part_shard"] = shard
    params.update(claim_limit=limit, owner=owner, lease_seconds=lease_seconds)
    if rate is not None:
        params.update(rate=rate.per_second, burst=rate.burst)
    return params
