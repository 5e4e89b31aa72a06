"""Crash points for fault-injection tests: a process kills itself (SIGKILL) at a named point.

Only tests enable it, through ``OUTBOX_TEST_CRASH_AT=<point>[:<n>]`` in the
environment of the process under test: the n-th time (default 1st) execution
reaches ``<point>``, the process dies as abruptly as ``kill -9``. With the
variable unset, :func:`crash_point` is a dictionary lookup and nothing else.

Points: ``after_claim`` (claimed, before the outside call), ``after_call``
(the sink answered, before the completion is written), ``during_completion``
(the completion statement ran, before its commit), ``after_publish`` (a
relay's records were acknowledged by Kafka, before they are marked
dispatched), ``after_step`` (a run's step committed, before the next),
``before_step_commit`` (inside a step's transaction, before commit),
``gc_archived`` (a ``gc`` batch is archived and fsynced, before its delete commits).
"""

from __future__ import annotations

import os
import signal
import threading

__all__ = ["POINTS", "crash_point"]

POINTS = frozenset(
    {
        "after_claim",
        "after_call",
        "during_completion",
        "after_publish",
        "after_step",
        "before_step_commit",
        "gc_archived",
    }
)
ENV = "OUTBOX_TEST_CRASH_AT"

_lock = threading.Lock()
_hits: dict[str, int] = {}


def _target() -> tuple[str, int] | None:
    raw = os.environ.get(ENV)
    if not raw:
        return None
    name, _, count = raw.partition(":")
    return name, int(count or 1)


def crash_point(name: str) -> None:
    """Die here if the environment says so (tests only)."""
    target = _target()
    if target is None or target[0] != name:
        return
    with _lock:
        _hits[name] = _hits.get(name, 0) + 1
        if _hits[name] == target[1]:
            os.kill(os.getpid(), signal.SIGKILL)
