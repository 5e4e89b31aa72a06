"""``outbox check`` as a process: bad input is one line, ``--json`` keeps stdout for the report.

A handler that does not import is one line and exit 1. An agent whose result
is read from the clock outside its steps fails the check before any crash
(two uninterrupted runs already disagree), with the report alone on stdout and
the progress on stderr; ``--allow-nondeterministic-result`` lets it pass with a
warning that results were not compared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Reads the clock and randomness outside any step (tests/chaos/broken_agents.py).
STAMPS = [
    "tests.chaos.broken_agents:stamps_its_receipt_outside_a_step",
    "--agent",
    "checkout",
    "--version",
    "1",
    # one crash, when the check goes that far: these tests are about the runs' results
    "--only",
    "after_step@load-order",
]


def check_json(args: list[str], admin_dsn: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``outbox check ARGS --json`` on the session's server, from the repository root.

    A user's own database (``OUTBOX_DSN``, ``./.outbox``) is never used: here one
    that cannot be reached, which the check and its workers must not touch
    (docs/howto/check-your-agent.md, "Where the check runs").
    """
    env = {
        **os.environ,
        "OUTBOX_HOME": str(tmp_path / "never-used"),
        "OUTBOX_DSN": "postgresql://nobody@127.0.0.1:1/yours",
    }
    return subprocess.run(
        [sys.executable, "-m", "outbox", "check", *args, "--dsn", admin_dsn, "--json"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_a_handler_that_does_not_import_is_one_line_and_exit_1(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "outbox", "check", "nomodule:fn", "--agent", "a", "--version", "1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "error: ConfigurationError: handler='nomodule:fn': No module named 'nomodule'"
    )


def test_a_result_read_from_the_clock_outside_a_step_fails_with_json_on_stdout_only(
    admin_dsn: str, tmp_path: Path
) -> None:
    done = check_json(STAMPS, admin_dsn, tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads(done.stdout)  # nothing but the report on stdout
    first = report["first_violation"]
    assert (first["trial"], first["kind"]) == ("uninterrupted", "nondeterministic_result")
    assert "ended otherwise than run" in first["detail"] and "issued_at" in first["detail"]
    assert "--allow-nondeterministic-result" in first["explanation"]
    assert report["violations"] == {"uninterrupted": {"nondeterministic_result": 1}}
    assert [t["id"] for t in report["trials"]] == ["uninterrupted"]  # nothing crashed
    assert "uninterrupted: FAILED" in done.stderr  # the progress, on stderr


def test_allowing_a_result_that_varies_passes_with_a_warning_and_progress_on_stderr(
    admin_dsn: str, tmp_path: Path
) -> None:
    done = check_json([*STAMPS, "--allow-nondeterministic-result"], admin_dsn, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] and report["first_violation"] is None
    assert [t["id"] for t in report["trials"]] == ["uninterrupted", "after_step@load-order"]
    assert any("results are not compared" in w for w in report["warnings"]), report["warnings"]
    assert "--allow-nondeterministic-result" in report["command"]
    for trial in ("uninterrupted", "after_step@load-order"):
        assert f"{trial}: ok" in done.stderr, done.stderr
    assert not (tmp_path / "never-used").exists(), "no embedded server of the user's was started"
