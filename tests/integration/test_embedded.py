"""The embedded server: started on demand, shared by every process, managed by `outbox db`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from outbox import EmbeddedServer, Outbox


def _outbox(
    *args: str, home: Path, env_extra: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "OUTBOX_DSN"}
    env["OUTBOX_HOME"] = str(home)
    env.update(env_extra or {})
    done = subprocess.run(
        [sys.executable, "-m", "outbox", *args],
        env=env,
        text=True,
        capture_output=True,
        timeout=120,
    )
    if check:
        assert done.returncode == 0, done.stderr
    return done


@pytest.fixture
def home(tmp_path: Path):  # type: ignore[no-untyped-def]
    path = tmp_path / ".outbox"
    yield path
    EmbeddedServer(path).stop(mode="immediate")


def test_processes_share_one_server_and_the_cli_manages_it(home: Path) -> None:
    status = json.loads(_outbox("db", "status", "--json", home=home).stdout)
    assert status["initialized"] is False and status["running"] is False

    started = json.loads(_outbox("db", "start", "--json", home=home).stdout)
    assert started["running"] is True and started["pid"]

    # A second process (and this one) attach to the same server instead of starting another.
    listed = _outbox("runs", "list", "--json", home=home)
    assert json.loads(listed.stdout) == []
    assert json.loads(_outbox("db", "status", "--json", home=home).stdout)["pid"] == started["pid"]
    with Outbox.connect(home=home) as ob:
        ob.start_run("a", "1")
    assert EmbeddedServer(home).status().pid == started["pid"]
    assert len(json.loads(_outbox("runs", "list", "--json", home=home).stdout)) == 1

    stopped = json.loads(_outbox("db", "stop", "--json", home=home).stdout)
    assert stopped == {"stopped": True}
    assert json.loads(_outbox("db", "status", "--json", home=home).stdout)["running"] is False
    # Data survives a stop; the next command starts the server again.
    assert len(json.loads(_outbox("runs", "list", "--json", home=home).stdout)) == 1


def test_with_outbox_dsn_set_nothing_is_started(home: Path, dsn: str) -> None:
    listed = _outbox("runs", "list", "--json", home=home, env_extra={"OUTBOX_DSN": dsn})
    assert json.loads(listed.stdout) == []
    assert not home.exists()
    refused = _outbox("db", "start", home=home, env_extra={"OUTBOX_DSN": dsn}, check=False)
    assert refused.returncode != 0 and "OUTBOX_DSN is set" in refused.stderr


def test_concurrent_first_starts_make_one_server(home: Path) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "outbox", "db", "start", "--json"],
            env={
                **{k: v for k, v in os.environ.items() if k != "OUTBOX_DSN"},
                "OUTBOX_HOME": str(home),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    pids = set()
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        pids.add(json.loads(out)["pid"])
    assert len(pids) == 1
