"""Retention: delete (or archive, then delete) finished history older than a horizon.

Finished rows are kept out of the hot indexes already (they are partial), but
a table that only grows still costs disk, vacuum and backups. ``outbox gc``
deletes in small batches, each its own short transaction, so it never holds a
long transaction (which would stop vacuum and slow every claim).

What goes, batch by batch:

1. runs that ended before the horizon once none of their effects is still
   open, with everything that belongs to them: steps, effects (payload, key,
   result), the effects' attempt log, signals, budget ledger, and the callers'
   keys registered for the run and its effects (a key is forgotten with what
   it named: used again, it starts a new run or intent);
2. run-less effects that finished before the horizon, with their attempt log
   and their callers' keys;
3. consumer dedup keys and webhook replay marks older than the horizon;
4. the large values stored by reference (:mod:`outbox.blobs`) that nothing uses
   any more: a run's or run-less effect's references go with it (and any left
   by an owner deleted otherwise go here), then every blob no reference names.
   A blob a writer is using at that moment is locked by it, and skipped.

With an archive, every deleted row of every table is written to it
(:mod:`outbox.storage.admin.archive`) and fsynced before its batch commits.

On Citus, phases 1, 2 and 4 go a shard at a time: every statement names its
shard (a run's rows, its blobs and their references all live on the run's),
so it runs on the node holding it, and locks rows only there. The keys of
phase 3 live on the coordinator. A shard whose node does not answer is left
for the next gc (its batch rolled back, the report naming it); the other
shards are collected.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol
from uuid import UUID

from sqlalchemy import Connection, Engine

from outbox.errors import DatabaseError, ValidationError
from outbox.faults import crash_point
from outbox.models import OPEN_EFFECT_STATUSES
from outbox.shards import SHARDS, key_shard
from outbox.storage.admin.archive import ArchiveWriter
from outbox.storage.engine import distributed, translate_errors
from outbox.storage.migrate import applied_versions
from outbox.storage.schema import (
    blob_refs,
    blobs,
    budget_ledger,
    consumed_keys,
    effect_attempts,
    effect_keys,
    effects,
    run_keys,
    runs,
    signals,
    steps,
    webhook_replays,
)
from outbox.storage.sql import blobs as blob_sql
from outbox.storage.sql import retention as sql

__all__ = ["GC_TABLES", "GcReport", "collect_garbage", "parse_horizon"]

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
#: now() minus a longer horizon falls out of PostgreSQL's timestamps (and means nothing).
MAX_HORIZON = timedelta(days=365_000)

#: Every table ``gc`` deletes from, parents before their children (the archive's order).
GC_TABLES: tuple[str, ...] = tuple(
    t.name
    for t in (
        runs,
        steps,
        signals,
        budget_ledger,
        effects,
        effect_attempts,
        run_keys,
        effect_keys,
        consumed_keys,
        webhook_replays,
        blob_refs,
        blobs,
    )
)
_OPEN = {str(s) for s in OPEN_EFFECT_STATUSES}


def parse_horizon(text: str) -> timedelta:
    """``"30d"``, ``"12h"``, ``"90m"``, ``"45s"``, ``"2w"`` as a timedelta."""
    match = _DURATION.match(text)
    if match is None:
        raise ValidationError("older_than", text, "expected a number and a unit: s, m, h, d, w")
    try:
        horizon = timedelta(**{_UNITS[match[2]]: float(match[1])})
    except OverflowError:
        horizon = timedelta.max
    if horizon > MAX_HORIZON:
        raise ValidationError(
            "older_than", text, f"is longer than {MAX_HORIZON.days} days (a thousand years)"
        )
    return horizon


@dataclass
class GcReport:
    """Rows deleted per table (every table, zero included), and batches (transactions) used."""

    deleted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(GC_TABLES, 0))
    batches: int = 0
    dry_run: bool = False
    #: On Citus: the shards left for the next gc because their node did not answer,
    #: each with the error that said so.
    unreachable: dict[int, str] = field(default_factory=dict)
    #: Large values (and their references) were left alone: this session may not
    #: delete them (a login confined to a namespace: the values are shared by
    #: every namespace, and it sees only its own references).
    values_left: bool = False


class _Batch:
    """One transaction of ``gc``: deletes rows, counts them, keeps them for the archive."""

    def __init__(
        self, conn: Connection, report: GcReport, *, keep_rows: bool, shard: int | None
    ) -> None:
        self.conn = conn
        self.report = report
        #: Whether the deleted rows are read back (for the archive) or only counted.
        self.keep_rows = keep_rows
        #: On Citus: the one shard this batch works on (its statements name it).
        self.shard = shard
        self.rows: dict[str, list[Any]] = {}

    @property
    def sharded(self) -> bool:
        """Whether the statements name a shard (on Citus)."""
        return self.shard is not None

    @property
    def on(self) -> dict[str, Any]:
        """The ``on_shard`` parameter of a sharded statement, or nothing."""
        return {} if self.shard is None else {"on_shard": self.shard}

    def delete(self, table: str, statement: Any, params: dict[str, Any]) -> int:
        result = self.conn.execute(statement, params)
        if self.keep_rows:
            rows = list(result.mappings())
            self.rows.setdefault(table, []).extend(rows)
            count = len(rows)
        else:
            count = result.rowcount
        self.report.deleted[table] += count
        return count

    def archive_to(self, archive: ArchiveWriter) -> None:
        """Write the batch's rows, parents first.

        A run comes before its effects and an effect before its attempts, so a
        reader can follow one run through the file in one pass.
        """
        for table in GC_TABLES:
            archive.write(table, self.rows.get(table, ()))


class _Phase(Protocol):
    def __call__(self, batch: _Batch, params: dict[str, Any]) -> tuple[int, bool]:
        """Run one batch: (rows picked, whether more may be left)."""
        ...


class _RunPhase:
    """Runs with their history, ``batch`` effects a transaction at most.

    How many runs to pick follows how many fitted last time, so runs with many
    effects do not make every batch lock runs it then leaves for the next.
    """

    def __init__(self, batch: int) -> None:
        self.limit = batch

    def __call__(self, batch: _Batch, params: dict[str, Any]) -> tuple[int, bool]:
        conn, sharded, rows, on = batch.conn, batch.sharded, batch.keep_rows, batch.on
        budget = int(params["batch"])
        pick = {**params, "batch": self.limit}
        picked = [row[0] for row in conn.execute(sql.doomed_runs(sharded), pick)]
        if not picked:
            return 0, False
        counted = conn.execute(sql.effects_of_runs(sharded), {"ids": picked, **on}).all()
        totals: dict[UUID, int] = dict(counted)
        # At most ``budget`` effects between them (a bigger run goes alone).
        fitting: list[UUID] = []
        effect_count = 0
        for run_id in picked:
            if fitting and effect_count + totals.get(run_id, 0) > budget:
                break
            fitting.append(run_id)
            effect_count += totals.get(run_id, 0)
        trimmed = len(fitting) < len(picked)
        more = trimmed or len(picked) == self.limit
        self.limit = len(fitting) + 1 if trimmed else min(budget, self.limit * 2)
        locked = conn.execute(sql.lock_effects_of_runs(sharded), {"ids": fitting, **on}).all()
        held: dict[UUID, int] = {}
        reopened: set[UUID] = set()
        for row in locked:
            held[row.run_id] = held.get(row.run_id, 0) + 1
            if row.status in _OPEN:
                reopened.add(row.run_id)  # an operator put it back to pending meanwhile
        # A run with an effect someone else holds locked, or open again, waits for the next gc.
        ids = [r for r in fitting if r not in reopened and held.get(r, 0) == totals.get(r, 0)]
        if ids:
            chosen = set(ids)
            doomed = [row.id for row in locked if row.run_id in chosen]
            _delete_keys(batch, runs, ids)
            _delete_keys(batch, effects, doomed)
            effect_ids = {"ids": doomed, **on}
            run_ids = {"ids": ids, **on}
            batch.delete(
                effect_attempts.name, sql.delete_attempts(rows=rows, sharded=sharded), effect_ids
            )
            batch.delete(
                effects.name, sql.delete_by_ids(effects, rows=rows, sharded=sharded), effect_ids
            )
            for child in sql.RUN_CHILDREN:
                statement = sql.delete_run_children(child, rows=rows, sharded=sharded)
                batch.delete(child.name, statement, run_ids)
            if not batch.report.values_left:
                statement = blob_sql.delete_refs_of(rows=rows, sharded=sharded)
                batch.delete(blob_refs.name, statement, run_ids)
            statement = sql.delete_by_ids(runs, rows=rows, sharded=sharded)
            batch.delete(runs.name, statement, run_ids)
        return len(picked), more


def _runless_batch(batch: _Batch, params: dict[str, Any]) -> tuple[int, bool]:
    sharded, rows = batch.sharded, batch.keep_rows
    statement = sql.doomed_runless_effects(sharded)
    picked = [row[0] for row in batch.conn.execute(statement, params)]
    if picked:
        _delete_keys(batch, effects, picked)
        ids = {"ids": picked, **batch.on}
        batch.delete(effect_attempts.name, sql.delete_attempts(rows=rows, sharded=sharded), ids)
        if not batch.report.values_left:
            statement = blob_sql.delete_refs_of(rows=rows, sharded=sharded)
            batch.delete(blob_refs.name, statement, ids)
        batch.delete(effects.name, sql.delete_by_ids(effects, rows=rows, sharded=sharded), ids)
    return len(picked), len(picked) == params["batch"]


def _delete_keys(batch: _Batch, owners: Any, ids: list[UUID]) -> None:
    """Delete the callers' keys registered for ``ids`` (runs or effects), before the owners go.

    On Citus a key is registered on its own shard (and an effect's key copied to
    its owner's): a statement per shard holding one, each routed there.
    """
    if not ids:
        return
    table = run_keys if owners is runs else effect_keys
    sharded, conn = batch.sharded, batch.conn
    found = conn.execute(sql.keys_of(owners, sharded), {"ids": ids, **batch.on}).all()
    if not found:
        return
    keys = {"ids": ids, "namespaces": [r[0] for r in found], "keys": [r[1] for r in found]}
    statement = sql.delete_keys(table, rows=batch.keep_rows, sharded=sharded)
    if not sharded:
        batch.delete(table.name, statement, keys)
        return
    shards = {key_shard(namespace, key) for namespace, key in found}
    if table is effect_keys and batch.shard is not None:
        shards.add(batch.shard)
    for shard in sorted(shards):
        batch.delete(table.name, statement, {**keys, "on_shard": shard})


def _values_batch(table: Any) -> _Phase:
    """References whose owner is gone, or blobs no reference names (not by horizon)."""
    statement = blob_sql.delete_orphan_refs if table is blob_refs else blob_sql.delete_unused_blobs

    def run(batch: _Batch, params: dict[str, Any]) -> tuple[int, bool]:
        delete = statement(rows=batch.keep_rows, sharded=batch.sharded)
        deleted = batch.delete(table.name, delete, params)
        return deleted, deleted == params["batch"]

    return run


def _keys_batch(table: Any) -> _Phase:
    def run(batch: _Batch, params: dict[str, Any]) -> tuple[int, bool]:
        deleted = batch.delete(table.name, sql.doomed_keys(table, rows=batch.keep_rows), params)
        return deleted, deleted == params["batch"]

    return run


def collect_garbage(
    engine: Engine,
    older_than: timedelta,
    *,
    batch: int = 1000,
    archive: ArchiveWriter | None = None,
    dry_run: bool = False,
    progress: Callable[[str, int], None] | None = None,
) -> GcReport:
    """Delete finished history older than ``older_than``; with ``archive``, archive it first.

    Each batch is one transaction: up to ``batch`` runs with all their rows and
    at most ``batch`` effects between them (a run with more goes alone), or
    ``batch`` run-less effects with their attempts, or ``batch`` keys. Every
    deleted row is written to ``archive`` and made durable before its batch
    commits. ``dry_run`` runs the first batch of each phase and rolls it back
    (the report counts what it would have deleted; nothing is archived).
    ``progress(phase, picked)`` is called after each batch.
    """
    if batch < 1:
        raise ValidationError("batch", batch, "must be at least 1")
    report = GcReport(dry_run=dry_run)
    params = {"horizon": older_than, "batch": batch}
    if archive is not None and not dry_run:
        with translate_errors("reading the schema version"), engine.connect() as conn:
            versions = applied_versions(conn)
        archive.header(
            written_at=datetime.now(UTC),
            older_than_seconds=older_than.total_seconds(),
            schema_version=max(versions, default=0),
        )
        archive.sync()
    with translate_errors("reading the schema"), engine.connect() as conn:
        sharded = distributed(conn)
        # (a reference its owner left is deleted with a later gc's orphans)
        report.values_left = not conn.execute(blob_sql.may_delete_values()).scalar_one()
    #: (phase, its batches, whether it goes a shard at a time on Citus)
    phases: list[tuple[str, _Phase, bool]] = [
        (runs.name, _RunPhase(batch), True),
        (effects.name, _runless_batch, True),
        (consumed_keys.name, _keys_batch(consumed_keys), False),
        (webhook_replays.name, _keys_batch(webhook_replays), False),
        *(
            []
            if report.values_left
            else [
                (blob_refs.name, _values_batch(blob_refs), True),
                (blobs.name, _values_batch(blobs), True),
            ]
        ),
    ]
    for phase, run, by_shard in phases:
        for shard in range(SHARDS) if sharded and by_shard else (None,):
            if shard in report.unreachable:
                continue
            try:
                _collect(engine, report, phase, run, shard, params, archive, progress)
            except DatabaseError as exc:
                if shard is None or not _node_down(exc):
                    raise
                cause = getattr(exc.__cause__, "orig", None) or exc
                report.unreachable[shard] = (str(cause).splitlines() or [""])[0]
    return report


def _collect(
    engine: Engine,
    report: GcReport,
    phase: str,
    run: _Phase,
    shard: int | None,
    params: dict[str, Any],
    archive: ArchiveWriter | None,
    progress: Callable[[str, int], None] | None,
) -> None:
    """The batches of one phase (on Citus: on one shard) until nothing more is left."""
    keep_rows = archive is not None and not report.dry_run
    while True:
        counted = dict(report.deleted)
        before = sum(counted.values())
        try:
            with translate_errors(f"gc of {phase}"), engine.begin() as conn:
                work = _Batch(conn, report, keep_rows=keep_rows, shard=shard)
                picked, more = run(work, {**params, **work.on})
                if report.dry_run:
                    conn.rollback()
                elif archive is not None:
                    work.archive_to(archive)
                    # On disk before the delete commits: a crash must not lose rows
                    # that are gone from the database and missing from the archive.
                    archive.sync()
                    crash_point("gc_archived")
        except BaseException:
            report.deleted = counted  # rolled back: none of the batch's rows was deleted
            raise
        report.batches += 1
        if progress is not None:
            progress(phase, picked)
        deleted_nothing = sum(report.deleted.values()) == before
        # Nothing more: nothing older is left. A batch that deleted nothing: every
        # candidate is locked by someone else; the next gc takes it.
        if report.dry_run or not more or deleted_nothing:
            return


def _node_down(exc: DatabaseError) -> bool:
    """Citus's word that the node holding a shard did not answer (SQLSTATE class 08).

    From the coordinator, whose session lives on; a coordinator that does not
    answer is no such word (the driver's error then has no SQLSTATE), and stops gc.
    """
    return (exc.sqlstate or "").startswith("08")
