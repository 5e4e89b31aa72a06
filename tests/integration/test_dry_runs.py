"""Dry runs: the run executes, its effects get stubs, and no real deliverer ever sees them."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from deliverers.testing import IdempotentHttpSink, RecordingDeliverer
from outbox import EffectStatus, Outbox, RunMode, ValidationError
from outbox.check.processes import start_deliverer
from outbox.delivery.dry_run import DryRunConfig, dry_run_registry
from outbox.demo import agent as demo_agent
from tests.support import DaemonThread, wait_for


def intend_two(ob: Outbox, mode: str, inputs: Any = None) -> Any:
    run = ob.start_run("billing", "2", inputs or {"month": "2026-10"}, mode=mode)

    def step(tx: Any) -> None:
        tx.intend("ledger.post", {"operation": f"{run.id}:post", "amount": 10})
        tx.intend(
            "ledger.post",
            {"amount": 20},
            key="invoice-7",
            compensate=("ledger.reverse", {"amount": -20}),
        )

    run.transaction("post", step)
    return run


def test_a_dry_run_is_served_only_by_the_recording_deliverer(ob: Outbox, dsn: str) -> None:
    real = RecordingDeliverer("ledger.post")
    config = DryRunConfig.model_validate({"stubs": {"ledger.post": {"result": {"posted": True}}}})
    dry = dry_run_registry(["ledger.post"], config, None)
    run = intend_two(ob, "dry_run")
    assert run.dry_run and ob.run(run.id).record.mode == RunMode.DRY_RUN
    effects = run.effects()
    assert {e.kind for e in effects} == {"dry-run:ledger.post"}
    assert effects[1].idempotency_key == f"dry-run:{run.id}:invoice-7"
    assert effects[1].compensate is not None
    assert effects[1].compensate.kind == "dry-run:ledger.reverse"
    with DaemonThread(dsn, {**dry, "ledger.post": real}, poll_seconds=0.05):
        result = run.await_effect(effects[0], timeout=20)
        wait_for(lambda: all(e.status == EffectStatus.SUCCEEDED for e in run.effects()))
    assert result == {"posted": True}
    assert real.deliveries == [], "no real deliverer saw a dry run's effect"
    assert [a.detail for a in ob.store.attempts(effects[0].id)] == [
        {"dry_run": True, "result_from": "stub"}
    ]
    # A dry run took no key a real intent needs.
    live = intend_two(ob, "live")
    assert live.effects()[1].idempotency_key == "invoice-7"


def test_a_recorded_result_of_a_real_run_of_the_same_inputs_wins(ob: Outbox, dsn: str) -> None:
    live = intend_two(ob, "live")
    real = RecordingDeliverer("ledger.post", outcome=lambda d: _posted(d))
    with DaemonThread(dsn, {"ledger.post": real}, poll_seconds=0.05):
        wait_for(lambda: all(e.status == EffectStatus.SUCCEEDED for e in live.effects()))
    dry = intend_two(ob, "dry_run")
    other = intend_two(ob, "dry_run", inputs={"month": "2026-11"})
    config = DryRunConfig(default={"stub": "default"})
    with DaemonThread(dsn, _dry_with_lookup(dsn, config), poll_seconds=0.05):
        wait_for(lambda: all(e.status == EffectStatus.SUCCEEDED for e in dry.effects()))
        wait_for(lambda: all(e.status == EffectStatus.SUCCEEDED for e in other.effects()))
    assert [e.result for e in dry.effects()] == [e.result for e in live.effects()]
    assert [e.result for e in other.effects()] == [{"stub": "default"}] * 2


def _posted(delivery: Any) -> Any:
    from outbox.delivery import Succeeded

    return Succeeded({"posted": delivery.payload["amount"]})


def _dry_with_lookup(dsn: str, config: DryRunConfig) -> dict[str, Any]:
    """A dry registry whose recorded-result lookup has its own store (the CLI uses the daemon's)."""
    from outbox.storage.async_store import AsyncStore
    from outbox.storage.engine import make_async_engine

    async def recorded(effect_id: Any) -> Any:
        store = AsyncStore(make_async_engine(dsn, pool_size=1))
        try:
            return await store.recorded_result(effect_id)
        finally:
            await store.dispose()

    return dry_run_registry(["ledger.post"], config, recorded)


def test_a_caller_cannot_name_the_dry_run_namespace(ob: Outbox) -> None:
    run = ob.start_run("a", "1")
    with pytest.raises(ValidationError, match="reserved for dry runs"):
        run.transaction("s", lambda tx: tx.intend("dry-run:http.request", {}))
    with pytest.raises(ValidationError, match="mode"):
        ob.start_run("a", "1", mode="pretend")


def test_diff_of_two_runs_names_each_difference(ob: Outbox) -> None:
    a = intend_two(ob, "live")
    b = ob.start_run("billing", "3", {"month": "2026-10"})

    def step(tx: Any) -> None:
        tx.intend("ledger.post", {"operation": f"{b.id}:post", "amount": 11})

    b.transaction("post", step)
    found = ob.diff_runs(a.id, b.id)
    assert [(c.step_id, c.index, c.change, c.fields) for c in found.changes] == [
        ("post", 0, "changed", ("payload",)),
        ("post", 1, "removed", ()),
    ]
    same = ob.diff_runs(a.id, intend_two(ob, "dry_run").id)
    assert same.identical and same.compared == 2


def run_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


DEMO_CONFIG = """
[kinds."http.request"]
allow_private = ["127.0.0.1"]

[dry_run.stubs."http.request"]
result = { status = 200, body = "stubbed", truncated = false, bytes_read = 7 }
"""


@pytest.mark.slow
def test_a_dry_run_of_the_demo_agent_touches_no_sink_and_matches_a_real_run(
    ob: Outbox, sub_env: dict[str, str], tmp_path: Path
) -> None:
    """Real processes: a real deliverer and a dry-run deliverer side by side, one sink."""
    config = tmp_path / "deliverers.toml"
    config.write_text(DEMO_CONFIG)
    sink_log = tmp_path / "sink.jsonl"
    inputs = {"month": "2026-09"}
    with IdempotentHttpSink(log_path=sink_log) as sink:
        deliverers = [
            start_deliverer(sub_env, config, tmp_path / "real.log"),
            start_deliverer(sub_env, config, tmp_path / "dry.log", "--dry-run"),
        ]
        try:
            dry = ob.start_run(demo_agent.AGENT, demo_agent.VERSION, inputs, mode="dry_run")
            agent = subprocess.run(
                [sys.executable, "-m", "outbox.demo.agent", str(dry.id), sink.url],
                env=sub_env,
                capture_output=True,
                timeout=120,
            )
            assert agent.returncode == 0, agent.stderr.decode()
            wait_for(
                lambda: all(e.status == EffectStatus.SUCCEEDED for e in ob.effects(run_id=dry.id)),
                timeout=60,
                message="the dry run's effects settle",
            )
            assert not sink_log.exists() or sink_log.read_text() == "", "the sink saw a dry run"
            assert sink.stats()["requests"] == 0

            shown = json.loads(run_cli(sub_env, "runs", "show", str(dry.id), "--json").stdout)
            assert shown["mode"] == "dry_run"
            assert {e["result"]["body"] for e in shown["effects"]} == {"stubbed"}

            real = ob.start_run(demo_agent.AGENT, demo_agent.VERSION, inputs)
            agent = subprocess.run(
                [sys.executable, "-m", "outbox.demo.agent", str(real.id), sink.url],
                env=sub_env,
                capture_output=True,
                timeout=120,
            )
            assert agent.returncode == 0, agent.stderr.decode()
            wait_for(
                lambda: all(e.status == EffectStatus.SUCCEEDED for e in ob.effects(run_id=real.id)),
                timeout=60,
                message="the real run's effects settle",
            )
            applied = sink.stats()["operations_applied"]
            assert applied == len(ob.effects(run_id=real.id, limit=1000)) > 0
        finally:
            for proc in deliverers:
                proc.send_signal(signal.SIGTERM)
            for proc in deliverers:
                assert proc.wait(timeout=60) == 0
    diff = run_cli(sub_env, "runs", "diff", str(dry.id), str(real.id), "--json")
    assert diff.returncode == 0, diff.stdout + diff.stderr
    report = json.loads(diff.stdout)
    assert report["identical"] and report["compared"] == len(ob.effects(run_id=real.id, limit=1000))
    text = run_cli(sub_env, "runs", "diff", str(dry.id), str(real.id))
    assert "no difference in intended effects" in text.stdout


def test_a_fork_of_a_dry_run_is_a_dry_run(ob: Outbox) -> None:
    """Run control meets governance: forking a dry run never turns its new effects real."""
    run = ob.start_run("billing", "2", {"month": "2026-11"}, mode="dry_run")
    run.transaction("first", lambda tx: None)
    run.transaction("second", lambda tx: tx.intend("ledger.post", {"amount": 4}))
    fork = ob.fork(run.id, "second")
    assert fork.record.mode == RunMode.DRY_RUN
    effect = fork.transaction(
        "second", lambda tx: tx.intend("ledger.post", {"amount": 5}).idempotency_key
    )
    (written,) = [e for e in fork.effects() if e.idempotency_key == effect]
    assert written.kind.startswith("dry-run:")
