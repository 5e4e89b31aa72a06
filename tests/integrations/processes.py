"""Real ``outbox worker`` processes for the framework tests (SIGKILLed at a crash point)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path


def start_worker(
    env: dict[str, str], handler: str, agent: str, log: Path, crash_at: str | None = None
) -> subprocess.Popen[bytes]:
    child = {k: v for k, v in env.items() if k != "OUTBOX_TEST_CRASH_AT"}
    if crash_at is not None:
        child["OUTBOX_TEST_CRASH_AT"] = crash_at
    args = [sys.executable, "-m", "outbox", "worker", handler]
    args += ["--agent", agent, "--version", "1", "--lease", "1"]
    with log.open("ab") as handle:
        return subprocess.Popen(args, env=child, stdout=handle, stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []
