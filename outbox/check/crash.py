"""The crash points ``outbox check`` aims at, what each one proves, and the trace that finds them.

The points themselves live in :mod:`outbox.faults` (the code of a run, a
worker or a deliverer calls ``crash_point(name, where)``); this module is the
catalogue a person reads in a report, the environment that arms one point in
a child process, and the reader of the trace a traced process leaves.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from outbox.faults import CRASH_ENV, TRACE_ENV

__all__ = [
    "CRASH_ENV",
    "CRASH_POINTS",
    "DELIVERER_POINTS",
    "TRACE_ENV",
    "UPGRADE_POINTS",
    "WORKER_POINTS",
    "CrashPoint",
    "TraceEvent",
    "occurrences",
    "read_trace",
    "target",
]

Role = Literal["worker", "deliverer", "upgrade"]


@dataclass(frozen=True)
class CrashPoint:
    """One named point where a process can be killed, and what surviving it shows."""

    name: str
    role: Role
    #: Where the process is when it dies.
    when: str
    #: What a correct recovery looks like.
    expected: str


WORKER_POINTS: tuple[CrashPoint, ...] = (
    CrashPoint(
        "step_start",
        "worker",
        "a recorded step's function is about to run",
        "the step runs on resume; nothing of it was written",
    ),
    CrashPoint(
        "step_end",
        "worker",
        "the step's function returned; its checkpoint is not written",
        "the function runs again on resume (once more, no more); its intents are written once",
    ),
    CrashPoint(
        "before_step_commit",
        "worker",
        "inside the step's transaction, before commit",
        "the transaction rolls back whole; the step runs again on resume",
    ),
    CrashPoint(
        "after_commit",
        "worker",
        "the step committed; the deliverers' wake-up is not sent",
        "the step is replayed, not re-run; its intents are found by the deliverers' poll",
    ),
    CrashPoint(
        "after_step",
        "worker",
        "the step committed and the deliverers were woken",
        "the step is replayed, not re-run",
    ),
    CrashPoint(
        "parked",
        "worker",
        "a wait parked the run (it holds no worker)",
        "the run is woken by its signal, timer or effect and resumed by another worker",
    ),
)

DELIVERER_POINTS: tuple[CrashPoint, ...] = (
    CrashPoint(
        "after_claim",
        "deliverer",
        "the deliverer claimed effects, before calling the sink",
        "the attempts expire and are delivered by another deliverer, with the same keys",
    ),
    CrashPoint(
        "after_note",
        "deliverer",
        "the deliverer noted where its attempt will land (kafka.publish), before the call",
        "the next attempt reads the note back: settled from the sink, or sent again once",
    ),
    CrashPoint(
        "after_send",
        "deliverer",
        "a transactional kafka.publish was acknowledged inside its open Kafka transaction",
        "the transaction is fenced and aborted; the effect is published again, read once",
    ),
    CrashPoint(
        "after_call",
        "deliverer",
        "the sink answered; the outcome is not recorded",
        "redelivered with the same key (idempotent kinds) or left `unknown` for an operator",
    ),
    CrashPoint(
        "during_completion",
        "deliverer",
        "the outcome's statement ran, before its commit",
        "as after_call: the completion is lost with the transaction",
    ),
)

UPGRADE_POINTS: tuple[CrashPoint, ...] = (
    CrashPoint(
        "during_upgrade",
        "upgrade",
        "a new-version worker took an old-version run; its upgrade is not committed",
        "the run is still at the old version and is upgraded once by the next worker",
    ),
    CrashPoint(
        "after_upgrade",
        "upgrade",
        "the run was upgraded to the new version; its handler has not run",
        "the run continues at the new version with the migrated state, upgraded once",
    ),
)

CRASH_POINTS: dict[str, CrashPoint] = {
    p.name: p for p in WORKER_POINTS + DELIVERER_POINTS + UPGRADE_POINTS
}


def target(point: str, where: str | None = None) -> str:
    """The value of ``OUTBOX_TEST_CRASH_AT`` that kills at ``point`` (at ``where``, if given)."""
    return point if where is None else f"{point}@{where}"


@dataclass(frozen=True)
class TraceEvent:
    """One line of a trace: a process reached a point."""

    point: str
    where: str | None
    run: str | None
    pid: int
    t: float
    crash: bool = False


def read_trace(path: Path) -> list[TraceEvent]:
    """Every event of a trace file, in the order written (a missing file is an empty trace)."""
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except ValueError:  # a line cut short by the very kill it reports: nothing else is
            continue
        events.append(
            TraceEvent(
                point=raw["point"],
                where=raw.get("where"),
                run=raw.get("run"),
                pid=int(raw["pid"]),
                t=float(raw["t"]),
                crash=bool(raw.get("crash", False)),
            )
        )
    return events


def occurrences(events: Iterable[TraceEvent], point: str, run: str | None = None) -> list[str]:
    """The distinct places (``where``) ``point`` was reached, in first-reached order."""
    seen: dict[str, None] = {}
    for event in events:
        if event.point == point and event.where is not None and (run is None or event.run == run):
            seen.setdefault(event.where, None)
    return list(seen)
