"""Two versions of one agent, for the deploy test run by real `outbox worker` processes."""

from __future__ import annotations

from typing import Any

from outbox import Outbox, Run


def v1(run: Run) -> Any:
    """Version 1 keeps a to-do list under ``todo``."""
    run.transaction("plan", lambda tx: tx.set_state({"todo": ["a", "b"], "schema": 1}))
    run.wait_signal("go", name="go", timeout=600)
    return {"finished_by": "1", "state": run.state}


def v2(run: Run) -> Any:
    """Version 2 calls it ``tasks``; it can finish version-1 runs once their state is migrated."""
    run.transaction("plan", lambda tx: tx.set_state({"tasks": ["a", "b"], "schema": 2}))
    run.wait_signal("go", name="go", timeout=600)
    return {"finished_by": "2", "state": run.state}


def shim(ob: Outbox) -> None:
    """The deploy's `--setup`: version 2 workers may take version 1 runs, migrating state."""
    ob.register_upgrade("deploy", "1", "2", lambda state: {"tasks": state["todo"], "schema": 2})
