"""Approval gates against real processes: a deliverer, a worker, ``outbox serve`` and the CLI.

An effect over the threshold waits (nothing reaches the sink), is not released
by an approval of another payload's digest, is delivered once after the right
approval (a signed HTTP call), and its run resumes; an approval past the
deadline is refused and the gate's ``on_timeout`` happens.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from deliverers.testing import IdempotentHttpSink
from outbox import EffectStatus, Outbox, RunStatus
from outbox.check.processes import start_deliverer
from outbox.payloads import content_hash, jsonb_text
from outbox.serve.webhooks import SIGNATURE_HEADER, TIMESTAMP_HEADER, sign
from tests.support import wait_for

pytestmark = pytest.mark.slow

SECRET = b"approvals-secret-0123456789"
CONFIG = """
[kinds."payments.send"]
type = "http.request"
allow_private = ["127.0.0.1"]

[kinds."payments.urgent"]
type = "http.request"
allow_private = ["127.0.0.1"]

[[approvals]]
name = "large-payments"
kind = "payments.send"
when = [ { pointer = "/json/amount", op = "gt", value = 10000 } ]

[[approvals]]
name = "urgent-payments"
kind = "payments.urgent"
timeout = 1
on_timeout = "cancel_run"
"""


def spawn(env: dict[str, str], log: Path, *args: str) -> subprocess.Popen[bytes]:
    with log.open("ab") as handle:
        return subprocess.Popen(
            [sys.executable, "-m", "outbox", *args],
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
        )


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def stop(*procs: subprocess.Popen[bytes]) -> None:
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        proc.wait(timeout=60)


@pytest.fixture
def stack(
    ob: Outbox, sub_env: dict[str, str], tmp_path: Path
) -> Iterator[tuple[IdempotentHttpSink, dict[str, str], int]]:
    config = tmp_path / "deliverers.toml"
    config.write_text(CONFIG)
    env = {**sub_env, "OUTBOX_WEBHOOK_SECRET": SECRET.decode(), "PYTHONPATH": str(Path.cwd())}
    port = _free_port()
    with IdempotentHttpSink() as sink:
        procs = [
            start_deliverer(env, config, tmp_path / "deliver.log", "--reconcile-every", "0.2"),
            spawn(
                env,
                tmp_path / "worker.log",
                "worker",
                "tests.governance_agents:pay",
                "--agent",
                "payer",
                "--version",
                "1",
            ),
            spawn(env, tmp_path / "serve.log", "serve", "--port", str(port)),
        ]
        try:
            wait_for(lambda: len(ob.gates()) == 2, timeout=30, message="gates stored at start-up")
            wait_for(lambda: _up(port), timeout=30, message="outbox serve")
            yield sink, env, port
        finally:
            stop(*procs)


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _up(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def signed_decision(
    port: int, effect_id: Any, body: dict[str, Any], stamp: int | None = None
) -> httpx.Response:
    path = f"/effects/{effect_id}/approval"
    raw = json.dumps(body).encode()
    stamp = int(time.time()) if stamp is None else stamp
    headers = {TIMESTAMP_HEADER: str(stamp), SIGNATURE_HEADER: sign(SECRET, stamp, path, raw)}
    return httpx.post(f"http://127.0.0.1:{port}{path}", content=raw, headers=headers, timeout=30)


def held_effect(ob: Outbox, run_id: Any) -> Any:
    def find() -> Any:
        found = ob.effects(run_id=run_id)
        return found[0] if found and ob.run(run_id).status == RunStatus.WAITING else None

    return wait_for(find, timeout=30, message="the run parks on its effect")


def test_a_held_payment_is_released_only_by_its_own_digest_and_the_run_resumes(
    ob: Outbox, stack: tuple[IdempotentHttpSink, dict[str, str], int]
) -> None:
    sink, env, port = stack
    small = ob.start_run("payer", "1", {"sink": sink.url, "amount": 500, "kind": "payments.send"})
    large = ob.start_run(
        "payer", "1", {"sink": sink.url, "amount": 12_500, "kind": "payments.send"}
    )
    wait_for(lambda: ob.run(small.id).status == RunStatus.COMPLETED, timeout=60)
    held = held_effect(ob, large.id)
    assert held.status == EffectStatus.AWAITING_APPROVAL
    time.sleep(0.5)  # a deliverer that would claim it has had time to
    assert sink.stats()["operations_applied"] == 1, "only the small payment reached the sink"

    # The approver was shown another payload (the amount tampered with): its digest.
    other = {**held.payload, "json": {**held.payload["json"], "amount": 125}}
    wrong = content_hash(jsonb_text(other))
    refused = cli(env, "effects", "approve", str(held.id), "--digest", wrong, "--note", "ok")
    assert refused.returncode == 1 and "approval refused" in refused.stderr
    assert "\n" not in refused.stderr.strip(), "one line, no traceback"
    answer = signed_decision(
        port, held.id, {"decision": "approve", "digest": wrong, "note": "ok", "by": "cfo"}
    )
    assert answer.status_code == 409 and "another payload" in answer.json()["error"]
    time.sleep(0.5)
    assert ob.effect(held.id).status == EffectStatus.AWAITING_APPROVAL
    assert ob.run(large.id).status == RunStatus.WAITING
    assert sink.stats()["operations_applied"] == 1

    body = {"decision": "approve", "digest": held.digest, "note": "board minute 14", "by": "cfo"}
    stamp = int(time.time())
    answer = signed_decision(port, held.id, body, stamp)
    assert answer.status_code == 200, answer.text
    # The same signed request again is a replay: refused before it is looked at.
    replay = signed_decision(port, held.id, body, stamp)
    assert replay.status_code == 409 and "replayed" in replay.json()["error"]
    # A fresh request for the same approval is refused too: a decision is taken once.
    again = signed_decision(port, held.id, body, stamp + 1)
    assert again.status_code == 409 and "taken once" in again.json()["error"], again.text
    wait_for(lambda: ob.run(large.id).status == RunStatus.COMPLETED, timeout=60, message="resumed")
    assert ob.run(large.id).record.result == {"paid": 12_500, "status": 200}
    stats = sink.stats()
    assert stats["operations_applied"] == 2 and stats["keys_received"] == 2
    assert stats["duplicate_operations"] == []
    log = [(a.outcome, a.worker) for a in ob.store.attempts(held.id)]
    assert log[1:3] == [("approval_refused", "cfo"), ("approved", "cfo")]
    outcomes = [outcome for outcome, _ in log]
    # The replay leaves no trace; the second decision is logged (before or after
    # the delivery, whichever came first); one delivery.
    assert outcomes.count("approval_refused") == 3 and outcomes.count("succeeded") == 1


def test_an_approval_past_the_deadline_is_refused_and_the_run_is_cancelled(
    ob: Outbox, stack: tuple[IdempotentHttpSink, dict[str, str], int]
) -> None:
    sink, env, _ = stack
    run = ob.start_run("payer", "1", {"sink": sink.url, "amount": 5, "kind": "payments.urgent"})
    held = held_effect(ob, run.id)
    assert held.approval["on_timeout"] == "cancel_run" and held.approval_deadline is not None
    time.sleep(1.5)
    late = cli(env, "effects", "approve", str(held.id), "--digest", held.digest, "--note", "late")
    assert late.returncode == 1 and "approval refused" in late.stderr, late.stderr
    wait_for(lambda: ob.run(run.id).status == RunStatus.CANCELLED, timeout=30, message="cancelled")
    assert ob.effect(held.id).status == EffectStatus.CANCELLED
    assert "timed_out" in [a.outcome for a in ob.store.attempts(held.id)]
    assert sink.stats()["requests"] == 0
