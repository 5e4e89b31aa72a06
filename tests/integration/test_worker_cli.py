"""``outbox worker`` options act: ``--grace`` bounds the shutdown of a real worker process."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from outbox import Outbox

ROOT = Path(__file__).resolve().parents[2]


def _wait_running(ob: Outbox, run_id: object, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while ob.run(str(run_id)).status.value != "running":
        assert proc.poll() is None, "the worker exited before claiming the run"
        assert time.monotonic() < deadline, "the worker never claimed the run"
        time.sleep(0.1)


def spawn_worker(
    env: dict[str, str], log: Path, handler: str, *options: str
) -> subprocess.Popen[bytes]:
    """A real ``outbox worker`` process running ``tests.fixtures_callables:<handler>``."""
    command = ["worker", f"tests.fixtures_callables:{handler}", *options]
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "outbox", *command],
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


@pytest.mark.parametrize("handler", ["slow_async_handler", "slow_handler"])
def test_grace_bounds_how_long_a_stopping_worker_waits_for_its_handlers(
    ob: Outbox, sub_env: dict[str, str], tmp_path: Path, handler: str
) -> None:
    run = ob.start_run("slow", "1")
    log = tmp_path / "worker.log"
    proc = spawn_worker(
        sub_env, log, handler, "--agent", "slow", "--version", "1", "--grace", "1", "--lease", "5"
    )
    try:
        _wait_running(ob, run.id, proc)
        stopped = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        # The default grace is 30 s; with --grace 1 the worker gives up on the handler
        # after a second (the bound leaves room for a loaded machine).
        code = proc.wait(timeout=20)
        waited = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0, log.read_text()
    assert waited < 20
    assert "grace period over: 1 runs are left to their leases" in log.read_text()
    # The run is left to its lease: another worker resumes it when the lease runs out.
    assert ob.run(run.id).status.value == "running"


@pytest.mark.parametrize("handler", ["sleepy_async_handler", "sleepy_handler"])
def test_leases_are_kept_while_handlers_finish_within_the_grace_period(
    ob: Outbox, sub_env: dict[str, str], tmp_path: Path, handler: str
) -> None:
    run = ob.start_run("sleepy", "1")
    log = tmp_path / "worker.log"
    proc = spawn_worker(
        sub_env,
        log,
        handler,
        "--agent",
        "sleepy",
        "--version",
        "1",
        "--grace",
        "30",
        "--lease",
        "1",
    )
    try:
        _wait_running(ob, run.id, proc)
        proc.send_signal(signal.SIGTERM)
        # Three leases later: a worker that stopped renewing at SIGTERM has lost the
        # run by now, and this rescue hands it to nobody (no other worker runs).
        time.sleep(2.5)
        assert ob.store.rescue_expired_runs() == 0
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0, log.read_text()
    record = ob.run(run.id).record
    assert (record.status.value, record.result) == ("completed", "done"), log.read_text()
