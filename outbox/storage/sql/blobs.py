"""SQL of large values stored by reference (:mod:`outbox.blobs`): write, read, share, collect.

A blob is written with the row that refers to it, in the same transaction, and
its owner (a run, or an effect that belongs to no run) is recorded in
``outbox_blob_refs``. The insert's trigger holds a blob already there until
commit, and the reference keeps it afterwards, so ``outbox gc`` (which deletes
only blobs with no reference, skipping locked rows) does not remove a blob a
writer uses.
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
    any_,
    bindparam,
    delete,
    exists,
    func,
    select,
    text,
    tuple_,
)
from sqlalchemy.dialects.postgresql import UUID
from sqlalchemy.dialects.postgresql import insert as pg_insert

from outbox.storage.schema import blob_refs, blobs, effects, runs
from outbox.storage.sql.common import AnySelect, on_shard, shard_of

__all__ = [
    "copy_refs",
    "delete_orphan_refs",
    "delete_refs_of",
    "delete_unused_blobs",
    "fetch_blobs",
    "put_blob",
    "put_refs",
]


@cache
def put_blob() -> Any:
    """Store one blob once on ``shard`` (``sha`` = sha256 of ``data``).

    One already there is left as it is: it may be another namespace's, which a
    confined login cannot update (its policies hide it). The insert's trigger
    holds it until commit (``outbox_blobs_written``), so gc does not take it.
    """
    return (
        pg_insert(blobs)
        .values(
            sha256=bindparam("sha", type_=Text),
            bytes=bindparam("size", type_=BigInteger),
            data=bindparam("data", type_=Text),
            shard=bindparam("shard", type_=SmallInteger),
        )
        .on_conflict_do_nothing(constraint="outbox_blobs_pkey")
    )


@cache
def put_refs() -> Any:
    """``owner`` (a run or a run-less effect) uses the blobs ``hashes``."""
    hashes = func.unnest(bindparam("hashes", type_=ARRAY(Text)))
    owner = bindparam("owner", type_=UUID(as_uuid=True))
    return (
        pg_insert(blob_refs)
        .from_select(["owner", "sha256", "shard"], select(owner, hashes, shard_of(owner)))
        .on_conflict_do_nothing(constraint="outbox_blob_refs_pkey")
    )


def fetch_blobs() -> AnySelect:
    """The canonical JSON of the blobs ``hashes``."""
    return select(blobs.c.sha256, blobs.c.data).where(
        blobs.c.sha256 == any_(bindparam("hashes", type_=ARRAY(Text)))
    )


@cache
def copy_refs() -> Any:
    """A fork uses what its original used (``from_owner`` → ``to_owner``).

    On another shard, the blobs themselves are copied there first.
    """
    to_owner = bindparam("to_owner", type_=UUID(as_uuid=True))
    from_owner = bindparam("from_owner", type_=UUID(as_uuid=True))
    src = blob_refs.alias("src")
    used = src.c.owner == from_owner
    copied = (
        pg_insert(blobs)
        .from_select(
            ["sha256", "bytes", "data", "shard"],
            select(blobs.c.sha256, blobs.c.bytes, blobs.c.data, shard_of(to_owner))
            .join(src, (src.c.sha256 == blobs.c.sha256) & (src.c.shard == blobs.c.shard))
            .where(used, shard_of(to_owner) != shard_of(from_owner)),
        )
        .on_conflict_do_nothing(constraint="outbox_blobs_pkey")
        .returning(blobs.c.sha256)
        .cte("copied")
    )
    return (
        pg_insert(blob_refs)
        .from_select(
            ["owner", "sha256", "shard"],
            select(to_owner, src.c.sha256, shard_of(to_owner)).where(used),
        )
        .on_conflict_do_nothing(constraint="outbox_blob_refs_pkey")
        # (a data-modifying CTE runs whether or not the statement reads it)
        .add_cte(copied)
    )


def _returning(statement: Any, table: Any, rows: bool) -> Any:
    # Every column only when the rows are archived: a blob's data can be large.
    return statement.returning(*table.c) if rows else statement


@cache
def delete_refs_of(*, rows: bool, sharded: bool = False) -> Any:
    """Delete what the owners ``ids`` (runs or run-less effects) used (``rows``: returning it).

    ``sharded`` (Citus): the owners are on the shard ``on_shard``, their references too.
    """
    statement = delete(blob_refs).where(
        *on_shard(blob_refs, sharded),
        blob_refs.c.owner == any_(bindparam("ids", type_=ARRAY(UUID(as_uuid=True)))),
    )
    return _returning(statement, blob_refs, rows)


@cache
def delete_orphan_refs(*, rows: bool, sharded: bool = False) -> Any:
    """References whose owner is gone (deleted other than by ``gc``), at most ``batch``.

    ``sharded`` (Citus): of the shard ``on_shard``, where a reference's owner lives.
    """
    gone = (
        select(blob_refs.c.owner, blob_refs.c.sha256)
        .where(
            *on_shard(blob_refs, sharded),
            ~exists().where(*on_shard(runs, sharded), runs.c.id == blob_refs.c.owner),
            ~exists().where(*on_shard(effects, sharded), effects.c.id == blob_refs.c.owner),
        )
        .limit(bindparam("batch", type_=Integer))
        .cte("gone")
    )
    statement = delete(blob_refs).where(
        *on_shard(blob_refs, sharded),
        blob_refs.c.owner == gone.c.owner,
        blob_refs.c.sha256 == gone.c.sha256,
    )
    return _returning(statement, blob_refs, rows)


@cache
def delete_unused_blobs(*, rows: bool, sharded: bool = False) -> Any:
    """Blobs no reference names, at most ``batch``; a blob a writer holds is skipped.

    A writer locks the blob it uses (its upsert, or its reference's foreign-key
    check) until it commits, so ``SKIP LOCKED`` leaves it alone; once committed,
    its reference keeps the blob out of this statement. ``sharded`` (Citus): of
    the shard ``on_shard`` (a blob is stored on each shard whose rows use it).
    """
    unused = (
        select(blobs.c.sha256, blobs.c.shard)
        .where(
            *on_shard(blobs, sharded),
            ~exists().where(
                blob_refs.c.sha256 == blobs.c.sha256, blob_refs.c.shard == blobs.c.shard
            ),
        )
        .limit(bindparam("batch", type_=Integer))
        .with_for_update(skip_locked=True)
    )
    statement = delete(blobs).where(
        *on_shard(blobs, sharded), tuple_(blobs.c.sha256, blobs.c.shard).in_(unused)
    )
    return _returning(statement, blobs, rows)


def may_delete_values() -> Any:
    """Whether the session may delete large values and their references (``outbox gc``)."""
    return text(
        "SELECT has_table_privilege('outbox_blobs', 'DELETE')"
        " AND has_table_privilege('outbox_blob_refs', 'DELETE')"
    )
