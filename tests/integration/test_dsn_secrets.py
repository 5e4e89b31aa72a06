"""A DSN's password stays out of the process list: a warning for --dsn, a file or the environment.

The embedded test server authenticates its superuser by peer: a password in the
DSN is accepted and ignored, so every form below connects for real.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from outbox import ConfigurationError, Settings
from outbox.cli._dsn import dsn_has_password

ROOT = Path(__file__).resolve().parents[2]
SECRET = "s3cret-pw"


def outbox(env_extra: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_DSN")}
    env.update(env_extra)
    env["OUTBOX_HOME"] = "/nonexistent/no-embedded-server-here"
    return subprocess.run(
        [sys.executable, "-m", "outbox", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def secret_dsn(dsn: str) -> str:
    return make_url(dsn).set(password=SECRET).render_as_string(hide_password=False)


def test_a_password_given_with_dsn_works_with_one_warning_line(secret_dsn: str) -> None:
    done = outbox({}, "--dsn", secret_dsn, "runs", "list", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert "--dsn puts its password in the process list" in lines[0]
    assert "OUTBOX_DSN" in lines[0] and "--dsn-file" in lines[0]
    assert SECRET not in done.stderr


def test_the_environment_and_a_file_say_nothing(secret_dsn: str, dsn: str, tmp_path: Path) -> None:
    quiet = outbox({"OUTBOX_DSN": secret_dsn}, "runs", "list", "--json")
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    no_password = outbox({}, "--dsn", dsn, "runs", "list", "--json")
    assert no_password.returncode == 0 and no_password.stderr == "", no_password.stderr

    secret = tmp_path / "dsn"
    secret.write_text(secret_dsn + "\n")
    secret.chmod(0o600)
    for how in ({"OUTBOX_DSN_FILE": str(secret)}, {}):
        args = [] if how else ["--dsn-file", str(secret)]
        done = outbox(how, *args, "runs", "list", "--json")
        assert done.returncode == 0 and done.stderr == "", done.stderr
        assert json.loads(done.stdout) == []

    secret.chmod(0o644)
    loose = outbox({}, "--dsn-file", str(secret), "runs", "list", "--json")
    assert loose.returncode == 0
    assert "readable by other users (mode 0644)" in loose.stderr and SECRET not in loose.stderr


def test_ambiguous_or_missing_dsn_sources_are_one_line(secret_dsn: str, tmp_path: Path) -> None:
    secret = tmp_path / "dsn"
    secret.write_text(secret_dsn)
    both = outbox({}, "--dsn", secret_dsn, "--dsn-file", str(secret), "runs", "list")
    assert both.returncode == 2 and "--dsn and --dsn-file are both given" in both.stderr
    both_env = outbox({"OUTBOX_DSN": secret_dsn, "OUTBOX_DSN_FILE": str(secret)}, "runs", "list")
    assert both_env.returncode == 2 and "OUTBOX_DSN and OUTBOX_DSN_FILE" in both_env.stderr
    # The command line beats the environment.
    wins = outbox(
        {"OUTBOX_DSN": "postgresql://nobody@127.0.0.1:1/x"},
        "--dsn-file",
        str(secret),
        "runs",
        "list",
        "--json",
    )
    assert wins.returncode == 0, wins.stderr
    missing = outbox({}, "--dsn-file", str(tmp_path / "nope"), "runs", "list")
    assert missing.returncode == 2 and "nope" in missing.stderr
    for done in (both, both_env, missing):
        assert "Traceback" not in done.stderr and SECRET not in done.stderr


def test_the_library_reads_outbox_dsn_file(tmp_path: Path) -> None:
    secret = tmp_path / "dsn"
    secret.write_text("postgresql://u:pw@db/outbox\n")
    assert Settings.from_env({"OUTBOX_DSN_FILE": str(secret)}).dsn == "postgresql://u:pw@db/outbox"
    with pytest.raises(ConfigurationError, match="both set"):
        Settings.from_env({"OUTBOX_DSN_FILE": str(secret), "OUTBOX_DSN": "postgresql://x/y"})
    with pytest.raises(ConfigurationError, match="OUTBOX_DSN_FILE"):
        Settings.from_env({"OUTBOX_DSN_FILE": str(tmp_path / "missing")})


@pytest.mark.parametrize(
    ("dsn", "has"),
    [
        ("postgresql://u:pw@host/db", True),
        ("postgresql://u@host/db", False),
        ("postgresql://u@host/db?password=pw", True),
        ("postgresql:///db?host=/tmp", False),
        ("host=db user=u password=pw", True),
        ("host=db user=u", False),
    ],
)
def test_which_dsns_carry_a_password(dsn: str, has: bool) -> None:
    assert dsn_has_password(dsn) is has


def test_the_image_does_not_run_as_root() -> None:
    instructions = [
        line.split(None, 1)
        for line in (ROOT / "Dockerfile").read_text().splitlines()
        if line.strip() and not line.startswith((" ", "#"))
    ]
    users = [i for i, (op, *_) in enumerate(instructions) if op == "USER"]
    runs = [i for i, (op, *_) in enumerate(instructions) if op == "RUN"]
    assert users and users[-1] > max(runs), "the last USER comes after every RUN"
    user = instructions[users[-1]][1].split(":")[0].strip()
    assert user not in ("root", "0"), user
