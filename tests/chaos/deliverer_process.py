"""Helpers to run ``outbox deliver`` as a real subprocess against a test's database."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CONFIG = """
[kinds."http.request"]
allow_private = ["127.0.0.1"]

[kinds."http.blind"]
type = "http.request"
idempotent = false
allow_private = ["127.0.0.1"]
"""


def write_config(tmp_path: Path) -> Path:
    path = tmp_path / "deliverers.toml"
    path.write_text(CONFIG)
    return path


def start_deliverer(
    env: dict[str, str], config: Path, log: Path, *extra: str, crash_at: str | None = None
) -> subprocess.Popen[bytes]:
    child_env = dict(env)
    if crash_at is not None:
        child_env["OUTBOX_TEST_CRASH_AT"] = crash_at
    else:
        child_env.pop("OUTBOX_TEST_CRASH_AT", None)
    args = [
        sys.executable,
        "-m",
        "outbox",
        "deliver",
        "--config",
        str(config),
        "--lease",
        "1",
        "--poll",
        "0.2",
        *extra,
    ]
    with log.open("ab") as handle:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(args, env=child_env, stdout=handle, stderr=subprocess.STDOUT)
