"""What ``outbox audit verify`` reads besides runs: the effects written outside any run.

An effect of no run (``Outbox.transaction``) has an attempt-log chain like any
other; it belongs to no run record, so it is read here, a page at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from sqlalchemy import Engine

from outbox.blobs import reference_hashes
from outbox.storage.blob_store import stored_rows
from outbox.storage.engine import translate_errors
from outbox.storage.sql import governance as gov_sql

__all__ = ["effects_outside_runs"]

# Above any seq (a bigint identity): the first page starts from the newest effect.
_AFTER_ALL = 2**63 - 1


def effects_outside_runs(
    engine: Engine, limit: int, *, page_size: int = 500
) -> Iterator[tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]]:
    """Effects of no run, newest first (at most ``limit``): pages of rows, three lists each.

    A page is (effects, their attempt-log rows, the ``outbox_blobs`` rows their
    payloads refer to). Each page is read in one snapshot (repeatable read), so an effect and its
    attempt log agree; a page's attempt-log rows come with ``detail_text``,
    ordered by effect then id (:func:`outbox.governance.audit_record.effect_records` takes both).
    """
    before, left = _AFTER_ALL, limit
    while left > 0:
        size = min(page_size, left)
        with translate_errors("reading effects outside runs"), engine.connect() as conn:
            conn = conn.execution_options(isolation_level="REPEATABLE READ")
            with conn.begin():
                found = [
                    dict(r._mapping)
                    for r in conn.execute(
                        gov_sql.effects_outside_runs(), {"before": before, "page_size": size}
                    )
                ]
                if not found:
                    return
                attempts = [
                    dict(r._mapping)
                    for r in conn.execute(
                        gov_sql.attempts_of_effects(), {"ids": [e["id"] for e in found]}
                    )
                ]
                blobs = stored_rows(conn, reference_hashes(e["payload"] for e in found))
        yield found, attempts, blobs
        if len(found) < size:
            return
        before, left = found[-1]["seq"], left - len(found)
