"""Deploy a new agent version during a live run, with real `outbox worker` processes.

Expected: the run keeps its version under pause-and-drain (a new-version worker
never touches it; an old-version worker finishes it); with a registered shim it
continues on the new version with migrated state, the migration recorded.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from outbox import Outbox, RunStatus
from outbox.check.processes import Fleet, Process
from tests.support import wait_for


def worker(env: dict[str, str], version: str, log: Path, *extra: str) -> Process:
    """An ``outbox worker`` of version ``version`` (with ``--setup`` and such in ``extra``)."""
    fleet = Fleet(env, log.parent, None, agent="deploy")
    return fleet.worker(*extra, handler=f"tests.chaos.versioned_agents:v{version}", version=version)


def stop(proc: Process) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0


def test_pause_and_drain_with_worker_processes(
    ob: Outbox, sub_env: dict[str, str], tmp_path: Path
) -> None:
    old_worker = worker(sub_env, "1", tmp_path / "v1.log")
    old = ob.start_run("deploy", "1", {})
    wait_for(lambda: ob.run(old.id).status == RunStatus.WAITING, timeout=60)
    stop(old_worker)  # the deploy: 1.x workers go away for a while
    new_worker = worker(sub_env, "2", tmp_path / "v2.log")
    try:
        new = ob.start_run("deploy", "2", {})
        ob.signal(old.id, "go", True)
        ob.signal(new.id, "go", True)
        wait_for(lambda: ob.run(new.id).status == RunStatus.COMPLETED, timeout=60)
        time.sleep(1.0)
        assert ob.run(old.id).status == RunStatus.RUNNABLE, "2.x never took the 1.x run"
        assert ob.run(old.id).version == "1"
    finally:
        stop(new_worker)
    drain = worker(sub_env, "1", tmp_path / "v1-drain.log")
    try:
        wait_for(lambda: ob.run(old.id).status == RunStatus.COMPLETED, timeout=60)
    finally:
        stop(drain)
    assert ob.run(old.id).record.result["finished_by"] == "1"
    assert ob.run_versions() == []


def test_shim_with_worker_processes(ob: Outbox, sub_env: dict[str, str], tmp_path: Path) -> None:
    old_worker = worker(sub_env, "1", tmp_path / "v1.log")
    old = ob.start_run("deploy", "1", {})
    wait_for(lambda: ob.run(old.id).status == RunStatus.WAITING, timeout=60)
    stop(old_worker)
    ob.signal(old.id, "go", True)
    new_worker = worker(
        sub_env, "2", tmp_path / "v2.log", "--setup", "tests.chaos.versioned_agents:shim"
    )  # the same hand-over `outbox check --upgrade-to` crashes in: tests/chaos/test_check.py
    try:
        wait_for(lambda: ob.run(old.id).status == RunStatus.COMPLETED, timeout=60)
    finally:
        stop(new_worker)
    done = ob.run(old.id)
    assert done.version == "2"
    assert done.record.result == {"finished_by": "2", "state": {"tasks": ["a", "b"], "schema": 2}}
    assert [(m["from"], m["to"]) for m in done.record.upgrades] == [("1", "2")]
    assert done.completed_steps == ["plan", "go"]
