"""The fork server of `outbox check`: real processes, each with its own environment and log."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from outbox.check.forkserver import ForkedOutbox, ForkServer
from tests.support import wait_for


def test_a_forked_command_runs_with_its_own_environment_and_log(tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    env = {**os.environ, "OUTBOX_DSN": "postgresql://nobody@/x?host=/nonexistent"}
    proc = ForkedOutbox(["worker", "nomodule:fn", "--agent", "a", "--version", "1"], env, log)
    assert proc.pid != os.getpid()
    assert proc.wait(timeout=60) == 1
    assert "ConfigurationError: handler='nomodule:fn'" in log.read_text()
    proc.send_signal(signal.SIGTERM)  # it has ended: nothing happens


def test_a_forked_command_dies_of_sigkill_like_any_process(tmp_path: Path) -> None:
    log = tmp_path / "sink.log"
    proc = ForkedOutbox(["sink", "--port", "0"], dict(os.environ), log)
    try:
        wait_for(lambda: "sink listening" in log.read_text(), timeout=60, message="the sink")
        assert proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.1)
    finally:
        proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert proc.returncode == -signal.SIGKILL


def test_one_server_serves_the_whole_process() -> None:
    assert ForkServer.shared() is ForkServer.shared()


def test_children_of_a_server_whose_caller_is_gone_are_killed(tmp_path: Path) -> None:
    """A check that is itself killed leaves no worker behind: the server kills its children."""
    server = ForkServer()
    log = tmp_path / "sink.log"
    pid = server.fork(["sink", "--port", "0"], dict(os.environ), log)
    wait_for(lambda: "sink listening" in log.read_text(), timeout=60, message="the sink")
    assert server.close() == 0  # as the caller's death closes the pipe
    wait_for(lambda: not Path(f"/proc/{pid}").exists(), timeout=30, message="the child gone")
