"""Crash points: a process kills itself (SIGKILL) at a named point, and can trace every point.

Only tests and ``outbox check`` enable them, through the environment of the
process under test:

- ``OUTBOX_TEST_CRASH_AT=<point>[:<n>]``: the n-th time (default 1st) execution
  reaches ``<point>``, the process dies as abruptly as ``kill -9``;
- ``OUTBOX_TEST_CRASH_AT=<point>@<where>``: it dies the first time it reaches
  ``<point>`` at ``<where>`` (a step id for the points of a run, an effect kind
  for ``after_call``), so a crash can be aimed at one step of an agent;
- ``OUTBOX_TEST_TRACE=<file>``: every point reached appends one JSON line
  ``{"point", "where", "run", "pid", "t", "crash"}`` to the file (before dying,
  when it dies there), which is how ``outbox check`` learns an agent's points
  and counts how often each step function ran.

The environment is read once, at the first point a process reaches (a step
goes through five points: with both unset, each costs a global lookup);
:func:`reset` reads it again, for a test that changes it in-process.

Points of an agent worker (:mod:`outbox.runs`): ``step_start`` (a recorded step's
function is about to run), ``step_end`` (it returned; its checkpoint is not
written yet), ``before_step_commit`` (inside the step's transaction, its
statement ran, before commit; a step that wrote no rows of its own commits with
its one statement, and the point is then just before it is sent),
``after_commit`` (committed, before the wake-up is sent), ``after_step``
(committed and woken, before the next step),
``parked`` (a wait parked the run; the worker lets go of it),
``during_upgrade`` (inside the transaction that moves a run to a newer agent
version) and ``after_upgrade`` (that transaction committed, before the new
version's handler runs).

Points of a deliverer (:mod:`outbox.delivery`): ``after_claim`` (claimed, before
the outside call), ``after_call`` (the sink answered, before the completion is
written), ``during_completion`` (the completion statement ran, before its
commit), ``after_note`` (a note about its attempt was stored, before it calls
the sink), ``after_send`` (a transactional ``kafka.publish`` had its record
acknowledged inside its open transaction, before the commit); of a relay:
``after_dispatch_claim`` (a batch claimed into ``dispatched``, before it is
published) and ``after_publish`` (Kafka answered for the records, before what
failed is given back); of ``outbox gc``: ``gc_archived`` (a batch is
archived and fsynced, before its delete commits).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

__all__ = ["CRASH_ENV", "POINTS", "TRACE_ENV", "crash_point", "parse_target", "reset"]

WORKER_POINTS = (
    "step_start",
    "step_end",
    "before_step_commit",
    "after_commit",
    "after_step",
    "parked",
    "during_upgrade",
    "after_upgrade",
)
DELIVERER_POINTS = ("after_claim", "after_note", "after_send", "after_call", "during_completion")
RELAY_POINTS = ("after_dispatch_claim", "after_publish")
MAINTENANCE_POINTS = ("gc_archived",)
POINTS = frozenset(WORKER_POINTS + DELIVERER_POINTS + RELAY_POINTS + MAINTENANCE_POINTS)
CRASH_ENV = "OUTBOX_TEST_CRASH_AT"
TRACE_ENV = "OUTBOX_TEST_TRACE"

_lock = threading.Lock()
_hits: dict[str, int] = {}
#: (crash target, trace file) as the environment said at the first point reached.
_config: tuple[tuple[str, str | None, int] | None, str | None] | None = None


def _read_config() -> tuple[tuple[str, str | None, int] | None, str | None]:
    global _config
    raw = os.environ.get(CRASH_ENV)
    _config = (parse_target(raw) if raw else None, os.environ.get(TRACE_ENV) or None)
    return _config


def reset() -> None:
    """Read the environment again at the next point, and forget the hits counted so far."""
    global _config
    with _lock:
        _config = None
        _hits.clear()


def parse_target(raw: str) -> tuple[str, str | None, int]:
    """``point[:n]`` or ``point@where`` as (point, where, n); raises ValueError if malformed."""
    if "@" in raw:
        name, _, where = raw.partition("@")
        if not where:
            raise ValueError(f"{CRASH_ENV}={raw!r}: nothing after '@'")
        count = 1
        target_where: str | None = where
    else:
        name, _, number = raw.partition(":")
        count = int(number or 1)
        target_where = None
    if name not in POINTS:
        raise ValueError(f"{CRASH_ENV}={raw!r}: no crash point {name!r} (known: {sorted(POINTS)})")
    if count < 1:
        raise ValueError(f"{CRASH_ENV}={raw!r}: the count must be at least 1")
    return name, target_where, count


def _trace(path: str, name: str, where: str | None, run: str | None, crash: bool) -> None:
    line = {"point": name, "where": where, "run": run, "pid": os.getpid(), "t": time.time()}
    if crash:
        line["crash"] = True
    # One write of one line with O_APPEND: lines of concurrent processes never interleave.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(line) + "\n").encode())
    finally:
        os.close(fd)


def crash_point(name: str, where: str | None = None, *, run: object = None) -> None:
    """Die here if the environment says so (tests and ``outbox check`` only); trace if asked.

    ``where`` says which occurrence this is (a step id, an effect kind);
    ``run`` the run it belongs to, for the trace.
    """
    armed, trace = _config if _config is not None else _read_config()
    if armed is None and trace is None:
        return
    crash = False
    if armed is not None:
        target, target_where, count = armed
        if target == name and (target_where is None or target_where == where):
            with _lock:
                _hits[name] = _hits.get(name, 0) + 1
                crash = _hits[name] == count
    if trace:
        _trace(trace, name, where, None if run is None else str(run), crash)
    if crash:
        os.kill(os.getpid(), signal.SIGKILL)
