"""``outbox check`` as a process: a handler that does not import is one line, exit 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


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
