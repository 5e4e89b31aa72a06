"""Pause and resume with a real worker and deliverer (threads of this process, real PostgreSQL).

What a pause promises: the run is not claimed and its effects are not
delivered; work in flight finishes and is recorded (the step a worker is in,
an attempt a deliverer is making, and a retry it asks for is held too); waits
keep their deadlines and are acted on at resume. The same with separate
``outbox worker`` and ``outbox deliver`` processes: ``test_run_control_processes.py``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from deliverers.testing import RecordingDeliverer
from outbox import EffectStatus, Outbox, Run, RunStatus, StepTransaction
from outbox.delivery import Delivery, Outcome, Retry, Succeeded
from tests.support import DaemonThread, WorkerThread, wait_for


def effect_statuses(ob: Outbox, run_id: Any) -> list[EffectStatus]:
    return [e.status for e in ob.effects(run_id=run_id)]


def test_the_step_in_flight_is_recorded_then_the_worker_lets_the_run_go(ob: Outbox) -> None:
    entered, release = threading.Event(), threading.Event()
    calls: list[str] = []

    def slow_tool() -> str:
        calls.append("slow")
        entered.set()
        assert release.wait(30)
        return "finished"

    def after(tx: StepTransaction) -> None:
        calls.append("after")
        tx.intend("k.x", {})

    def handler(run: Run) -> Any:
        run.call("slow", slow_tool)
        run.transaction("after", after)
        return "done"

    with WorkerThread(ob, "agent", "1", handler) as worker:
        run = ob.start_run("agent", "1")
        assert entered.wait(30)
        assert ob.pause(run.id, "operator hold") == RunStatus.RUNNING, (
            "pausing: a step is in flight"
        )
        release.set()
        wait_for(lambda: ob.run(run.id).status == RunStatus.PAUSED, message="parked")
        paused = ob.run(run.id)
        assert paused.completed_steps == ["slow"], "the step in flight was recorded"
        assert paused.record.pause_reason == "operator hold"
        time.sleep(0.5)
        assert ob.run(run.id).status == RunStatus.PAUSED, "a paused run is not claimed"
        assert ob.resume(run.id) == RunStatus.RUNNABLE
        wait_for(lambda: ob.run(run.id).status == RunStatus.COMPLETED, message="completed")
    assert calls == ["slow", "after"], "resumed at the next step; the tool ran once"
    assert worker.worker.counts.get("paused") == 1


def test_a_paused_run_s_effects_stay_pending_while_others_flow(ob: Outbox, dsn: str) -> None:
    held = ob.start_run("agent", "1")
    other = ob.start_run("agent", "1")
    for run in (held, other):
        run.transaction("s", lambda tx: [tx.intend("k.flow", {"n": n}) for n in range(3)] and None)
    assert ob.pause(held.id, "hold") == RunStatus.PAUSED
    recorder = RecordingDeliverer("k.flow")
    with DaemonThread(dsn, {"k.flow": recorder}, poll_seconds=0.1):
        wait_for(lambda: effect_statuses(ob, other.id) == [EffectStatus.SUCCEEDED] * 3)
        time.sleep(0.5)
        assert effect_statuses(ob, held.id) == [EffectStatus.PAUSED] * 3
        ob.resume(held.id)
        wait_for(lambda: effect_statuses(ob, held.id) == [EffectStatus.SUCCEEDED] * 3)
    assert len(recorder.deliveries) == 6


def test_an_attempt_in_flight_finishes_and_a_retry_it_asks_for_is_held(
    ob: Outbox, dsn: str
) -> None:
    run = ob.start_run("agent", "1")
    run.transaction("s", lambda tx: tx.intend("k.busy", {}) and None)
    entered, release = threading.Event(), threading.Event()

    def busy(delivery: Delivery) -> Outcome:
        if delivery.attempt == 1:
            entered.set()
            assert release.wait(30)
            return Retry("the provider is busy")
        return Succeeded({"attempt": delivery.attempt})

    recorder = RecordingDeliverer("k.busy", outcome=busy)
    with DaemonThread(dsn, {"k.busy": recorder}, poll_seconds=0.1, retry_base_seconds=0):
        assert entered.wait(30)
        ob.pause(run.id, "hold")
        assert effect_statuses(ob, run.id) == [EffectStatus.IN_FLIGHT]
        release.set()
        wait_for(lambda: effect_statuses(ob, run.id) == [EffectStatus.PAUSED], message="held")
        time.sleep(0.5)
        assert len(recorder.deliveries) == 1
        ob.resume(run.id)
        wait_for(lambda: effect_statuses(ob, run.id) == [EffectStatus.SUCCEEDED])
    assert [d.attempt for d in recorder.deliveries] == [1, 2]


def test_a_deadline_that_passes_while_paused_is_acted_on_at_resume(ob: Outbox) -> None:
    def handler(run: Run) -> Any:
        run.sleep("nap", 1.0)
        try:
            run.wait_signal("approval", name="approve", timeout=1.0)
        except Exception as exc:
            return type(exc).__name__
        return "approved"

    with WorkerThread(ob, "agent", "1", handler):
        run = ob.start_run("agent", "1")
        wait_for(lambda: ob.run(run.id).status == RunStatus.WAITING, message="napping")
        ob.pause(run.id, "hold")
        time.sleep(1.5)  # the nap's deadline passes while paused
        assert ob.run(run.id).status == RunStatus.PAUSED
        assert ob.run(run.id).completed_steps == [], "no timer fired while paused"
        ob.resume(run.id)
        wait_for(lambda: ob.run(run.id).status == RunStatus.WAITING, message="waiting approval")
        assert ob.run(run.id).completed_steps == ["nap"]
        ob.pause(run.id, "hold again")
        time.sleep(1.5)  # the approval's timeout passes while paused
        ob.resume(run.id)
        wait_for(lambda: ob.run(run.id).status == RunStatus.COMPLETED)
    assert ob.run(run.id).record.result == "SignalTimeout"


def test_a_signal_sent_while_paused_is_consumed_at_resume(ob: Outbox) -> None:
    def handler(run: Run) -> Any:
        return run.wait_signal("approval", name="approve")

    with WorkerThread(ob, "agent", "1", handler):
        run = ob.start_run("agent", "1")
        wait_for(lambda: ob.run(run.id).status == RunStatus.WAITING)
        ob.pause(run.id, "hold")
        receipt = ob.signal(run.id, "approve", {"by": "ops"})
        assert not receipt.woke_run and not receipt.duplicate
        time.sleep(0.5)
        assert ob.run(run.id).status == RunStatus.PAUSED
        ob.resume(run.id)
        wait_for(lambda: ob.run(run.id).status == RunStatus.COMPLETED)
    assert ob.run(run.id).record.result == {"by": "ops"}


def test_intents_of_the_step_a_pause_waited_for_are_held(ob: Outbox, dsn: str) -> None:
    entered, release = threading.Event(), threading.Event()

    def handler(run: Run) -> Any:
        def step(tx: StepTransaction) -> None:
            entered.set()
            assert release.wait(30)
            tx.intend("k.later", {"n": 1})

        run.transaction("intend", step)
        return "done"

    recorder = RecordingDeliverer("k.later")
    with (
        WorkerThread(ob, "agent", "1", handler),
        DaemonThread(dsn, {"k.later": recorder}, poll_seconds=0.1),
    ):
        run = ob.start_run("agent", "1")
        assert entered.wait(30)
        ob.pause(run.id, "hold")
        release.set()
        wait_for(lambda: ob.run(run.id).status == RunStatus.PAUSED)
        assert effect_statuses(ob, run.id) == [EffectStatus.PAUSED]
        time.sleep(0.5)
        assert recorder.deliveries == []
        ob.resume(run.id)
        wait_for(lambda: ob.run(run.id).status == RunStatus.COMPLETED)
        wait_for(lambda: effect_statuses(ob, run.id) == [EffectStatus.SUCCEEDED])


def test_an_async_worker_lets_a_paused_run_go_after_its_step(ob: Outbox) -> None:
    entered, release = threading.Event(), threading.Event()
    calls: list[str] = []

    def slow_tool() -> str:  # a plain function: the async run calls it in a thread
        calls.append("slow")
        entered.set()
        assert release.wait(30)
        return "finished"

    async def handler(run: Any) -> Any:
        await run.call("slow", slow_tool)
        await run.call("after", lambda: calls.append("after"))
        return "done"

    with WorkerThread(ob, "agent", "1", handler) as worker:
        run = ob.start_run("agent", "1")
        assert entered.wait(30)
        ob.pause(run.id, "hold")
        release.set()
        wait_for(lambda: ob.run(run.id).status == RunStatus.PAUSED, message="parked")
        assert ob.run(run.id).completed_steps == ["slow"]
        ob.resume(run.id)
        wait_for(lambda: ob.run(run.id).status == RunStatus.COMPLETED)
    assert calls == ["slow", "after"]
    assert worker.worker.counts.get("paused") == 1
