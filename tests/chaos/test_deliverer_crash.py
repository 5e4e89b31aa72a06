"""kill -9 of a deliverer at each crash point: nothing lost, nothing applied twice.

Expected outcome for every crash point: after a fresh deliverer recovers,
every intent is terminal or ``unknown``; each idempotent effect is applied at
the sink exactly once (redeliveries carry the same key and are deduplicated);
the non-idempotent effects whose attempt was lost are ``unknown``, listed by
``outbox reconcile``, never resent blindly.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from deliverers.testing import IdempotentHttpSink
from outbox import Outbox, StepTransaction
from outbox.check.processes import start_deliverer
from outbox.check.workload import write_config
from tests.support import wait_for


@pytest.fixture
def sink() -> Iterator[IdempotentHttpSink]:
    with IdempotentHttpSink(latency=0.05) as running:
        yield running


def intend_both_kinds(ob: Outbox, sink_url: str, n: int) -> None:
    run = ob.start_run("agent", "1")

    def step(tx: StepTransaction) -> None:
        for i in range(n):
            tx.intend("http.request", {"url": f"{sink_url}/a", "json": {"operation": f"a{i}"}})
            tx.intend("http.blind", {"url": f"{sink_url}/b", "json": {"operation": f"b{i}"}})

    run.transaction("s", step)


def statuses(ob: Outbox, kind: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for e in ob.effects(kind=kind, limit=10_000):
        counts[e.status.value] = counts.get(e.status.value, 0) + 1
    return counts


@pytest.mark.parametrize("crash_at", ["after_claim", "after_call", "during_completion"])
def test_kill_at_crash_point_then_recover(
    ob: Outbox, sub_env: dict[str, str], tmp_path: Path, sink: IdempotentHttpSink, crash_at: str
) -> None:
    n = 15
    intend_both_kinds(ob, sink.url, n)
    config = write_config(tmp_path)
    doomed = start_deliverer(sub_env, config, tmp_path / "doomed.log", crash_at=crash_at)
    assert doomed.wait(timeout=60) == -signal.SIGKILL, (tmp_path / "doomed.log").read_text()
    lost_in_crash = statuses(ob, "http.blind").get("in_flight", 0)
    if crash_at == "after_claim":
        assert sink.stats()["requests"] == 0, "killed after the claim, before any call"

    survivor = start_deliverer(sub_env, config, tmp_path / "survivor.log")
    try:

        def settled() -> bool:
            a, b = statuses(ob, "http.request"), statuses(ob, "http.blind")
            return a == {"succeeded": n} and set(b) <= {"succeeded", "unknown"}

        wait_for(settled, timeout=60, message="recovery")
    finally:
        survivor.send_signal(signal.SIGTERM)
        assert survivor.wait(timeout=60) == 0

    blind = statuses(ob, "http.blind")
    assert blind.get("unknown", 0) == lost_in_crash > 0 or crash_at == "after_claim"
    assert sum(blind.values()) == n, "no blind intent lost"
    stats = sink.stats()
    assert stats["duplicate_keys_applied"] == [] and stats["duplicate_operations"] == []
    succeeded = {e.idempotency_key for e in ob.effects(status="succeeded", limit=10_000)}
    assert succeeded <= set(sink.state.applied), "every succeeded effect reached the sink"

    report = subprocess.run(
        [sys.executable, "-m", "outbox", "reconcile", "--config", str(config), "--json"],
        env=sub_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert report.returncode == 0, report.stderr
    listed = json.loads(report.stdout)["unknown"]
    assert len(listed) == blind.get("unknown", 0)
    assert all(item["kind"] == "http.blind" for item in listed)
