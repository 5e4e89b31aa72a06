"""``outbox check`` end to end: real workers and deliverers killed at every crash point.

The demo agent passes and the table is printed; deliberately broken agents
(an email from plain Python, a charge inside a recorded call, a charge intended
outside the steps without a key of its own) are caught, the crash point and the
duplicated operation named, and the printed command reproduces the failure
alone; a correct agent that waits for a signal, the keyless charge given a key
derived from the run, and an agent whose runs are handed over to a new version
pass; an ``async def`` agent is checked the same way; a kind declared not
idempotent whose deliverer dies after the call is left ``unknown``, not sent
twice; the ``outbox_check`` fixture (the shipped pytest plugin) does the same
from a test.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from deliverers.testing import IdempotentHttpSink
from outbox.check.plugin import OutboxCheck
from outbox.check.report import CheckReport
from tests.chaos import broken_agents, versioned_agents

ROOT = Path(__file__).resolve().parents[2]
DEMO = [
    "outbox.demo.agent:reconcile_month",
    "--agent",
    "invoice-reconciler",
    "--version",
    "1.0.0",
    "--inputs",
    '{"month": "2026-10"}',
]


def outbox_check(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``outbox check ARGS`` from the repository root, with the scratch server of the suite."""
    return subprocess.run(
        [sys.executable, "-m", "outbox", "check", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@pytest.fixture
def env(admin_dsn: str, tmp_path: Path) -> dict[str, str]:
    environ = {**os.environ, "COLUMNS": "200"}
    environ.pop("OUTBOX_DSN", None)
    environ["OUTBOX_HOME"] = str(tmp_path / "never-used")
    environ["CHECK_ARGS"] = json.dumps(["--dsn", admin_dsn])
    return environ


def dsn_args(env: dict[str, str]) -> list[str]:
    return list(json.loads(env["CHECK_ARGS"]))


def test_the_demo_agent_passes_and_the_table_is_printed(env: dict[str, str]) -> None:
    done = outbox_check([*DEMO, *dsn_args(env)], env)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "crash point x outcome" in out
    for point in ("step_start", "step_end", "before_step_commit", "after_commit", "after_step"):
        assert f"{point}" in out
    assert "match-09" in out and "send-summary" in out and "fetch-payments" in out
    for point in ("after_claim", "after_call", "during_completion"):
        assert point in out
    assert "passed: 63 crashes in 8 trials" in out
    assert "VIOLATION" not in out and "chain failed" not in out


def test_an_email_sent_from_plain_python_is_caught_and_reproduced_alone(
    env: dict[str, str],
) -> None:
    args = [
        "tests.chaos.broken_agents:emails_from_plain_python",
        "--agent",
        "onboarding",
        "--version",
        "1",
        "--json",
        *dsn_args(env),
    ]
    done = outbox_check(args, env)
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads(done.stdout)
    first = report["first_violation"]
    assert first["trial"] == "step_start@mark-welcomed"  # the first crash after the email
    assert first["kind"] == "duplicate_operations"
    assert "<id>:welcome-email" in first["detail"] and "applied 2x" in first["detail"]
    assert "outside tx.intend" in first["explanation"]
    assert any("outside the outbox" in w for w in report["warnings"])
    rows = {(r["point"], r["where"]): r["outcome"] for r in report["rows"]}
    assert rows[("step_start", "load-customer")] == "ok"  # before the email: nothing repeats
    assert rows[("step_start", "mark-welcomed")] == "VIOLATION"

    again = shlex.split(first["reproduce"])
    assert again[:2] == ["outbox", "check"] and again[-2:] == ["--only", first["trial"]]
    alone = outbox_check([*again[2:], "--json", *dsn_args(env)], env)
    assert alone.returncode == 1, alone.stdout + alone.stderr
    repeated = json.loads(alone.stdout)["first_violation"]
    assert (repeated["trial"], repeated["kind"]) == (first["trial"], first["kind"])


def test_a_charge_made_inside_a_recorded_call_is_caught_by_the_fixture(
    outbox_check: OutboxCheck,
) -> None:
    with pytest.raises(pytest.fail.Exception) as failed:
        outbox_check(broken_agents.charges_inside_a_call, agent="billing")
    message = str(failed.value)
    assert "FAILED at step_end@charge-card" in message
    assert "duplicate_operations: operation <id>:charge" in message
    assert "recorded step 'charge-card'" in message
    assert "--only step_end@charge-card" in message


def test_a_correct_agent_that_waits_for_a_signal_passes_the_fixture(
    outbox_check: OutboxCheck, request: pytest.FixtureRequest
) -> None:
    assert request.config.pluginmanager.hasplugin("outbox"), "registered by its entry point"
    report = outbox_check(
        broken_agents.onboards_correctly, signals={"approved": {"by": "ops@example.com"}}
    )
    assert isinstance(report, CheckReport) and report.ok
    rows = {(r.point, r.where): r for r in report.rows()}
    assert rows[("parked", "approval")].outcome == "ok"
    assert rows[("after_commit", "send-welcome")].outcome == "ok"
    assert {rows[(p, "first time")].outcome for p in ("after_claim", "after_call")} == {"ok"}
    assert report.baseline is not None
    results = {o.result["approved_by"]["by"] for o in report.baseline.outcomes.values()}
    assert results == {"ops@example.com"}


def test_runs_handed_over_to_a_new_version_mid_flight_pass(outbox_check: OutboxCheck) -> None:
    report = outbox_check(
        versioned_agents.v1,
        agent="deploy",
        version="1",
        upgrade_to="2",
        setup=versioned_agents.shim,
        upgrade_handler=versioned_agents.v2,
        signals={"go": True},
        only=["after_step", "handover", "during_upgrade", "after_upgrade"],
    )
    rows = {r.point: r for r in report.rows() if r.role == "upgrade"}
    assert {p: r.outcome for p, r in rows.items()} == {
        "handover": "ok",
        "during_upgrade": "ok",
        "after_upgrade": "ok",
    }
    by_id = {r.plan.id: r for r in report.results}
    assert by_id["handover"].plan.handover == "parked@go"
    for name in ("during_upgrade", "after_upgrade"):
        (outcome,) = by_id[name].outcomes.values()
        assert (outcome.version, outcome.upgrades) == ("2", 1)
        assert outcome.result == {"finished_by": "2", "state": {"tasks": ["a", "b"], "schema": 2}}
        assert [c.point for c in by_id[name].crashes] == ["parked", name]


def test_the_real_deliverers_config_can_stand_in_for_the_recording_sink(
    outbox_check: OutboxCheck, tmp_path: Path
) -> None:
    config = tmp_path / "deliverers.toml"
    config.write_text('[kinds."http.request"]\nallow_private = ["127.0.0.1"]\n')
    with IdempotentHttpSink() as sink:
        report = outbox_check(
            "outbox.demo.agent:reconcile_month",
            agent="invoice-reconciler",
            inputs={"month": "2026-10", "sink": sink.url},
            sink="real",
            config=config,
            only=["after_call", "step_end@match-05"],
        )
        stats: dict[str, Any] = sink.stats()
    assert report.ok
    assert stats["duplicate_operations"] == [] and stats["duplicate_keys_applied"] == []
    assert stats["redeliveries"] >= 1, "the deliverer killed after a call: its calls were redone"


def test_a_run_waiting_for_a_signal_nobody_sends_stops_the_check_naming_it(
    outbox_check: OutboxCheck,
) -> None:
    with pytest.raises(pytest.fail.Exception) as failed:
        outbox_check(broken_agents.onboards_correctly, agent="onboarding")
    message = str(failed.value)
    assert "FAILED at uninterrupted" in message
    assert "waits for signal 'approved'" in message and "--signal approved=JSON" in message


def test_a_charge_intended_outside_a_step_without_a_key_is_caught(
    outbox_check: OutboxCheck,
) -> None:
    with pytest.raises(pytest.fail.Exception) as failed:
        outbox_check(
            broken_agents.charges_without_a_stable_key, agent="checkout", only=["step_start"]
        )
    message = str(failed.value)
    assert "FAILED at step_start@mark-charged" in message  # the first crash after the intent
    assert "duplicate_operations: operation <id>:charge" in message
    assert "intended 2x, applied 2x" in message
    assert "outside the run's steps" in message and "key=f'{run.id}:charge'" in message
    assert "--only step_start@mark-charged" in message


def test_the_same_charge_with_a_key_derived_from_the_run_passes(outbox_check: OutboxCheck) -> None:
    report = outbox_check(
        broken_agents.charges_with_a_key_of_its_own,
        agent="checkout",
        only=["step_start@mark-charged", "after_call"],
    )
    assert report.ok
    rows = {(r.point, r.where): r.outcome for r in report.rows()}
    assert rows[("step_start", "mark-charged")] == rows[("after_call", "first time")] == "ok"


def test_an_async_agent_that_waits_for_a_signal_passes_at_every_point(
    outbox_check: OutboxCheck,
) -> None:
    report = outbox_check(
        broken_agents.onboards_correctly_async, signals={"approved": {"by": "ops@example.com"}}
    )
    assert report.ok
    rows = {(r.point, r.where): r.outcome for r in report.rows()}
    steps = ("load-customer", "send-welcome", "open-account")
    for point in ("step_start", "step_end", "before_step_commit", "after_commit", "after_step"):
        assert [rows[(point, step)] for step in steps] == ["ok"] * 3, point
    assert rows[("parked", "approval")] == "ok"
    for point in ("after_claim", "after_call", "during_completion"):
        assert rows[(point, "first time")] == "ok"
    assert report.baseline is not None
    results = [o.result for o in report.baseline.outcomes.values()]
    assert results and all(
        r == {"customer": "C-42", "approved_by": {"by": "ops@example.com"}} for r in results
    )


def test_an_async_agent_emailing_from_plain_python_is_caught(outbox_check: OutboxCheck) -> None:
    with pytest.raises(pytest.fail.Exception) as failed:
        outbox_check(
            broken_agents.emails_from_plain_python_async, agent="onboarding", only=["step_start"]
        )
    message = str(failed.value)
    assert "FAILED at step_start@mark-welcomed" in message
    assert "duplicate_operations: operation <id>:welcome-email" in message
    assert "outside tx.intend" in message


def test_a_kind_declared_not_idempotent_is_left_unknown_after_a_call_not_sent_twice(
    outbox_check: OutboxCheck, tmp_path: Path
) -> None:
    config = tmp_path / "deliverers.toml"
    config.write_text('[kinds."payments.charge"]\ntype = "http.request"\nidempotent = false\n')
    report = outbox_check(
        broken_agents.charges_a_non_idempotent_sink,
        agent="billing",
        config=config,
        only=["after_call"],
    )
    (trial,) = report.results
    assert trial.plan.id == "after_call" and [c.point for c in trial.crashes] == ["after_call"]
    # Its stand-in posts where every request takes effect: a blind resend would apply twice.
    charges = [a for a in trial.applied if a.operation and a.operation.endswith("<id>:charge")]
    assert [a.path for a in charges] == ["/blind/payments.charge"]
    assert trial.report.statuses.get("unknown") == 1, trial.report.statuses
    assert trial.attempt_outcomes.get("succeeded", 0) == 0, trial.attempt_outcomes
    (row,) = [r for r in report.rows() if r.point == "after_call"]
    assert row.outcome == "ok" and "1 left unknown for an operator" in row.detail, row
