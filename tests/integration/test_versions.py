"""G6: a run keeps the version it started with, unless a migration to a newer one is registered."""

from __future__ import annotations

import json
from typing import Any

from click.testing import CliRunner

from outbox import Outbox, Run, RunStatus
from outbox.cli import cli
from tests.support import WorkerThread, wait_for


def v1(run: Run) -> Any:
    run.transaction("plan", lambda tx: tx.set_state({"todo": ["a", "b"], "schema": 1}))
    run.wait_signal("go", name="go", timeout=60)
    return {"finished_by": "1", "state": run.state}


def v2(run: Run) -> Any:
    run.transaction("plan", lambda tx: tx.set_state({"tasks": ["a", "b"], "schema": 2}))
    run.wait_signal("go", name="go", timeout=60)
    return {"finished_by": "2", "state": run.state}


def test_pause_and_drain_then_shim(ob: Outbox, dsn: str) -> None:
    with WorkerThread(ob, "agent", "1", v1):
        old = ob.start_run("agent", "1", {})
        wait_for(lambda: ob.run(old.id).status == RunStatus.WAITING)

    # Deploy 2.x: new runs start on it; the live 1.x run is never touched by 2.x workers.
    with WorkerThread(ob, "agent", "2", v2):
        new = ob.start_run("agent", "2", {})
        wait_for(lambda: ob.run(new.id).status == RunStatus.WAITING)
        ob.signal(old.id, "go", True)
        ob.signal(new.id, "go", True)
        wait_for(lambda: ob.run(new.id).status == RunStatus.COMPLETED)
        assert ob.run(old.id).status == RunStatus.RUNNABLE
        assert ob.run(old.id).version == "1"

    versions = json.loads(
        CliRunner().invoke(cli, ["--dsn", dsn, "runs", "versions", "--json"]).output
    )
    assert versions == [{"agent": "agent", "version": "1", "status": "runnable", "runs": 1}]

    # Pause-and-drain: an old-version worker finishes the old run on the old rules.
    with WorkerThread(ob, "agent", "1", v1):
        wait_for(lambda: ob.run(old.id).status == RunStatus.COMPLETED)
    assert ob.run(old.id).record.result["finished_by"] == "1"
    assert ob.run_versions() == []


def test_a_registered_shim_migrates_state_and_is_recorded(ob: Outbox) -> None:
    with WorkerThread(ob, "agent", "1", v1):
        old = ob.start_run("agent", "1", {})
        wait_for(lambda: ob.run(old.id).status == RunStatus.WAITING)
    ob.signal(old.id, "go", True)

    def shim(state: dict[str, Any]) -> dict[str, Any]:
        return {"tasks": state["todo"], "schema": 2}

    ob.register_upgrade("agent", "1", "2", shim)
    with WorkerThread(ob, "agent", "2", v2):
        wait_for(lambda: ob.run(old.id).status == RunStatus.COMPLETED)
    done = ob.run(old.id)
    assert done.version == "2"
    assert done.record.result == {"finished_by": "2", "state": {"tasks": ["a", "b"], "schema": 2}}
    (migration,) = done.record.upgrades
    assert (migration["from"], migration["to"]) == ("1", "2")
    assert done.completed_steps == ["plan", "go"], "recorded steps were not redone"
