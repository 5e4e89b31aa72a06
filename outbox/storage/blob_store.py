"""Writing and reading values stored by reference (:mod:`outbox.blobs`), on a caller's connection.

Writers call :func:`put` in the transaction that writes the referring row;
readers pass the records they read through :func:`resolve`, which fetches
every referenced value in one query (none when nothing was by reference) and
returns the records with their values in place. Every blob read is hashed: a
text that does not hash to its sha256 (edited by hand) is a
:class:`~outbox.errors.StoredValueAltered`, never a value handed on.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel
from sqlalchemy import Connection

from outbox.blobs import Blob, reference_hash
from outbox.errors import DatabaseError, StoredValueAltered
from outbox.payloads import content_hash
from outbox.shards import shard_of
from outbox.storage.sql import blobs as blob_sql

__all__ = [
    "AUDITED_STEP_FIELDS",
    "EFFECT_FIELDS",
    "RUN_FIELDS",
    "STEP_FIELDS",
    "fetch",
    "put",
    "resolve",
    "stored_rows",
]

#: The fields of each record that may hold a reference.
RUN_FIELDS = ("inputs", "state", "plan", "result", "error")
STEP_FIELDS = ("result", "error")
EFFECT_FIELDS = ("payload",)
#: The fields of a step row that may hold one (a step's state and plan too).
AUDITED_STEP_FIELDS = ("result", "error", "state", "plan")

M = TypeVar("M", bound=BaseModel)


def put(conn: Connection, owner: uuid.UUID | str, blobs: Iterable[Blob | None]) -> None:
    """Store ``blobs`` once each and record that ``owner`` uses them (in the caller's tx)."""
    unique = {b.sha256: b for b in blobs if b is not None}
    if not unique:
        return
    shard = shard_of(owner if isinstance(owner, uuid.UUID) else uuid.UUID(owner))
    # (in one order: two writers of the same new blobs wait on each other's, not both)
    rows = [
        {"sha": b.sha256, "size": b.size, "data": b.text, "shard": shard}
        for b in sorted(unique.values(), key=lambda b: b.sha256)
    ]
    # (a blob already there is held for this transaction by the insert's trigger)
    conn.execute(blob_sql.put_blob(), rows)
    conn.execute(blob_sql.put_refs(), {"owner": owner, "hashes": sorted(unique)})


def fetch(conn: Connection, hashes: Iterable[str]) -> dict[str, Any]:
    """The values of these blobs, decoded; a missing one is a :class:`DatabaseError`.

    Each text is hashed as it is read (the bytes are in memory already): one
    that is not its sha256's raises :class:`StoredValueAltered` naming it, so an
    edited blob never becomes a replayed result, a run's state or a payload sent.
    """
    wanted = set(hashes)
    if not wanted:
        return {}
    rows = conn.execute(blob_sql.fetch_blobs(), {"hashes": sorted(wanted)}).all()
    for sha, data in rows:
        if content_hash(data) != sha:
            raise StoredValueAltered(sha)
    found = {sha: json.loads(data) for sha, data in rows}
    missing = wanted - found.keys()
    if missing:
        raise DatabaseError(
            f"stored value sha256={min(missing)} is missing from outbox_blobs "
            "(deleted by hand, or restored from an incomplete backup)"
        )
    return found


def stored_rows(conn: Connection, hashes: Iterable[str]) -> list[dict[str, Any]]:
    """The ``outbox_blobs`` rows of these blobs as stored (every shard's copy), unchecked.

    For the audit, which reports an altered blob as a break rather than raising.
    """
    wanted = sorted(set(hashes))
    if not wanted:
        return []
    return [
        {"sha256": sha, "data": data}
        for sha, data in conn.execute(blob_sql.fetch_blobs(), {"hashes": wanted})
    ]


def resolve(conn: Connection, records: Sequence[M], fields: Sequence[str]) -> list[M]:
    """``records`` with each reference in ``fields`` replaced by its value (one query)."""
    hashes = {
        h for r in records for f in fields if (h := reference_hash(getattr(r, f))) is not None
    }
    if not hashes:
        return list(records)
    values = fetch(conn, hashes)
    out = []
    for record in records:
        update = {
            f: values[h] for f in fields if (h := reference_hash(getattr(record, f))) is not None
        }
        out.append(record.model_copy(update=update) if update else record)
    return out
