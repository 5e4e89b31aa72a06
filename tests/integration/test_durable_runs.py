"""Workers resume runs; waits park them at zero compute; signals, timers and effects wake them."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import text

from deliverers.testing import RecordingDeliverer
from outbox import (
    EffectFailed,
    EffectStatus,
    Outbox,
    Run,
    RunStatus,
    RunTerminal,
    SignalTimeout,
    StepTransaction,
    ValidationError,
)
from outbox.delivery import Failed, Unknown
from outbox.runs import waits
from tests.support import DaemonThread, WorkerThread, wait_for


def status(ob: Outbox, run: Run) -> RunStatus:
    return ob.run(run.id).status


def test_a_worker_runs_a_started_run_to_completion(ob: Outbox) -> None:
    def handler(run: Run) -> dict[str, Any]:
        n = run.call("fetch", lambda: 41)
        run.transaction("bump", lambda tx: tx.set_state({"n": n + 1}))
        return {"n": n + 1}

    with WorkerThread(ob, "a", "1", handler):
        run = ob.start_run("a", "1", {})
        wait_for(lambda: status(ob, run) == RunStatus.COMPLETED)
    done = ob.run(run.id)
    assert done.record.result == {"n": 42} and done.state == {"n": 42}
    assert done.record.lease_owner is None


def test_a_worker_never_executes_another_version(ob: Outbox) -> None:
    ran: list[str] = []
    with WorkerThread(ob, "a", "2", lambda run: ran.append(run.version)):
        old = ob.start_run("a", "1", {})
        new = ob.start_run("a", "2", {})
        wait_for(lambda: status(ob, new) == RunStatus.COMPLETED)
        time.sleep(0.3)
    assert ran == ["2"]
    assert status(ob, old) == RunStatus.RUNNABLE


def test_sleep_parks_the_run_and_its_timer_wakes_it(ob: Outbox) -> None:
    visits: list[str] = []

    def handler(run: Run) -> str:
        visits.append("in")
        run.sleep("cool-off", timedelta(seconds=1))
        return "woke"

    with WorkerThread(ob, "a", "1", handler):
        run = ob.start_run("a", "1", {})
        wait_for(lambda: status(ob, run) == RunStatus.WAITING)
        parked = ob.run(run.id).record
        assert parked.lease_owner is None and parked.wake_at is not None
        with ob.engine.connect() as conn:
            locks = conn.execute(
                text(
                    "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a "
                    "USING (pid) WHERE a.application_name = 'outbox' "
                    "AND l.locktype = 'transactionid' AND a.pid <> "
                    "pg_backend_pid()"
                )
            ).scalar_one()
        assert locks == 0, "a waiting run holds no transaction"
        wait_for(lambda: status(ob, run) == RunStatus.COMPLETED, timeout=10)
    woken = ob.run(run.id)
    assert woken.record.result == "woke"
    assert woken.completed_steps == ["cool-off"]
    assert visits == ["in", "in"], "one visit to park, one after the timer"
    assert parked.wake_at is not None and datetime.now(UTC) >= parked.wake_at


def test_a_signal_wakes_a_waiting_run_and_its_payload_is_returned(ob: Outbox) -> None:
    def handler(run: Run) -> Any:
        return run.wait_signal("approval", name="approval", timeout=timedelta(hours=24))

    with WorkerThread(ob, "a", "1", handler):
        run = ob.start_run("a", "1", {})
        wait_for(lambda: ob.run(run.id).record.wait_signal == "approval")
        receipt = ob.signal(run.id, "approval", {"approved_by": "cfo"}, dedup_key="mail-1")
        assert receipt.woke_run and not receipt.duplicate
        assert ob.signal(run.id, "approval", {"x": 1}, dedup_key="mail-1").duplicate
        wait_for(lambda: status(ob, run) == RunStatus.COMPLETED)
    assert ob.run(run.id).record.result == {"approved_by": "cfo"}


def test_a_signal_sent_before_the_run_waits_is_kept(ob: Outbox) -> None:
    run = ob.start_run("a", "1", {})
    ob.signal(run.id, "approval", "early")
    with WorkerThread(
        ob, "a", "1", lambda r: r.wait_signal("approval", name="approval", timeout=60)
    ):
        wait_for(lambda: status(ob, run) == RunStatus.COMPLETED)
    assert ob.run(run.id).record.result == "early"


def test_a_signal_for_a_finished_run_is_refused(ob: Outbox) -> None:
    run = ob.start_run("a", "1", {})
    run.complete()
    with pytest.raises(RunTerminal, match="completed"):
        ob.signal(run.id, "approval", True)
    with pytest.raises(ValidationError):
        ob.signal(run.id, "", True)


def test_approval_timeout_is_recorded_and_the_escalation_runs_once(ob: Outbox) -> None:
    escalations: list[int] = []

    def handler(run: Run) -> str:
        try:
            run.wait_signal("approval", name="approval", timeout=0.5)
        except SignalTimeout:

            def escalate(tx: StepTransaction) -> None:
                escalations.append(1)
                tx.intend("page.oncall", {"why": "approval timed out"})

            run.transaction("escalate", escalate)
            return "escalated"
        return "approved"

    with WorkerThread(ob, "a", "1", handler):
        run = ob.start_run("a", "1", {})
        wait_for(lambda: status(ob, run) == RunStatus.COMPLETED, timeout=10)
    assert ob.run(run.id).record.result == "escalated"
    # Replay (another process loads the run): the timeout is raised again at that
    # step and the escalation step is not run again.
    replay = ob.run(run.id)
    with pytest.raises(SignalTimeout):
        replay.wait_signal("approval", name="approval", timeout=0.5)
    assert handler(ob.run(run.id)) == "escalated"
    assert escalations == [1]
    assert [e.kind for e in ob.effects(run_id=run.id)] == ["page.oncall"]
    with pytest.raises(RunTerminal):  # and a late approval is refused, clearly
        ob.signal(run.id, "approval", True)


def test_await_effect_returns_its_result_and_wakes_on_completion(ob: Outbox, dsn: str) -> None:
    def handler(run: Run) -> Any:
        effect = run.transaction("charge", lambda tx: str(tx.intend("k.pay", {"cents": 100}).id))
        return run.await_effect(effect, timeout=60)

    pay = RecordingDeliverer("k.pay")
    with WorkerThread(ob, "a", "1", handler):
        run = ob.start_run("a", "1", {})
        wait_for(lambda: status(ob, run) == RunStatus.WAITING)
        with DaemonThread(dsn, {"k.pay": pay}):
            wait_for(lambda: status(ob, run) == RunStatus.COMPLETED, timeout=10)
    assert ob.run(run.id).record.result == {"recorded": 1}


def test_await_effect_raises_when_the_effect_failed(ob: Outbox, dsn: str) -> None:
    seen: list[str] = []

    def handler(run: Run) -> Any:
        effect = run.transaction("charge", lambda tx: str(tx.intend("k.pay", {}).id))
        try:
            return run.await_effect(effect)
        except EffectFailed as exc:
            seen.append(exc.status)
            return "gave up"

    with (
        WorkerThread(ob, "a", "1", handler),
        DaemonThread(dsn, {"k.pay": RecordingDeliverer("k.pay", outcome=lambda d: Failed("card"))}),
    ):
        run = ob.start_run("a", "1", {})
        wait_for(lambda: status(ob, run) == RunStatus.COMPLETED, timeout=10)
    assert seen == ["failed"]


@pytest.mark.parametrize(("answer", "result"), [("succeeded", None), ("failed", "failed")])
def test_a_run_parked_on_an_unknown_effect_goes_on_when_an_operator_resolves_it(
    ob: Outbox, dsn: str, monkeypatch: pytest.MonkeyPatch, answer: str, result: str | None
) -> None:
    """The operator's resolve wakes the run then, not its recheck timer (put out of reach)."""
    monkeypatch.setattr(waits, "EFFECT_RECHECK_SECONDS", 3600.0)
    paid: list[str] = []

    def handler(run: Run) -> Any:
        effect = run.transaction("charge", lambda tx: str(tx.intend("k.pay", {}).id))
        paid.append(effect)
        try:
            return run.await_effect(effect)
        except EffectFailed as exc:
            return exc.status

    timed_out = RecordingDeliverer("k.pay", outcome=lambda d: Unknown("the bank timed out"))
    with WorkerThread(ob, "a", "1", handler), DaemonThread(dsn, {"k.pay": timed_out}):
        run = ob.start_run("a", "1", {})
        wait_for(lambda: paid and ob.effect(paid[0]).status == EffectStatus.UNKNOWN, timeout=10)
        wait_for(lambda: status(ob, run) == RunStatus.WAITING)
        ob.resolve_effect(paid[0], outcome=answer, note="read the bank's ledger", operator="ops")
        wait_for(lambda: status(ob, run) == RunStatus.COMPLETED, timeout=10)
    assert ob.run(run.id).record.result == result


def test_outside_a_worker_waits_block(ob: Outbox) -> None:
    run = ob.start_run("a", "1", {})
    started = time.monotonic()
    run.sleep("short", 0.3)
    assert time.monotonic() - started >= 0.3
    import threading

    threading.Timer(0.3, lambda: ob.signal(run.id, "go", 5)).start()
    assert run.wait_signal("wait-go", name="go", timeout=10) == 5
    assert run.completed_steps == ["short", "wait-go"]


def test_a_failing_step_is_retried_then_the_run_fails_with_the_error(ob: Outbox) -> None:
    attempts: list[int] = []

    def handler(run: Run) -> None:
        run.call("ok", lambda: 1)

        def flaky() -> None:
            attempts.append(1)
            raise ConnectionError("upstream down")

        run.call("flaky", flaky)

    with WorkerThread(ob, "a", "1", handler, max_step_retries=2, retry_base_seconds=0.01):
        run = ob.start_run("a", "1", {})
        wait_for(lambda: status(ob, run) == RunStatus.FAILED, timeout=15)
    failed = ob.run(run.id).record
    assert len(attempts) == 3, "first try + 2 retries"
    assert failed.step_retries == {"flaky": 3}
    assert failed.error["step"] == "flaky"
    assert failed.error["type"] == "ConnectionError"
    assert failed.error["message"] == "upstream down"
    with pytest.raises(RunTerminal):
        ob.run(run.id).call("more", lambda: 1)


def test_a_step_that_recovers_within_its_retries_completes(ob: Outbox) -> None:
    calls: list[int] = []

    def handler(run: Run) -> int:
        def sometimes() -> int:
            calls.append(1)
            if len(calls) < 3:
                raise TimeoutError("model call timed out")
            return 7

        result: int = run.call("model", sometimes)
        return result

    with WorkerThread(ob, "a", "1", handler, max_step_retries=3, retry_base_seconds=0.01):
        run = ob.start_run("a", "1", {})
        wait_for(lambda: status(ob, run) == RunStatus.COMPLETED, timeout=15)
    record = ob.run(run.id).record
    assert record.result == 7 and record.step_retries == {"model": 2}


def test_timers_are_found_by_index_not_by_scanning(ob: Outbox) -> None:
    with ob.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO outbox_runs (id, shard, agent, agent_version, inputs, inputs_hash, "
                "status, wake_at) SELECT i, outbox_shard_of(i), 'a', '1', '{}', 'h', 'waiting', "
                "now() + (g || ' minutes')::interval "
                "FROM (SELECT gen_random_uuid() AS i, g FROM generate_series(1, 20000) g) AS s"
            )
        )
        conn.execute(text("ANALYZE outbox_runs"))
        plan = "\n".join(
            r[0]
            for r in conn.execute(
                text(
                    "EXPLAIN SELECT id FROM outbox_runs WHERE status = 'waiting' "
                    "AND wake_at <= now() ORDER BY wake_at LIMIT 1000 FOR UPDATE SKIP LOCKED"
                )
            )
        )
    assert "outbox_runs_timers" in plan
    assert "Seq Scan" not in plan
