"""The README main command works on a fresh home: zero lost, zero duplicates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from outbox import EmbeddedServer
from tests.support import embedded_home


@pytest.mark.slow
def test_outbox_demo_on_a_fresh_home(tmp_path: Path) -> None:
    home = embedded_home() / ".outbox"
    env = {k: v for k, v in os.environ.items() if k != "OUTBOX_DSN"}
    env["OUTBOX_HOME"] = str(home)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "outbox", "demo", "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
            cwd=tmp_path,
        )
    finally:
        EmbeddedServer(home).stop(mode="immediate")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["runs_completed"] == 4 and summary["runs_compensated"] == 1
    assert summary["lost"] == 0 and summary["duplicates_applied_at_sink"] == 0
    assert summary["phantom"] == 0
    assert summary["effects_delivered"] == summary["effects_intended"] > 100
    assert summary["attempts_recovered_after_crash"] > 0, "a deliverer was killed mid-call"
    assert summary["attempts_retried"] > 0, "the sink's 429s were retried"
    assert len(summary["events"]) == 4
    assert summary["seconds"] < 60
