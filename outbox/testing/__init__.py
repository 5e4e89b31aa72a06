"""The crash-consistency kit: check that an agent survives a kill -9 at every crash point.

``outbox check MODULE:FUNCTION --agent A --version V`` on the command line,
:func:`check_agent` from Python, and the ``outbox_check`` pytest fixture
(:mod:`outbox.testing.plugin`, registered as a ``pytest11`` entry point) run
the agent's handler in real ``outbox worker`` processes against a scratch
database, kill them (and the deliverers) with SIGKILL at every crash point in
turn, and check the invariants against an uninterrupted run: nothing lost, no
key or business operation applied twice, no phantom, no regression, every
recorded step replayed without re-running its function, the same result.

Modules: :mod:`~outbox.testing.crash` (the crash points and the trace),
:mod:`~outbox.testing.invariants` (the checker), :mod:`~outbox.testing.compare`
(the uninterrupted reference), :mod:`~outbox.testing.plan`,
:mod:`~outbox.testing.trial`, :mod:`~outbox.testing.supervisor` and
:mod:`~outbox.testing.check` (running the trials), :mod:`~outbox.testing.report`
(the table), :mod:`~outbox.testing.processes` and :mod:`~outbox.testing.forkserver`
(real worker and deliverer processes), :mod:`~outbox.testing.workload` (a
synthetic load for the project's own chaos tests).

Names are imported lazily, so the pytest plugin costs nothing until used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from outbox.testing.check import check_agent
    from outbox.testing.crash import CRASH_POINTS, CrashPoint
    from outbox.testing.plan import CheckOptions
    from outbox.testing.report import CheckReport

__all__ = ["CRASH_POINTS", "CheckOptions", "CheckReport", "CrashPoint", "check_agent"]

_WHERE = {
    "CRASH_POINTS": "outbox.testing.crash",
    "CheckOptions": "outbox.testing.plan",
    "CheckReport": "outbox.testing.report",
    "CrashPoint": "outbox.testing.crash",
    "check_agent": "outbox.testing.check",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'outbox.testing' has no attribute {name!r}")
