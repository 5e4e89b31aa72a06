"""Pause, resume and fork with real ``outbox worker`` and ``outbox deliver`` processes.

A paused run's effects stay pending while other runs' flow, and resume
delivers them. A run forked from a step replays the steps before it without
calling their functions and runs the rest anew: the sink sees each of the
original's keys once and each of the fork's new keys once. Pause and fork are
given by the ``outbox runs`` commands, as an operator would.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from deliverers.testing import IdempotentHttpSink
from outbox import EffectStatus, Outbox, Run, RunStatus
from outbox.check.processes import start_deliverer
from outbox.check.workload import write_config
from outbox.keys import derive_key
from tests.support import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def sink() -> Iterator[IdempotentHttpSink]:
    with IdempotentHttpSink() as running:
        yield running


def start_worker(env: dict[str, str], handler: str, log: Path) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "outbox", "worker", f"tests.integration.runctl_agents:{handler}"]
    args += ["--agent", handler, "--version", "1", "--lease", "5"]
    with log.open("ab") as handle:
        return subprocess.Popen(args, env=env, stdout=handle, stderr=subprocess.STDOUT)


def stop(*procs: subprocess.Popen[bytes]) -> None:
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        assert proc.wait(timeout=60) == 0


def outbox_cli(env: dict[str, str], *args: str) -> Any:
    done = subprocess.run(
        [sys.executable, "-m", "outbox", *args, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def statuses(ob: Outbox, run_id: Any) -> list[EffectStatus]:
    return [e.status for e in ob.effects(run_id=run_id)]


def test_a_paused_run_s_effects_wait_while_others_flow_and_resume_delivers_them(
    ob: Outbox, sub_env: dict[str, str], tmp_path: Path, sink: IdempotentHttpSink
) -> None:
    config = write_config(tmp_path)
    worker = start_worker(sub_env, "held_then_go", tmp_path / "worker.log")
    deliverer = start_deliverer(sub_env, config, tmp_path / "deliverer.log")
    try:
        held = ob.start_run("held_then_go", "1", {"sink": sink.url})
        other = ob.start_run("held_then_go", "1", {"sink": sink.url})
        for run in (held, other):

            def waiting(run: Run = run) -> bool:
                return ob.run(run.id).status == RunStatus.WAITING

            wait_for(waiting, timeout=60)
        paused = outbox_cli(sub_env, "runs", "pause", str(held.id), "--reason", "hold for audit")
        assert paused["status"] == "paused"
        assert statuses(ob, held.id) == [EffectStatus.PAUSED]
        ob.signal(held.id, "go")
        ob.signal(other.id, "go")
        wait_for(lambda: ob.run(other.id).status == RunStatus.COMPLETED, timeout=60)
        wait_for(lambda: statuses(ob, other.id) == [EffectStatus.SUCCEEDED] * 2, timeout=60)
        # past the held effect's delay (the other run's was delivered at it): it
        # would have been delivered by now
        (first,) = ob.effects(run_id=held.id)
        available_at = first.available_at
        assert available_at is not None
        wait_for(lambda: datetime.now(UTC) > available_at + timedelta(seconds=1), timeout=30)
        assert ob.run(held.id).status == RunStatus.PAUSED
        assert statuses(ob, held.id) == [EffectStatus.PAUSED]
        assert outbox_cli(sub_env, "runs", "resume", str(held.id))["status"] == "runnable"
        wait_for(lambda: ob.run(held.id).status == RunStatus.COMPLETED, timeout=60)
        wait_for(lambda: statuses(ob, held.id) == [EffectStatus.SUCCEEDED] * 2, timeout=60)
    finally:
        stop(worker, deliverer)
    keys = {e.idempotency_key for e in ob.effects(limit=100)}
    assert len(keys) == 4 and all(sink.state.received[k] == 1 for k in keys)
    assert sink.stats()["duplicate_operations"] == []


def test_a_fork_replays_earlier_steps_and_the_sink_sees_every_key_once(
    ob: Outbox, sub_env: dict[str, str], tmp_path: Path, sink: IdempotentHttpSink
) -> None:
    config = write_config(tmp_path)
    calls = tmp_path / "calls.log"
    worker = start_worker(sub_env, "three_steps", tmp_path / "worker.log")
    deliverer = start_deliverer(sub_env, config, tmp_path / "deliverer.log")
    try:
        original = ob.start_run("three_steps", "1", {"sink": sink.url, "log": str(calls)})
        wait_for(lambda: ob.run(original.id).status == RunStatus.COMPLETED, timeout=60)
        wait_for(lambda: statuses(ob, original.id) == [EffectStatus.SUCCEEDED] * 2, timeout=60)
        forked = outbox_cli(sub_env, "runs", "fork", str(original.id), "--from", "charge")
        assert forked["replayed_steps"] == ["fetch"]
        fork_id = forked["run_id"]
        wait_for(lambda: ob.run(fork_id).status == RunStatus.COMPLETED, timeout=60)
        wait_for(lambda: statuses(ob, fork_id) == [EffectStatus.SUCCEEDED] * 2, timeout=60)
        # From a later step: the replayed charge intended an effect; it is not intended again.
        late = outbox_cli(sub_env, "runs", "fork", str(original.id), "--from", "notify")
        assert late["replayed_steps"] == ["fetch", "charge"]
        late_id = late["run_id"]
        wait_for(lambda: ob.run(late_id).status == RunStatus.COMPLETED, timeout=60)
        wait_for(lambda: statuses(ob, late_id) == [EffectStatus.SUCCEEDED], timeout=60)
    finally:
        stop(worker, deliverer)
    lines = calls.read_text().split("\n")
    assert lines.count(f"charge {late_id}") == 0 and lines.count(f"notify {late_id}") == 1
    late_keys = [derive_key(original.id, "charge", 0), derive_key(late_id, "notify", 0)]
    assert ob.run(late_id).record.result["keys"] == late_keys, "the charge's key is the original's"
    assert sink.state.received[late_keys[1]] == 1
    assert lines.count(f"fetch {original.id}") == 1
    assert not any(line.startswith("fetch") and fork_id in line for line in lines), (
        "the fork replayed fetch without calling it"
    )
    for step in ("charge", "notify"):
        assert lines.count(f"{step} {original.id}") == 1 and lines.count(f"{step} {fork_id}") == 1
    original_keys = [derive_key(original.id, s, 0) for s in ("charge", "notify")]
    fork_keys = [derive_key(fork_id, s, 0) for s in ("charge", "notify")]
    assert ob.run(fork_id).record.result["keys"] == fork_keys
    assert ob.run(original.id).status == RunStatus.COMPLETED, "the original is left as it was"
    for key in original_keys + fork_keys:
        assert sink.state.received[key] == 1, key
    assert sum(sink.state.received.values()) == 5, "the replayed charge was not sent again"
