"""``outbox demo`` works on a fresh home and in a reused one, and says why when it cannot.

A reused checkout is where a new user runs the demo a second time: after the
quickstart (an intent no deliverer serves, and the quickstart's ``outbox
deliver`` still running), after a demo stopped with Ctrl-C. The demo waits for
and counts its own runs and effects only, and names the deliverers it did not
start that took part of its work.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from outbox import Outbox
from outbox.storage.admin.embedded import EmbeddedServer
from tests.support import embedded_home, wait_for


def demo(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox", "demo", "--json", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=cwd,
    )


def assert_the_story_holds(summary: dict[str, Any]) -> None:
    assert summary["finished"] is True and summary["error"] is None
    assert summary["waiting_for"] == []
    assert summary["runs_completed"] == 4 and summary["runs_compensated"] == 1
    assert summary["lost"] == 0 and summary["duplicates_applied_at_sink"] == 0
    assert summary["phantom"] == 0
    assert summary["effects_delivered"] == summary["effects_intended"] > 100


@pytest.mark.slow
def test_outbox_demo_on_a_fresh_home(tmp_path: Path) -> None:
    home = embedded_home() / ".outbox"
    env = {k: v for k, v in os.environ.items() if k != "OUTBOX_DSN"}
    env["OUTBOX_HOME"] = str(home)
    try:
        done = demo(env, tmp_path)
    finally:
        EmbeddedServer(home).stop(mode="immediate")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert_the_story_holds(summary)
    assert summary["attempts_recovered_after_crash"] > 0, "a deliverer was killed mid-call"
    assert summary["attempts_retried"] > 0, "the sink's 429s were retried"
    assert summary["other_deliverers"] == [] and summary["delivered_by_other_deliverers"] == 0
    assert len(summary["events"]) == 4
    assert summary["seconds"] < 60


@pytest.mark.slow
def test_the_demo_in_a_reused_database(ob: Outbox, sub_env: dict[str, str], tmp_path: Path) -> None:
    # What the quickstart leaves: an intent of a kind nobody serves, and its deliverer,
    # allowed to post to loopback, still running.
    with ob.transaction() as tx:
        tx.intend("email.send", {"to": "ap@example.com", "subject": "October"})
    config = tmp_path / "deliverers.toml"
    config.write_text('[kinds."http.request"]\nallow_private = ["127.0.0.1"]\n')
    leftover = subprocess.Popen(
        [sys.executable, "-m", "outbox", "deliver", "--config", str(config)],
        env=sub_env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        (owner,) = wait_for(
            ob.store.deliverers.live_owners, timeout=60, message="the leftover deliverer"
        )
        done = demo(sub_env, tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        summary = json.loads(done.stdout)
        assert_the_story_holds(summary)
        assert owner in summary["other_deliverers"]
        assert f"pid {leftover.pid}" in done.stderr, "the user is told another deliverer runs"
    finally:
        leftover.send_signal(signal.SIGTERM)
        leftover.wait(timeout=60)
    assert [e.status.value for e in ob.effects(kind="email.send")] == ["pending"]

    # A demo stopped with Ctrl-C leaves its runs and effects open; the next one
    # neither waits for them nor counts them.
    stopped = subprocess.Popen(
        [sys.executable, "-m", "outbox", "demo"],
        env=sub_env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(
        lambda: len(ob.runs(agent="trip-booking")) == 2,
        timeout=120,
        message="the second demo's runs started",
    )
    stopped.send_signal(signal.SIGINT)
    _, err = stopped.communicate(timeout=60)
    assert stopped.returncode == 130 and "aborted" in err, err[-3000:]
    again = demo(sub_env, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads(again.stdout)
    assert_the_story_holds(summary)
    assert summary["other_deliverers"] == [], "the stopped demo's deliverers are gone"
    assert len(summary["events"]) == 4


def test_a_demo_that_cannot_finish_prints_its_report_and_what_it_waited_for(
    sub_env: dict[str, str], tmp_path: Path
) -> None:
    done = demo(sub_env, tmp_path, "--timeout", "0.5")
    assert done.returncode == 1
    summary = json.loads(done.stdout)
    assert summary["finished"] is False and summary["lost"] == 0
    assert summary["waiting_for"], "it names what it was waiting for"
    assert summary["error"].startswith("demo did not finish in 0.5s: still waiting for ")
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("error:")]
    assert "still waiting for" in line and "logs in" in line
    logs = Path(line.rsplit("logs in ", 1)[1])
    assert (logs / "deliver-1.log").exists(), "the logs of a failed demo are kept"
    shutil.rmtree(logs)
