"""Issue 27, items 9 and 15: ``outbox check`` cannot pass a broken agent, and leaves no process.

- an agent whose uninterrupted run fails has nothing to be compared with: exit 1;
- a step id that differs between two uninterrupted runs (a random part) is a
  violation with the guide's advice, and a planned crash point that no trial
  reaches (a step id naming the worker's process) fails the check instead of
  passing as "not reached";
- an agent's own children (a helper that ignores SIGTERM) die with the worker
  that started them: every process of a trial runs in a process group of its
  own, killed whole.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from outbox.check.check import check_agent
from outbox.check.plan import CheckOptions
from outbox.check.report import CheckReport, plain_text

ROOT = Path(__file__).resolve().parents[2]
AGENTS = "tests.chaos.broken_agents"


def check(admin_dsn: str, handler: str, **options: object) -> CheckReport:
    opts = CheckOptions(handler=f"{AGENTS}:{handler}", agent="checkout", version="1", **options)
    return check_agent(opts, server_dsn=admin_dsn)


def test_an_agent_that_fails_every_run_fails_the_check_with_exit_1(
    admin_dsn: str, tmp_path: Path
) -> None:
    env = {**os.environ, "OUTBOX_HOME": str(tmp_path / "never-used")}
    env.pop("OUTBOX_DSN", None)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "outbox",
            "check",
            f"{AGENTS}:raises_on_every_run",
            "--agent",
            "checkout",
            "--version",
            "1",
            "--dsn",
            admin_dsn,
            "--json",
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads(done.stdout)
    first = report["first_violation"]
    assert (first["trial"], first["kind"]) == ("uninterrupted", "reference_failed")
    assert "the payment provider is not configured" in first["detail"]
    assert "uninterrupted run" in first["explanation"]


def test_a_step_id_that_differs_between_two_runs_is_a_violation_with_advice(
    admin_dsn: str,
) -> None:
    report = check(admin_dsn, "charges_under_a_fresh_step_id")
    assert not report.ok, plain_text(report)
    first = report.first_violation()
    assert first is not None
    assert (first.trial, first.kind) == ("uninterrupted", "unstable_step_ids")
    assert "charge-" in first.detail
    assert "Keep step ids stable" in first.explanation


def test_a_planned_crash_point_never_reached_fails_the_check(admin_dsn: str) -> None:
    report = check(admin_dsn, "charges_under_a_step_id_of_its_process", jobs=2)
    text = plain_text(report)
    assert not report.ok, text
    first = report.first_violation()
    assert first is not None and first.kind == "not_reached", text
    assert "charge-" in first.detail and "never reached" in first.detail
    assert "the run had moved past it" not in text  # no longer said of a step never reached


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def test_an_agents_children_die_with_their_worker(
    admin_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pids_file = tmp_path / "helpers"
    pids_file.touch()
    monkeypatch.setenv("CHECK_HELPER_PIDS", str(pids_file))
    try:
        report = check(
            admin_dsn, "starts_a_stubborn_helper", only=("step_end@start-helper",), jobs=1
        )
        assert report.ok, plain_text(report)
        pids = [int(line) for line in pids_file.read_text().split()]
        # Two uninterrupted runs, then a run whose worker was killed after starting one
        # and a resumed run that started another.
        assert len(pids) >= 3, pids
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p for p in pids if _alive(p)] == []
    finally:
        for pid in [int(line) for line in pids_file.read_text().split()]:
            if _alive(pid):
                os.kill(pid, 9)


def _descendants(root: int) -> set[int]:
    """Every process under ``root`` (from /proc), at this moment."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            parents[int(entry.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def test_a_check_stopped_by_sigterm_to_its_group_leaves_no_process_behind(
    admin_dsn: str, tmp_path: Path
) -> None:
    """What `timeout`, a CI runner or a service manager does: SIGTERM to the whole group."""
    pids_file = tmp_path / "helpers"
    pids_file.touch()
    env = {
        **os.environ,
        "OUTBOX_HOME": str(tmp_path / "never-used"),
        "CHECK_HELPER_PIDS": str(pids_file),
        "CHECK_HELPER_LINGER": "60",
    }
    env.pop("OUTBOX_DSN", None)
    args = ["check", f"{AGENTS}:starts_a_stubborn_helper", "--agent", "checkout"]
    check_proc = subprocess.Popen(
        [sys.executable, "-m", "outbox", *args, "--version", "1", "--dsn", admin_dsn],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        process_group=0,
    )
    try:
        deadline = time.monotonic() + 120
        while not pids_file.read_text().strip() and time.monotonic() < deadline:
            assert check_proc.poll() is None, "the check ended before its helper started"
            time.sleep(0.2)
        assert pids_file.read_text().strip(), "no helper started"
        time.sleep(0.5)
        under = _descendants(check_proc.pid)
        assert under, "the check has no processes"
        os.killpg(check_proc.pid, 15)
        assert check_proc.wait(timeout=60) != 0
        helpers = {int(line) for line in pids_file.read_text().split()}
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in under | helpers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p for p in under | helpers if _alive(p)] == []
    finally:
        if check_proc.poll() is None:
            os.killpg(check_proc.pid, 9)
            check_proc.wait(timeout=30)
        for pid in [int(line) for line in pids_file.read_text().split()]:
            if _alive(pid):
                os.kill(pid, 9)
