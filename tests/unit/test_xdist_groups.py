"""Tests that share one thing run on one worker: ``--dist loadgroup`` must see their group.

The Citus cluster, the TypeScript build and Chromium are each used by tests of
one ``xdist_group``. pytest 9.2 builds a test's node id anew, so pytest-xdist
(3.8) could no longer tag it with its group: each group's tests went to both
workers, and two workers installed and built the TypeScript client at once
(one found ``node_modules`` half made: ``tsc: not found``). A real pytest run
with two workers, on a module of its own.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

MODULE = """
import pytest

pytestmark = pytest.mark.xdist_group("shared")


@pytest.mark.parametrize("n", range(6))
def test_one_of_a_group(n):
    pass
"""


def test_a_groups_tests_run_on_one_worker(tmp_path: Path) -> None:
    (tmp_path / "test_grouped.py").write_text(MODULE)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-n",
            "2",
            "--dist",
            "loadgroup",
            "-v",
            "-p",
            "no:cacheprovider",
            "-c",
            "/dev/null",
            "--rootdir",
            str(tmp_path),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    workers = set(re.findall(r"\[(gw\d)\] .*PASSED .*test_one_of_a_group", done.stdout))
    assert len(workers) == 1, done.stdout
    assert "test_one_of_a_group[0]@shared" in done.stdout, done.stdout
