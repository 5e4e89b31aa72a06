"""The framework examples run as written (here on the test's database instead of ./.outbox)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("script", "applied"),
    [
        ("pydantic_ai_refunds.py", "sink: 1 refund applied"),
        ("langgraph_refunds.py", "sink: 2"),
        ("openai_agents_refunds.py", "sink: 1 refund applied"),
    ],
)
def test_an_example_completes_and_its_replay_calls_no_model(
    script: str, applied: str, sub_env: dict[str, str], tmp_path: Path
) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script)],
        cwd=tmp_path,
        env=sub_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(status completed)" in done.stdout
    assert applied in done.stdout
    assert done.stdout.rstrip().endswith(": 0"), done.stdout
