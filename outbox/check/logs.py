"""Reading the real logs for the invariant checker, and waiting until they settle.

:func:`load_database` reads the intents, the attempt log and the step records
from PostgreSQL in one snapshot, :func:`load_sink_log` the sink's JSON lines;
:func:`load` reads both and hands them to :func:`outbox.check.invariants.check`.
:func:`settle` waits until nothing is pending or in flight.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from outbox.check.invariants import (
    OPEN,
    Applied,
    AttemptRecord,
    Intent,
    Normalize,
    Report,
    check,
    operation_of,
    unchanged,
)
from outbox.storage.engine import make_engine
from outbox.storage.store import Store

__all__ = ["CHECKER_APP", "load", "load_database", "load_sink_log", "open_counts", "settle"]

#: The ``application_name`` of the checker's own connections.
CHECKER_APP = "outbox-check"


def _store(dsn: str) -> Store:
    return Store(make_engine(dsn, pool_size=1, application_name=CHECKER_APP))


def _intent(row: Mapping[str, Any], normalize: Normalize) -> Intent:
    return Intent(
        id=str(row["id"]),
        key=row["idempotency_key"],
        kind=row["kind"],
        status=row["status"],
        attempt=row["attempt"],
        operation=operation_of(row["kind"], row["payload"], normalize),
        run=None if row["run_id"] is None else str(row["run_id"]),
        step=row["step_id"],
        payload=json.dumps(row["payload"], default=str),
    )


def load_database(
    dsn: str, normalize: Normalize = unchanged
) -> tuple[list[Intent], list[AttemptRecord], list[dict[str, Any]]]:
    """Every intent, every attempt record and every step record of a database."""
    store = _store(dsn)
    try:
        audit = store.audit()
    finally:
        store.engine.dispose()
    intents = [_intent(row, normalize) for row in audit["effects"]]
    attempts = [
        AttemptRecord(
            r["id"], str(r["effect_id"]), r["attempt"], r["outcome"], r["worker"], r["detail"]
        )
        for r in audit["attempts"]
    ]
    return intents, attempts, audit["steps"]


def _applied_operation(entry: Mapping[str, Any], normalize: Normalize) -> str | None:
    """The operation of an ``applied`` line: a stand-in's envelope, else the request body."""
    path = str(entry.get("path") or "")
    raw = entry.get("body")
    if raw is None:  # a log written before bodies were logged
        operation = entry.get("operation")
        return None if operation is None else normalize(str(operation))
    try:
        body = json.loads(raw) if raw else None
    except ValueError:
        body = raw
    if path.startswith(("/record/", "/blind/")) and isinstance(body, dict) and "kind" in body:
        return operation_of(str(body["kind"]), body.get("payload"), normalize)
    if isinstance(body, dict) and isinstance(body.get("operation"), str):
        return normalize(body["operation"])
    return operation_of(f"POST {normalize(path)}", body, normalize)


def load_sink_log(path: Path, normalize: Normalize = unchanged) -> tuple[list[Applied], int]:
    """The sink's ``applied`` lines, and how many requests it logged."""
    applied: list[Applied] = []
    requests = 0
    with path.open() as handle:
        for line in handle:
            if not line.strip():
                continue
            entry = json.loads(line)
            if entry.get("event") == "applied":
                applied.append(
                    Applied(
                        entry.get("key"),
                        _applied_operation(entry, normalize),
                        entry.get("path"),
                        entry.get("body"),
                        entry.get("t"),
                    )
                )
            else:
                requests += 1
    return applied, requests


def load(
    dsn: str,
    sink_log: Path,
    *,
    expected_operations: Iterable[str] | None = None,
    sink_kinds: Iterable[str] | None = None,
) -> Report:
    """Read the three logs and check them."""
    intents, attempts, _ = load_database(dsn)
    applied, requests = load_sink_log(sink_log)
    return check(
        intents,
        attempts,
        applied,
        requests=requests,
        expected_operations=expected_operations,
        sink_kinds=sink_kinds,
    )


def open_counts(dsn: str) -> dict[str, int]:
    """Effects per status (every status present)."""
    store = _store(dsn)
    try:
        return store.effect_counts()
    finally:
        store.engine.dispose()


def settle(
    dsn: str,
    *,
    timeout: float = 60.0,
    sink: Any = None,
    also: Callable[[], bool] | None = None,
    quiet_for: float = 0.3,
) -> dict[str, int]:
    """Wait until no effect is pending, in flight or dispatched (and the sink is idle).

    ``also`` adds a condition (runs completed...). The state must hold for
    ``quiet_for`` seconds in a row. Connection errors while the database comes
    back are retried. Returns the final counts per status.
    """
    deadline = time.monotonic() + timeout
    quiet_since: float | None = None
    counts: Mapping[str, int] = {}
    error: Exception | None = None
    while True:
        try:
            counts = open_counts(dsn)
            done = not any(counts.get(s, 0) for s in OPEN)
            done = done and (sink is None or sink.in_progress == 0)
            done = done and (also is None or bool(also()))
        except Exception as exc:  # the database coming back; reported on timeout
            error, done = exc, False
        now = time.monotonic()
        if done:
            quiet_since = now if quiet_since is None else quiet_since
            if now - quiet_since >= quiet_for:
                return dict(counts)
        else:
            quiet_since = None
        if now > deadline:
            raise AssertionError(
                f"did not settle in {timeout}s: {dict(counts)} (last error: {error!r})"
            )
        time.sleep(0.05)
