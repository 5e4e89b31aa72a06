"""What ``--json`` prints is valid against its schema in schemas/ (docs/reference/json.md).

Each command runs on a database holding a run, a step, a delivered effect with
its attempt log, a pending one and a waiting signal; its output is checked with
``jsonschema`` against ``schemas/report.<command>.json``, the file a user reads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from jsonschema import Draft202012Validator

from deliverers.testing import RecordingDeliverer
from outbox import Outbox
from outbox.cli import cli
from tests.support import DaemonThread, wait_for

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"


def _report(dsn: str, *args: str) -> Any:
    result = CliRunner().invoke(cli, ["--dsn", dsn, *args, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _valid(name: str, document: Any) -> None:
    schema = json.loads((SCHEMAS / f"report.{name}.json").read_text(encoding="utf-8"))
    errors = sorted(Draft202012Validator(schema).iter_errors(document), key=str)
    assert errors == [], f"report.{name}.json: {[e.message for e in errors]}"


@pytest.fixture
def history(ob: Outbox, dsn: str) -> dict[str, str]:
    """A run with a delivered effect (and its attempt) and a pending one."""
    run = ob.start_run("invoice-reconciler", "2.3.1", {"month": "2026-10"}, budget=25)

    def step(tx: Any) -> None:
        tx.intend("ledger.post", {"amount": 5}, cost=2)
        tx.spend(1.5, "model tokens")

    run.transaction("post", step)
    with ob.transaction() as tx:
        pending = tx.intend("email.send", {"to": "ap@example.com"})

    with DaemonThread(dsn, {"ledger.post": RecordingDeliverer("ledger.post")}, poll_seconds=0.05):
        wait_for(
            lambda: ob.effects(run_id=run.id)[0].status.value == "succeeded",
            timeout=30,
            message="the ledger post delivered",
        )
    delivered = ob.effects(run_id=run.id)[0]
    return {"run": str(run.id), "delivered": str(delivered.id), "pending": str(pending.id)}


def test_every_json_report_checked_here_is_valid_against_its_schema(
    ob: Outbox, dsn: str, history: dict[str, str]
) -> None:
    run, delivered = history["run"], history["delivered"]
    checked = {
        "runs.list": _report(dsn, "runs", "list"),
        "runs.show": _report(dsn, "runs", "show", run),
        "runs.versions": _report(dsn, "runs", "versions"),
        "effects.list": _report(dsn, "effects", "list"),
        "effects.show": _report(dsn, "effects", "show", delivered),
        "reconcile": _report(dsn, "reconcile", "--dry-run"),
        "signal": _report(dsn, "signal", run, "approval", "--data", '{"by": "alice"}'),
        "gc": _report(dsn, "gc", "--older-than", "30d", "--dry-run"),
        "migrate": _report(dsn, "migrate"),
        "runs.cancel": _report(dsn, "runs", "cancel", run, "--reason", "json reports"),
    }
    for name, document in checked.items():
        _valid(name, document)
    # The documents are about the history made above, not empty lists.
    assert checked["runs.show"]["steps"][0]["step_id"] == "post"
    assert checked["effects.show"]["attempts"][0]["outcome"] == "succeeded"
    assert {e["status"] for e in checked["effects.list"]} == {"succeeded", "pending"}
    assert checked["runs.versions"][0]["version"] == "2.3.1"
    assert checked["signal"]["duplicate"] is False


def test_a_document_that_breaks_its_schema_is_refused() -> None:
    with pytest.raises(AssertionError, match=r"report\.signal\.json"):
        _valid("signal", {"signal_id": 7, "duplicate": "no"})
