"""SIGTERM: stop claiming, finish in-flight calls within the grace period, exit 0."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from deliverers.testing import IdempotentHttpSink
from outbox import Outbox
from outbox.testing.processes import start_deliverer
from outbox.testing.workload import write_config
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
