"""The invariant checker: three logs compared after the dust settles.

1. The intents, as PostgreSQL has them (``outbox_effects``).
2. The sink's log (JSON lines, :class:`tests.chaos.workload.LoggingSink`): every
   request as it arrived, and an ``applied`` line each time one took effect.
3. The completion records (``outbox_effect_attempts``): the attempt log.

Violations (each must be 0):

- ``lost``: an intent that is neither terminal nor ``unknown`` (G3), or an
  operation the workload committed for which there is no intent at all;
- ``duplicate_keys`` / ``duplicate_operations``: a key, or a business
  operation, applied at the sink more than once (G2); ``duplicate_intents``:
  one operation intended twice (two keys: no sink could dedup them);
- ``phantoms``: applied at the sink with no intent behind it (its key unknown
  to the database, or applied with a body that is not its intent's: another
  operation, or none);
- ``regressed``: a completed row that moved on: its attempt log shows a
  success followed by a later entry that is not ``stale`` (G4), or it logged a
  success but its status is no longer ``succeeded``, or it is ``succeeded`` while
  the sink never applied its key.

``unknown`` effects are not violations (they are visible, for an operator);
they are counted in the report.

:func:`check` is pure (hand-made inputs in the unit tests); :func:`load` reads
the real logs; :func:`settle` waits until nothing is pending or in flight.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

TERMINAL = frozenset({"succeeded", "failed", "cancelled", "compensated"})
OPEN = ("pending", "in_flight", "dispatched")
#: Statuses a row may reach after a recorded success (a cancelled run's undo).
AFTER_SUCCESS = frozenset({"succeeded", "compensated"})
CHECKER_APP = "chaos-checker"


@dataclass(frozen=True)
class Intent:
    """One row of ``outbox_effects`` (what the checker needs of it)."""

    id: str
    key: str
    kind: str
    status: str
    attempt: int
    operation: str | None = None


@dataclass(frozen=True)
class AttemptRecord:
    """One row of ``outbox_effect_attempts``, in insertion order (``seq``)."""

    seq: int
    effect_id: str
    attempt: int
    outcome: str
    worker: str | None = None
    detail: Any = None


@dataclass(frozen=True)
class Applied:
    """One ``applied`` line of the sink's log."""

    key: str | None
    operation: str | None


@dataclass
class Report:
    """What :func:`check` found."""

    lost: list[str] = field(default_factory=list)
    duplicate_keys: list[str] = field(default_factory=list)
    duplicate_operations: list[str] = field(default_factory=list)
    duplicate_intents: list[str] = field(default_factory=list)
    phantoms: list[str] = field(default_factory=list)
    regressed: list[str] = field(default_factory=list)
    #: Not violations: context for the reader.
    statuses: dict[str, int] = field(default_factory=dict)
    applied: int = 0
    requests: int = 0
    stale: int = 0

    VIOLATIONS = (
        "lost",
        "duplicate_keys",
        "duplicate_operations",
        "duplicate_intents",
        "phantoms",
        "regressed",
    )

    def counts(self) -> dict[str, int]:
        """Violations by name (all 0 when the guarantees held)."""
        return {name: len(getattr(self, name)) for name in self.VIOLATIONS}

    @property
    def clean(self) -> bool:
        return not any(self.counts().values())

    def summary(self) -> str:
        lines = [
            f"violations {self.counts()}",
            f"statuses {self.statuses}; {self.requests} requests, {self.applied} applied, "
            f"{self.stale} stale completions",
        ]
        for name in self.VIOLATIONS:
            found = getattr(self, name)
            if found:
                lines.append(f"{name}: {found[:10]}{' ...' if len(found) > 10 else ''}")
        return "\n".join(lines)

    def assert_clean(self, context: str = "") -> None:
        assert self.clean, f"{self.summary()}\n{context}".rstrip()


def _success(record: AttemptRecord) -> bool:
    """Did this log entry record the effect as done (by a deliverer, a lookup, an operator)?"""
    detail = record.detail if isinstance(record.detail, dict) else {}
    if record.outcome == "succeeded":
        return True
    if record.outcome == "looked_up":
        return detail.get("lookup") == "applied"
    if record.outcome == "resolved":
        return detail.get("as") == "succeeded"
    return False


def check(
    intents: Iterable[Intent],
    attempts: Iterable[AttemptRecord],
    applied: Iterable[Applied],
    *,
    requests: int = 0,
    expected_operations: Iterable[str] | None = None,
    sink_kinds: Iterable[str] | None = None,
) -> Report:
    """Compare the three logs. ``sink_kinds``: the kinds whose effects go to this sink (all)."""
    intents = list(intents)
    applied = list(applied)
    report = Report(requests=requests, applied=len(applied))
    report.statuses = dict(Counter(i.status for i in intents))
    sink_kinds = None if sink_kinds is None else set(sink_kinds)

    # lost: open intents, and committed operations with no intent at all
    report.lost = sorted(
        f"{i.id} ({i.kind}, {i.status}, attempt {i.attempt})"
        for i in intents
        if i.status not in TERMINAL and i.status != "unknown"
    )
    intended_ops = Counter(i.operation for i in intents if i.operation is not None)
    if expected_operations is not None:
        report.lost += sorted(
            f"operation {op}: no intent" for op in set(expected_operations) - set(intended_ops)
        )
    report.duplicate_intents = sorted(op for op, n in intended_ops.items() if n > 1)

    # duplicates and phantoms at the sink
    key_counts = Counter(a.key for a in applied if a.key is not None)
    op_counts = Counter(a.operation for a in applied if a.operation is not None)
    report.duplicate_keys = sorted(k for k, n in key_counts.items() if n > 1)
    report.duplicate_operations = sorted(o for o, n in op_counts.items() if n > 1)
    operation_of = {i.key: i.operation for i in intents}
    for a in applied:
        if a.key is None or a.key not in operation_of:
            report.phantoms.append(f"key {a.key} (operation {a.operation}): no intent has it")
        elif a.operation != operation_of[a.key]:
            report.phantoms.append(
                f"key {a.key} applied with operation {a.operation}, "
                f"but its intent is operation {operation_of[a.key]}"
            )

    # regressed completed rows
    by_effect: dict[str, list[AttemptRecord]] = {}
    for record in attempts:
        by_effect.setdefault(record.effect_id, []).append(record)
        report.stale += record.outcome == "stale"
    for i in intents:
        log = sorted(by_effect.get(i.id, []), key=lambda r: r.seq)
        first = next((n for n, r in enumerate(log) if _success(r)), None)
        if first is not None:
            later = [r for r in log[first + 1 :] if r.outcome != "stale"]
            if later:
                report.regressed.append(
                    f"{i.id}: succeeded at attempt {log[first].attempt}, then "
                    + ", ".join(f"{r.outcome}@{r.attempt}" for r in later)
                )
            elif i.status not in AFTER_SUCCESS:
                report.regressed.append(
                    f"{i.id}: logged succeeded at attempt {log[first].attempt}, now {i.status}"
                )
        elif i.status == "succeeded":
            report.regressed.append(f"{i.id}: succeeded with no success in its attempt log")
        goes_to_sink = sink_kinds is None or i.kind in sink_kinds
        if i.status == "succeeded" and goes_to_sink and i.key not in key_counts:
            report.regressed.append(f"{i.id}: succeeded but the sink never applied {i.key}")
    return report


# -- reading the real logs ---------------------------------------------------------------------


def _connect(dsn: str) -> psycopg.Connection[Any]:
    return psycopg.connect(dsn, autocommit=True, application_name=CHECKER_APP, connect_timeout=10)


def load_database(dsn: str) -> tuple[list[Intent], list[AttemptRecord]]:
    """Every intent and every attempt record."""
    with _connect(dsn) as conn:
        intents = [
            Intent(str(r[0]), r[1], r[2], r[3], r[4], r[5])
            for r in conn.execute(
                "SELECT id, idempotency_key, kind, status, attempt, payload->'json'->>'operation'"
                " FROM outbox_effects ORDER BY seq"
            )
        ]
        attempts = [
            AttemptRecord(r[0], str(r[1]), r[2], r[3], r[4], r[5])
            for r in conn.execute(
                "SELECT id, effect_id, attempt, outcome, worker, detail"
                " FROM outbox_effect_attempts ORDER BY id"
            )
        ]
    return intents, attempts


def load_sink_log(path: Path) -> tuple[list[Applied], int]:
    """The sink's ``applied`` lines, and how many requests it logged."""
    applied: list[Applied] = []
    requests = 0
    with path.open() as handle:
        for line in handle:
            if not line.strip():
                continue
            entry = json.loads(line)
            if entry.get("event") == "applied":
                applied.append(Applied(entry.get("key"), entry.get("operation")))
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
    intents, attempts = load_database(dsn)
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
    with _connect(dsn) as conn:
        return {
            s: n
            for s, n in conn.execute("SELECT status, count(*) FROM outbox_effects GROUP BY status")
        }


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
