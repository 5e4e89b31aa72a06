"""The failed middle: real worker processes killed and rate-limited, each with its outcome."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest

from deliverers.testing import Fault, IdempotentHttpSink
from outbox import Outbox, RunStatus
from outbox.check.processes import Fleet, Process, start_deliverer
from outbox.check.workload import write_config
from tests.support import wait_for


def start_worker(
    env: dict[str, str], handler: str, log: Path, crash_at: str | None = None
) -> Process:
    fleet = Fleet(env, log.parent, None, handler=f"tests.chaos.agents:{handler}", agent="chaos")
    return fleet.worker(crash_at=crash_at)


def stop(proc: Process) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)


def lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


@pytest.mark.parametrize(
    ("crash_at", "tool_calls"),
    [
        # killed after the tool returned, before its result was committed:
        # nothing was recorded, so the resumed run calls the tool once more
        ("before_step_commit:1", 2),
        # killed right after the tool's result was committed: it is replayed
        ("after_step:1", 1),
    ],
)
def test_kill_the_worker_between_a_tool_call_and_its_checkpoint(
    ob: Outbox, sub_env: dict[str, str], tmp_path: Path, crash_at: str, tool_calls: int
) -> None:
    """Expected: a recorded tool result is not lost and not re-fetched; no effect twice."""
    log = tmp_path / "calls.log"
    run = ob.start_run("chaos", "1", {"log": str(log)})
    doomed = start_worker(sub_env, "tool_then_effect", tmp_path / "w1.log", crash_at)
    assert doomed.wait(timeout=60) == -signal.SIGKILL
    survivor = start_worker(sub_env, "tool_then_effect", tmp_path / "w2.log")
    try:
        wait_for(lambda: ob.run(run.id).status == RunStatus.COMPLETED, timeout=60)
    finally:
        stop(survivor)
    assert lines(log).count("tool") == tool_calls
    assert lines(log).count("handler") == 2, "the run was resumed by the second worker"
    effects = ob.effects(run_id=run.id)
    assert [e.payload for e in effects] == [{"to": "ap@example.com"}], "intended once"
    assert ob.run(run.id).completed_steps == ["lookup-customer", "notify"]


@pytest.fixture
def sink() -> Iterator[IdempotentHttpSink]:
    with IdempotentHttpSink() as running:
        yield running


def test_a_rate_limit_on_step_seven_of_twelve(
    ob: Outbox, sub_env: dict[str, str], tmp_path: Path, sink: IdempotentHttpSink
) -> None:
    """Expected: retried after Retry-After with the same key; the run waits without a busy
    loop; steps 8-12 complete after it; nothing duplicated; the budget charged once."""
    sink.inject(Fault("429", times=1, retry_after="2"))
    log = tmp_path / "calls.log"
    run = ob.start_run("chaos", "1", {"log": str(log), "sink": sink.url}, budget=5)
    worker = start_worker(sub_env, "twelve_steps", tmp_path / "worker.log")
    deliverer = start_deliverer(sub_env, write_config(tmp_path), tmp_path / "deliver.log")
    try:
        wait_for(lambda: ob.run(run.id).status == RunStatus.WAITING, timeout=60)
        waiting_since = time.monotonic()
        wait_for(lambda: ob.run(run.id).status == RunStatus.COMPLETED, timeout=60)
        assert time.monotonic() - waiting_since >= 1.0
    finally:
        stop(worker)
        stop(deliverer)
    done = ob.run(run.id)
    assert done.completed_steps == [
        *(f"step-{n:02d}" for n in range(1, 8)),
        "step-07-settled",
        *(f"step-{n:02d}" for n in range(8, 13)),
    ]
    (charge,) = ob.effects(run_id=run.id)
    assert [a.outcome for a in ob.store.attempts(charge.id)] == ["retry", "succeeded"]
    assert sink.state.received[charge.idempotency_key] == 2, "same key both times"
    assert sink.stats()["keys_applied"] == 1 and sink.stats()["duplicate_operations"] == []
    assert (done.record.spent, done.record.reserved) == (Decimal("2.0"), Decimal(0))
    assert lines(log).count("handler") <= 3, "parked while waiting, not polled"
    assert done.record.attempt <= 3
