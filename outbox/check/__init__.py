"""The crash-consistency kit: check that an agent survives a kill -9 at every crash point.

``outbox check MODULE:FUNCTION --agent A --version V`` on the command line,
:func:`check_agent` from Python, and the ``outbox_check`` pytest fixture
(:mod:`outbox.check.plugin`, registered as a ``pytest11`` entry point) run
the agent's handler in real ``outbox worker`` processes against a scratch
database, kill them (and the deliverers) with SIGKILL at every crash point in
turn, and check the invariants against an uninterrupted run: nothing lost, no
key or business operation applied twice, no phantom, no regression, every
recorded step replayed without re-running its function, the same result.

Modules: :mod:`~outbox.check.crash` (the crash points and the trace),
:mod:`~outbox.check.invariants` (the checker), :mod:`~outbox.check.compare`
(the uninterrupted reference), :mod:`~outbox.check.plan`,
:mod:`~outbox.check.trial`, :mod:`~outbox.check.supervisor` and
:mod:`~outbox.check.check` (running the trials), :mod:`~outbox.check.report`
(the table), :mod:`~outbox.check.processes` and :mod:`~outbox.check.forkserver`
(real worker and deliverer processes), :mod:`~outbox.check.workload` (a
synthetic load for the project's own chaos tests).

Names are imported lazily, so the pytest plugin costs nothing until used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from outbox.check.check import check_agent
    from outbox.check.crash import CRASH_POINTS, CrashPoint
    from outbox.check.plan import CheckOptions
    from outbox.check.report import CheckReport

__all__ = ["CRASH_POINTS", "CheckOptions", "CheckReport", "CrashPoint", "check_agent"]

_WHERE = {
    "CRASH_POINTS": "outbox.check.crash",
    "CheckOptions": "outbox.check.plan",
    "CheckReport": "outbox.check.report",
    "CrashPoint": "outbox.check.crash",
    "check_agent": "outbox.check.check",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'outbox.check' has no attribute {name!r}")
