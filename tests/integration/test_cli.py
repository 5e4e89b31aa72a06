"""The CLI reports runs and effects as tables and as JSON, and fails with one clear line."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from click.testing import CliRunner

from outbox import Outbox
from outbox.cli import cli


def _invoke(dsn: str, *args: str) -> str:
    result = CliRunner().invoke(cli, ["--dsn", dsn, *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_runs_and_effects_reports(ob: Outbox, dsn: str) -> None:
    run = ob.start_run("invoice-reconciler", "2.3.1", {"month": "2026-10"}, budget=25)
    run.transaction("send", lambda tx: tx.intend("email.send", {"to": "ap@example.com"}) and 1)

    runs = json.loads(_invoke(dsn, "runs", "list", "--json"))
    assert [r["id"] for r in runs] == [str(run.id)]
    shown = json.loads(_invoke(dsn, "runs", "show", str(run.id), "--json"))
    assert shown["run"]["agent_version"] == "2.3.1"
    assert float(shown["budget"]["remaining"]) == 25
    assert [s["step_id"] for s in shown["steps"]] == ["send"]

    effects = json.loads(_invoke(dsn, "effects", "list", "--run", str(run.id), "--json"))
    assert [e["kind"] for e in effects] == ["email.send"]
    assert json.loads(_invoke(dsn, "effects", "list", "--status", "succeeded", "--json")) == []
    one = json.loads(_invoke(dsn, "effects", "show", effects[0]["id"], "--json"))
    assert one["effect"]["idempotency_key"] == effects[0]["idempotency_key"]
    assert one["attempts"] == []

    table = _invoke(dsn, "runs", "list")
    assert "invoice-reconciler" in table
    assert "email.send" in _invoke(dsn, "effects", "list")
    assert "send" in _invoke(dsn, "runs", "show", str(run.id))


def test_migrate_reports_json(dsn: str) -> None:
    report = json.loads(_invoke(dsn, "migrate", "--json"))
    assert report["applied"] == [] and report["schema_version"] == report["known"]


def test_errors_are_one_clear_line_and_exit_1(dsn: str) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "outbox",
            "--dsn",
            dsn,
            "runs",
            "show",
            "00000000-0000-0000-0000-000000000000",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "error: RunNotFound: run_id='00000000-0000-0000-0000-000000000000': no such run"
    )


def test_runs_pause_resume_and_fork_report_as_json(dsn: str) -> None:
    import json

    from click.testing import CliRunner

    from outbox import Outbox
    from outbox.cli import cli

    with Outbox.connect(dsn) as ob:
        run = ob.start_run("a", "1")
        run.call("fetch", lambda: {"n": 1})
        run.call("charge", lambda: "charged")
    runner = CliRunner()

    def outbox(*args: str) -> dict[str, object]:
        result = runner.invoke(cli, ["--dsn", dsn, *args, "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)  # type: ignore[no-any-return]

    paused = outbox("runs", "pause", str(run.id), "--reason", "legal hold")
    assert paused == {"run_id": str(run.id), "status": "paused", "reason": "legal hold"}
    shown = outbox("runs", "show", str(run.id))
    assert shown["run"]["pause_reason"] == "legal hold"  # type: ignore[index]
    assert outbox("runs", "resume", str(run.id))["status"] == "runnable"
    forked = outbox("runs", "fork", str(run.id), "--from", "charge", "--version", "2")
    assert forked["replayed_steps"] == ["fetch"] and forked["version"] == "2"
    assert forked["forked_from"] == str(run.id)
    listed = runner.invoke(cli, ["--dsn", dsn, "runs", "list", "--status", "runnable", "--json"])
    assert {r["id"] for r in json.loads(listed.output)} == {str(run.id), forked["run_id"]}


def test_listings_are_newest_first_a_page_at_a_time(ob: Outbox, dsn: str) -> None:
    """A user's own effect is on the first page, and every older one can be reached."""
    intended = []
    for n in range(5):
        with ob.transaction() as tx:
            intended.append(str(tx.intend("email.send", {"to": f"u{n}@example.com"}).id))
    started = [str(ob.start_run("paging", "1", {"n": n}).id) for n in range(3)]

    def ids(*args: str) -> list[str]:
        return [row["id"] for row in json.loads(_invoke(dsn, *args, "--json"))]

    newest = list(reversed(intended))
    assert ids("effects", "list", "--limit", "2") == newest[:2]
    assert ids("effects", "list", "--limit", "2", "--before", newest[1]) == newest[2:4]
    assert ids("effects", "list", "--before", newest[4]) == []
    assert ids("effects", "list", "--oldest-first", "--limit", "2") == intended[:2]
    assert ids("effects", "list", "--oldest-first", "--before", intended[2]) == intended[3:]
    # The table names the command for the next page.
    assert f"outbox effects list --before {newest[1]}" in _invoke(
        dsn, "effects", "list", "--limit", "2"
    )
    runs = list(reversed(started))
    assert ids("runs", "list", "--limit", "2") == runs[:2]
    assert ids("runs", "list", "--limit", "2", "--before", runs[1]) == runs[2:]


def test_runs_fork_reports_the_replayed_steps_even_when_a_worker_ran_the_fork_first(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fork commits before its handle is read: a worker may have run its from-step already."""
    with Outbox.connect(dsn) as ob:
        run = ob.start_run("a", "1")
        run.call("fetch", lambda: {"n": 1})
        run.call("charge", lambda: "charged")
    real_fork = Outbox.fork

    def fork_then_a_worker_runs_it(self: Outbox, *args: Any, **kwargs: Any) -> Any:
        forked = real_fork(self, *args, **kwargs)
        forked.call("charge", lambda: "charged by the fork")  # what a worker would do meanwhile
        return self.run(forked.id)

    monkeypatch.setattr(Outbox, "fork", fork_then_a_worker_runs_it)
    result = CliRunner().invoke(
        cli, ["--dsn", dsn, "runs", "fork", str(run.id), "--from", "charge", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["replayed_steps"] == ["fetch"]
