"""Issue 27, item 6: a fork from a step whose effects may have happened is refused, naming them.

A fork runs STEP and the steps after it again, with new idempotency keys. An
effect of those steps that is ``unknown`` (a deliverer died mid-call at a sink
that cannot dedup) or ``in_flight``/``dispatched`` may have taken effect, and
so may one pending again after a lost attempt (its deliverer died in the call
and the reconciler put it back for redelivery): the fork would intend it again
under a key the sink has never seen, so the sink could apply it twice. The fork
is refused with the list, unless the operator says they know
(``allow_unsettled=True``, ``--allow-unsettled``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from click.testing import CliRunner

from deliverers.testing import RecordingDeliverer
from outbox import Outbox, StepTransaction
from outbox.cli import cli
from outbox.errors import ForkRefused, RunStateError
from tests.integration.test_reconcile import lose_attempts, run_reconcile


def three_steps(ob: Outbox) -> tuple[Any, dict[str, str]]:
    run = ob.start_run("billing", "1")
    ids = {}
    for step in ("quote", "charge", "mail"):

        def intend(tx: StepTransaction, step: str = step) -> str:
            return str(tx.intend(f"k.{step}", {"step": step}).id)

        ids[step] = run.transaction(step, intend)
    run.complete({"ok": True})
    return run, ids


def set_status(ob: Outbox, effect_id: str, status: str) -> None:
    with ob.engine.begin() as conn:
        conn.exec_driver_sql(
            "UPDATE outbox_effects SET status = %s, attempt = 1 WHERE id = %s",
            (status, effect_id),
        )


@pytest.mark.parametrize("status", ["unknown", "in_flight", "dispatched"])
def test_a_fork_from_or_before_an_unsettled_effect_is_refused_naming_it(
    ob: Outbox, status: str
) -> None:
    run, ids = three_steps(ob)
    set_status(ob, ids["charge"], status)
    for step in ("quote", "charge"):  # the charge's step, or one before it
        with pytest.raises(ForkRefused) as refused:
            ob.fork(run.id, step)
        assert isinstance(refused.value, RunStateError)
        assert ids["charge"] in str(refused.value) and status in str(refused.value)
        assert [e["effect_id"] for e in refused.value.effects] == [ids["charge"]]
    assert [r.id for r in ob.runs()] == [run.id]  # nothing was written


def test_an_effect_pending_again_after_a_lost_attempt_is_unsettled(ob: Outbox, dsn: str) -> None:
    # its deliverer died in the call; the reconciler put it back for redelivery (the
    # sink dedups the key), but a fork would intend it under a key the sink never saw
    run, ids = three_steps(ob)
    lose_attempts(dsn, ["k.charge"])
    assert run_reconcile(dsn, {"k.charge": RecordingDeliverer("k.charge")}).counts == {
        "redeliver": 1
    }
    assert ob.effect(ids["charge"]).status.value == "pending"
    with pytest.raises(ForkRefused) as refused:
        ob.fork(run.id, "charge")
    assert [(e["effect_id"], e["status"], e["lost_attempt"]) for e in refused.value.effects] == [
        (ids["charge"], "pending", True)
    ]
    assert "is pending again after a lost attempt" in str(refused.value)
    assert ob.fork(run.id, "mail").completed_steps == ["quote", "charge"]


def test_a_fork_after_the_unsettled_effect_or_with_the_override_goes_ahead(ob: Outbox) -> None:
    run, ids = three_steps(ob)
    set_status(ob, ids["charge"], "unknown")
    after = ob.fork(run.id, "mail")  # the charge is replayed, not intended again
    assert after.completed_steps == ["quote", "charge"]
    forced = ob.fork(run.id, "charge", allow_unsettled=True)
    assert forced.record.forked_from == run.id


def test_the_cli_refuses_with_the_list_and_takes_the_override(ob: Outbox, dsn: str) -> None:
    run, ids = three_steps(ob)
    set_status(ob, ids["charge"], "unknown")
    fork = [sys.executable, "-m", "outbox", "--dsn", dsn, "runs", "fork", str(run.id)]
    refused = subprocess.run(
        [*fork, "--from", "charge"], capture_output=True, text=True, timeout=60, check=False
    )
    assert refused.returncode == 1
    assert refused.stderr.startswith("error: ForkRefused: from_step='charge'")
    assert ids["charge"] in refused.stderr and "is unknown" in refused.stderr
    assert "--allow-unsettled" in refused.stderr
    forced = CliRunner().invoke(
        cli,
        [
            "--dsn",
            dsn,
            "runs",
            "fork",
            str(run.id),
            "--from",
            "charge",
            "--allow-unsettled",
            "--json",
        ],
    )
    assert forced.exit_code == 0, forced.output
    assert json.loads(forced.output)["forked_from"] == str(run.id)
