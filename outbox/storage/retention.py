"""Retention: delete (or archive, then delete) finished history older than a horizon.

Finished rows are kept out of the hot indexes already (they are partial), but
a table that only grows still costs disk, vacuum and backups. ``outbox gc``
deletes in small batches, each its own short transaction, so it never holds a
long transaction (which would stop vacuum and slow every claim).

What goes: runs that ended before the horizon (with their steps, effects,
attempts, signals and ledger, by cascade) once none of their effects is still
open, and run-less effects that finished before the horizon. Consumer dedup
keys and webhook replay marks older than the horizon go too. Then the large
values stored by reference (``outbox_blobs``) that nothing uses any more: their
owners' references go first, then every blob no reference names (a blob a
writer is using at that moment is locked, and skipped).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

from sqlalchemy import Engine, Integer, bindparam, delete, exists, func, select
from sqlalchemy.dialects.postgresql import INTERVAL

from outbox.errors import ValidationError
from outbox.models import OPEN_EFFECT_STATUSES, TERMINAL_RUN_STATUSES
from outbox.storage.schema import consumed_keys, effects, runs, webhook_replays
from outbox.storage.sql import blobs as blob_sql
from outbox.storage.sql.common import in_statuses

__all__ = ["GcReport", "collect_garbage", "parse_horizon"]

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
#: now() minus a longer horizon falls out of PostgreSQL's timestamps (and means nothing).
MAX_HORIZON = timedelta(days=365_000)


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
    """Rows deleted per table, and batches (transactions) used."""

    deleted: dict[str, int] = field(default_factory=dict)
    batches: int = 0
    dry_run: bool = False


def _runs_batch() -> Any:
    horizon = func.now() - bindparam("horizon", type_=INTERVAL)
    still_open = exists().where(
        effects.c.run_id == runs.c.id,
        in_statuses(effects.c.status, OPEN_EFFECT_STATUSES),
    )
    doomed = (
        select(runs.c.id)
        .where(
            in_statuses(runs.c.status, TERMINAL_RUN_STATUSES),
            runs.c.updated_at < horizon,
            ~still_open,
        )
        .order_by(runs.c.updated_at)
        .limit(bindparam("batch", type_=Integer))
        .with_for_update(skip_locked=True)
        .scalar_subquery()
    )
    return delete(runs).where(runs.c.id.in_(doomed)).returning(*runs.c)


def _effects_batch() -> Any:
    horizon = func.now() - bindparam("horizon", type_=INTERVAL)
    doomed = (
        select(effects.c.id)
        .where(
            effects.c.completed_at < horizon,
            effects.c.run_id.is_(None),
            ~in_statuses(effects.c.status, OPEN_EFFECT_STATUSES),
        )
        .order_by(effects.c.completed_at)
        .limit(bindparam("batch", type_=Integer))
        .with_for_update(skip_locked=True)
        .scalar_subquery()
    )
    return delete(effects).where(effects.c.id.in_(doomed)).returning(*effects.c)


def _small_tables() -> list[tuple[str, Any]]:
    horizon = func.now() - bindparam("horizon", type_=INTERVAL)
    return [
        (
            "outbox_consumed_keys",
            delete(consumed_keys).where(consumed_keys.c.consumed_at < horizon),
        ),
        (
            "outbox_webhook_replays",
            delete(webhook_replays).where(webhook_replays.c.seen_at < horizon),
        ),
    ]


def collect_garbage(
    engine: Engine,
    older_than: timedelta,
    *,
    batch: int = 1000,
    archive: IO[str] | None = None,
    dry_run: bool = False,
    progress: Callable[[str, int], None] | None = None,
) -> GcReport:
    """Delete finished history older than ``older_than``; with ``archive``, write it first.

    Archived rows are JSON lines (``{"table": ..., "row": {...}}``) of the runs
    and run-less effects deleted (a run's steps and effects go with it by cascade).
    """
    if batch < 1:
        raise ValidationError("batch", batch, "must be at least 1")
    report = GcReport(dry_run=dry_run)
    params = {"horizon": older_than, "batch": batch}
    for table, statement in (("outbox_runs", _runs_batch()), ("outbox_effects", _effects_batch())):
        while True:
            with engine.begin() as conn:
                rows = conn.execute(statement, params).mappings().all()
                if dry_run:
                    conn.rollback()
                elif archive is not None:
                    for row in rows:
                        archive.write(
                            json.dumps({"table": table, "row": dict(row)}, default=str) + "\n"
                        )
                    # On disk before the delete commits: a crash must not lose rows
                    # that are gone from the database and missing from the archive.
                    archive.flush()
                    os.fsync(archive.fileno())
            report.batches += 1
            report.deleted[table] = report.deleted.get(table, 0) + len(rows)
            if progress is not None:
                progress(table, len(rows))
            if len(rows) < batch or dry_run:
                break
    for table, statement in _small_tables():
        with engine.begin() as conn:
            count = conn.execute(statement, {"horizon": older_than}).rowcount
            if dry_run:
                conn.rollback()
        report.batches += 1
        report.deleted[table] = count
    for table, statement in (
        ("outbox_blob_refs", blob_sql.delete_orphan_refs()),
        ("outbox_blobs", blob_sql.delete_unused_blobs()),
    ):
        # Not by horizon: a value nothing refers to is never read again.
        while True:
            with engine.begin() as conn:
                count = len(conn.execute(statement, {"batch": batch}).all())
                if dry_run:
                    conn.rollback()
            report.batches += 1
            report.deleted[table] = report.deleted.get(table, 0) + count
            if progress is not None:
                progress(table, count)
            if count < batch or dry_run:
                break
    return report


def open_archive(path: Path | None) -> IO[str] | None:
    """An append-only archive file, or None."""
    return None if path is None else path.open("a")
