"""A poison outcome costs one effect, not the deliverer (issue 11, C1): real `outbox deliver`.

Before: a sink's UTF-16 error page (NUL bytes) made the batch's completion
statement fail; the daemon retried it every 0.5 s for ever, its heartbeats
kept the leases alive, every later outcome joined the failing batch, and
SIGTERM with ``--grace 5`` did not end the process. A role missing a
privilege did the same.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from deliverers.testing import Fault, IdempotentHttpSink
from outbox import Outbox, StepTransaction
from outbox.check.processes import Process, start_deliverer
from outbox.check.workload import write_config
from tests.support import as_superuser, limited_role, wait_for

GRACE = 5


def intend(ob: Outbox, url: str, n: int, kind: str = "http.request") -> None:
    run = ob.start_run("agent", "1")

    def step(tx: StepTransaction) -> None:
        for i in range(n):
            tx.intend(kind, {"url": f"{url}/ledger", "json": {"operation": f"op-{i}"}})

    run.transaction("s", step)


def statuses(ob: Outbox) -> list[str]:
    return sorted(e.status.value for e in ob.effects(limit=1000))


def stop_within_grace(proc: Process, log: Path) -> float:
    proc.send_signal(signal.SIGTERM)
    started = time.monotonic()
    try:
        code = proc.wait(timeout=GRACE + 25)
    except Exception:
        proc.kill()
        raise AssertionError(f"SIGTERM did not end it:\n{log.read_text()[-3000:]}") from None
    took = time.monotonic() - started
    assert code == 0, log.read_text()[-3000:]
    assert took < GRACE, f"exited {took:.1f}s after SIGTERM, past --grace {GRACE}"
    return took


def test_a_nul_laden_error_page_costs_one_effect_not_the_deliverer(
    ob: Outbox, sub_env: dict[str, str], tmp_path: Path
) -> None:
    # Latency: the calls overlap, so their outcomes are written in shared batches.
    with IdempotentHttpSink(latency=0.2) as sink:
        intend(ob, sink.url, 3)
        sink.inject(Fault("bad_body", times=1, status=400))  # the first request gets it
        intend(ob, sink.url, 17)
        log = tmp_path / "d.log"
        proc = start_deliverer(
            sub_env, write_config(tmp_path), log, "--concurrency", "20", "--grace", str(GRACE)
        )
        try:
            wait_for(
                lambda: statuses(ob) == ["failed"] + ["succeeded"] * 19,
                timeout=30,
                message="the batch delivered, the poison effect failed",
            )
            # ... and the deliverer goes on: later intents are delivered too.
            intend(ob, sink.url, 5)
            wait_for(lambda: statuses(ob) == ["failed"] + ["succeeded"] * 24, timeout=30)
        finally:
            stop_within_grace(proc, log)
    [poison] = [e for e in ob.effects(limit=100) if e.status.value == "failed"]
    assert poison.last_error == "HTTP 400"
    [attempt] = ob.store.attempts(poison.id)
    assert attempt.outcome == "failed" and attempt.detail["status"] == 400
    assert "\\x00" in attempt.detail["body"], "the error page is kept, its NULs escaped"
    assert sink.stats()["keys_applied"] == 24 and sink.stats()["duplicate_keys_applied"] == []
    assert "Traceback" not in log.read_text()


def test_a_deliverer_role_that_cannot_record_pauses_and_exits_within_grace(
    ob: Outbox, dsn: str, sub_env: dict[str, str], tmp_path: Path
) -> None:
    """No UPDATE on outbox_runs: every completion fails (it may wake an awaiting run)."""
    with IdempotentHttpSink() as sink:
        intend(ob, sink.url, 3)
        intend(ob, sink.url, 2, kind="http.blind")
        log = tmp_path / "d.log"
        with limited_role(dsn, "UPDATE ON outbox_runs"):
            proc = start_deliverer(sub_env, write_config(tmp_path), log, "--grace", str(GRACE))
            try:

                def lapsed() -> bool:
                    rows = as_superuser(
                        dsn,
                        "SELECT count(DISTINCT effect_id) FROM outbox_effect_attempts "
                        "WHERE outcome = 'expired'",
                    )
                    return bool(rows[0][0] == 5)

                # Leases are no longer renewed: the reconciler finds every one expired.
                wait_for(lapsed, timeout=30, message="abandoned leases lapse")
                time.sleep(3)
                requests = sink.stats()["requests"]
            finally:
                stop_within_grace(proc, log)
    text = log.read_text()
    assert "permission denied for table outbox_runs" in text and "SQLSTATE 42501" in text
    assert "lacks a privilege" in text
    # Paused 1 s, 2 s, 4 s ... per kind: a handful of calls, not a loop.
    assert requests <= 15, f"{requests} requests: the deliverer spins"
    blind = [e for e in ob.effects(limit=100) if e.kind == "http.blind"]
    assert {e.status.value for e in blind} == {"unknown"}, "never resent blindly"
