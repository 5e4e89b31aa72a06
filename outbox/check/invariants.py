"""The invariant checker: the database, the sink's log and the attempt log compared after a crash.

1. The intents, as PostgreSQL has them (``outbox_effects``).
2. The sink's log (JSON lines, :class:`deliverers.record.RecordingSink`): every
   request as it arrived, and an ``applied`` line each time one took effect.
3. The completion records (``outbox_effect_attempts``): the attempt log.

Each effect is also named by its *business operation* (:func:`operation_of`):
the payload's ``operation`` field when it has one, else a digest of its kind
and payload. Two intents for one operation are two keys no sink could dedup.

Violations (each must be 0):

- ``lost``: an intent that is neither terminal nor ``unknown`` (G3), or an
  operation expected (from an uninterrupted run) for which there is no intent;
- ``duplicate_keys`` / ``duplicate_operations``: a key, or a business
  operation, applied at the sink more often than expected (G2);
  ``duplicate_intents``: one operation intended more often than expected;
- ``phantoms``: applied at the sink with no intent behind it (its key unknown
  to the database, or applied with a body that is not its intent's, or sent
  with no key at all when an uninterrupted run sends none);
- ``regressed``: a completed row that moved on: its attempt log shows a
  success followed by a later entry that is not ``stale`` (G4), or it logged a
  success but its status is no longer ``succeeded``, or it is ``succeeded`` while
  the sink never applied its key;
- ``reran``: a recorded step's function ran again after its step had committed
  (G5; from the trace of :mod:`outbox.faults`);
- ``result_differs`` / ``unfinished``: a run ended other than an uninterrupted
  run of the same inputs did, or did not end;
- ``nondeterministic_result``: two runs of the same inputs in a reference
  trial (the uninterrupted one, a hand-over) ended differently, so no crashed
  run could be compared with them (``outbox check
  --allow-nondeterministic-result`` turns this off, and the comparison with it).

``unknown`` effects are not violations (they are visible, for an operator);
they are counted in the report.

:func:`check` is pure (the unit tests feed it hand-made logs); :mod:`outbox.check.logs`
reads the real ones and waits until nothing is pending or in flight.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from outbox.check.crash import TraceEvent
from outbox.models import TERMINAL_EFFECT_STATUSES

__all__ = [
    "AFTER_SUCCESS",
    "Applied",
    "AttemptRecord",
    "Intent",
    "Report",
    "check",
    "operation_of",
    "replay_violations",
]

TERMINAL = frozenset(str(s) for s in TERMINAL_EFFECT_STATUSES)
OPEN = ("pending", "in_flight", "dispatched")
#: Statuses a row may reach after a recorded success (a cancelled run's undo).
AFTER_SUCCESS = frozenset({"succeeded", "compensated"})

#: Rewrites text before it names an operation (``outbox check`` masks run ids and URLs).
Normalize = Callable[[str], str]


def unchanged(text: str) -> str:
    return text


def operation_of(kind: str, payload: Any, normalize: Normalize = unchanged) -> str:
    """The business operation an effect performs.

    The payload's ``operation`` field (or its ``json.operation``, for an HTTP
    request's body) when there is one; else ``kind#digest`` of the payload.
    ``normalize`` is applied to the text first (to mask what differs between
    two runs of the same inputs: the run's id, a sink's port).
    """
    if isinstance(payload, dict):
        named = payload.get("operation")
        body = payload.get("json")
        if named is None and isinstance(body, dict):
            named = body.get("operation")
        if isinstance(named, str):
            return normalize(named)
    canonical = normalize(json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str))
    return f"{kind}#{hashlib.sha256(canonical.encode()).hexdigest()[:12]}"


@dataclass(frozen=True)
class Intent:
    """One row of ``outbox_effects`` (what the checker needs of it)."""

    id: str
    key: str
    kind: str
    status: str
    attempt: int
    operation: str | None = None
    run: str | None = None
    step: str | None = None
    #: The payload as JSON text: a run-less intent is placed by the run it names.
    payload: str | None = None


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
    #: The request's path and body, for a report (``operation`` is derived from them).
    path: str | None = None
    body: str | None = None
    #: When it took effect (``time.time()``), to place it among a trace's events.
    t: float | None = None


@dataclass
class Report:
    """What :func:`check` found."""

    lost: list[str] = field(default_factory=list)
    duplicate_keys: list[str] = field(default_factory=list)
    duplicate_operations: list[str] = field(default_factory=list)
    duplicate_intents: list[str] = field(default_factory=list)
    phantoms: list[str] = field(default_factory=list)
    regressed: list[str] = field(default_factory=list)
    reran: list[str] = field(default_factory=list)
    result_differs: list[str] = field(default_factory=list)
    unfinished: list[str] = field(default_factory=list)
    nondeterministic_result: list[str] = field(default_factory=list)
    #: A reference run (uninterrupted, or handed over) did not complete.
    reference_failed: list[str] = field(default_factory=list)
    #: Two runs of the same inputs, side by side, recorded different step ids.
    unstable_step_ids: list[str] = field(default_factory=list)
    #: Crash points the uninterrupted run reached and this trial's processes never did.
    not_reached: list[str] = field(default_factory=list)
    #: Not violations: context for the reader.
    statuses: dict[str, int] = field(default_factory=dict)
    applied: int = 0
    requests: int = 0
    stale: int = 0

    # In the order a report names the first: a reference that cannot be one, then
    # what a crash broke, then a plan the trial could not carry out, then outcomes.
    VIOLATIONS = (
        "reference_failed",
        "unstable_step_ids",
        "lost",
        "duplicate_keys",
        "duplicate_operations",
        "duplicate_intents",
        "phantoms",
        "regressed",
        "reran",
        "not_reached",
        "result_differs",
        "unfinished",
        "nondeterministic_result",
    )

    def counts(self) -> dict[str, int]:
        """Violations by name (all 0 when the guarantees held)."""
        return {name: len(getattr(self, name)) for name in self.VIOLATIONS}

    @property
    def clean(self) -> bool:
        """No violation of any kind."""
        return not any(self.counts().values())

    def first(self) -> tuple[str, str] | None:
        """The first violation found, as (kind, description), in :attr:`VIOLATIONS` order."""
        for name in self.VIOLATIONS:
            found = getattr(self, name)
            if found:
                return name, found[0]
        return None

    def summary(self) -> str:
        """Counts, context, and the first ten of each violation."""
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
        """Raise ``AssertionError`` with the summary unless clean."""
        assert self.clean, f"{self.summary()}\n{context}".rstrip()


def _success(record: AttemptRecord) -> bool:
    """True when this log entry records the effect as done (deliverer, lookup or operator)."""
    detail = record.detail if isinstance(record.detail, dict) else {}
    if record.outcome == "succeeded":
        return True
    if record.outcome == "looked_up":
        return detail.get("lookup") == "applied"
    if record.outcome == "resolved":
        return detail.get("as") == "succeeded"
    return False


def _expected(
    expected_operations: Iterable[str] | None, expected_counts: Mapping[str, int] | None
) -> dict[str, int] | None:
    if expected_counts is not None:
        return dict(expected_counts)
    if expected_operations is not None:
        return dict.fromkeys(expected_operations, 1)
    return None


def check(
    intents: Iterable[Intent],
    attempts: Iterable[AttemptRecord],
    applied: Iterable[Applied],
    *,
    requests: int = 0,
    expected_operations: Iterable[str] | None = None,
    expected_counts: Mapping[str, int] | None = None,
    sink_kinds: Iterable[str] | None = None,
    keyless_allowed: Iterable[str] = (),
) -> Report:
    """Compare the three logs.

    ``expected_operations`` (each intended once) or ``expected_counts`` (how
    many intents, and applications, of each operation an uninterrupted run
    makes; absent operations count 1) name what must be there; ``sink_kinds``
    the kinds whose effects go to this sink (default all); ``keyless_allowed``
    operations an uninterrupted run sends without a key (no phantom, but still
    counted for duplicates).
    """
    intents = list(intents)
    applied = list(applied)
    expected = _expected(expected_operations, expected_counts)
    keyless_ok = set(keyless_allowed)
    report = Report(requests=requests, applied=len(applied))
    report.statuses = dict(Counter(i.status for i in intents))
    sinks = None if sink_kinds is None else set(sink_kinds)

    # lost: open intents, and expected operations with too few intents
    report.lost = sorted(
        f"{i.id} ({i.kind}, {i.status}, attempt {i.attempt})"
        for i in intents
        if i.status not in TERMINAL and i.status != "unknown"
    )
    intended_ops = Counter(i.operation for i in intents if i.operation is not None)
    if expected is not None:
        for op, n in sorted(expected.items()):
            if intended_ops[op] < n and op not in keyless_ok:
                have = intended_ops[op]
                report.lost.append(
                    f"operation {op}: no intent"
                    if have == 0
                    else f"operation {op}: intended {have}x, {n}x expected"
                )
    report.duplicate_intents = sorted(
        op for op, n in intended_ops.items() if n > (expected or {}).get(op, 1)
    )

    # duplicates and phantoms at the sink
    key_counts = Counter(a.key for a in applied if a.key is not None)
    op_counts = Counter(a.operation for a in applied if a.operation is not None)
    report.duplicate_keys = sorted(k for k, n in key_counts.items() if n > 1)
    report.duplicate_operations = sorted(
        o for o, n in op_counts.items() if n > (expected or {}).get(o, 1)
    )
    operation_of_key = {i.key: i.operation for i in intents}
    for a in applied:
        if a.key is None:
            if a.operation not in keyless_ok:
                report.phantoms.append(f"operation {a.operation}: applied without a key or intent")
        elif a.key not in operation_of_key:
            report.phantoms.append(f"key {a.key} (operation {a.operation}): no intent has it")
        elif a.operation != operation_of_key[a.key]:
            report.phantoms.append(
                f"key {a.key} applied with operation {a.operation}, "
                f"but its intent is operation {operation_of_key[a.key]}"
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
        goes_to_sink = sinks is None or i.kind in sinks
        if i.status == "succeeded" and goes_to_sink and i.key not in key_counts:
            report.regressed.append(f"{i.id}: succeeded but the sink never applied {i.key}")
    return report


def replay_violations(events: Iterable[TraceEvent]) -> tuple[list[str], dict[tuple[str, str], int]]:
    """Steps whose function ran after the step committed; and how often each step function ran.

    Reads a trace: ``step_start`` is a run of a step's function, ``after_commit``
    its commit. A second run before any commit is expected after a crash (the
    first never recorded anything); a run after the commit is a violation (G5).
    """
    started: Counter[tuple[str, str]] = Counter()
    committed: set[tuple[str, str]] = set()
    reran: list[str] = []
    for event in events:
        if event.run is None or event.where is None:
            continue
        step = (event.run, event.where)
        if event.point == "step_start":
            started[step] += 1
            if step in committed:
                reran.append(
                    f"step {event.where!r} of run {event.run}: its function ran again "
                    f"(pid {event.pid}) after the step had committed"
                )
        elif event.point == "after_commit":
            committed.add(step)
    return reran, dict(started)
