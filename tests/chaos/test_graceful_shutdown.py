"""SIGTERM: stop claiming, finish in-flight calls within the grace period, exit 0."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from deliverers.testing import IdempotentHttpSink
from outbox import Outbox
from outbox.check.processes import start_deliverer
from outbox.check.workload import write_config
from tests.support import wait_for


def test_sigterm_finishes_in_flight_calls_and_exits_zero(
    ob: Outbox, sub_env: dict[str, str], tmp_path: Path
) -> None:
    with IdempotentHttpSink(latency=1.0) as sink:
        run = ob.start_run("agent", "1")
        run.transaction(
            "s",
            lambda tx: (
                [tx.intend("http.request", {"url": f"{sink.url}/x"}) for _ in range(20)] and None
            ),
        )
        proc = start_deliverer(
            sub_env,
            write_config(tmp_path),
            tmp_path / "d.log",
            "--concurrency",
            "4",
            "--grace",
            "10",
        )
        wait_for(lambda: sink.in_progress >= 4, timeout=30, message="calls in flight")
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert proc.wait(timeout=30) == 0, (tmp_path / "d.log").read_text()
        assert time.monotonic() - started < 10
        counts: dict[str, int] = {}
        for e in ob.effects(limit=100):
            counts[e.status.value] = counts.get(e.status.value, 0) + 1
        assert counts.get("in_flight", 0) == 0, "nothing left claimed by the stopped deliverer"
        assert counts.get("succeeded", 0) >= 4, "the calls in flight were finished and recorded"
        assert sum(counts.values()) == 20
        assert sink.stats()["keys_applied"] == counts["succeeded"]


def test_a_sync_call_past_the_grace_period_does_not_hold_the_process(
    ob: Outbox, sub_env: dict[str, str], tmp_path: Path
) -> None:
    """A synchronous deliverer's call (run in a thread) takes 20 s; --grace is 1.

    The thread cannot be interrupted. Expected: the process exits about when
    the grace period ends, the call is left to its lease (the reconciler
    resolves it), and the exit status is 0.
    """
    config = tmp_path / "sleepy.toml"
    config.write_text(
        '[kinds."k.sleepy"]\ntype = "python.call"\n'
        'function = "tests.fixtures_callables:sleeps"\nidempotent = true\n'
    )
    run = ob.start_run("agent", "1")
    run.transaction("s", lambda tx: tx.intend("k.sleepy", {"seconds": 20}) and None)
    log = tmp_path / "d.log"
    proc = start_deliverer(sub_env, config, log, "--grace", "1")
    try:
        wait_for(
            lambda: ob.effects()[0].status == "in_flight", timeout=30, message="the call started"
        )
        time.sleep(0.5)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    # Before: 20.5 s, the interpreter waiting for the thread of the abandoned call.
    assert took < 1 + 4, f"exited after {took:.1f}s with --grace 1"
    assert "abandoning 1 calls" in log.read_text()
