"""The HTTP API end to end with real processes: `outbox serve`, `outbox deliver`, a real sink.

An agent that speaks only HTTP records a step with three intents; a real
deliverer performs each exactly once at an idempotent HTTP sink; the agent
learns each outcome by long polling. The curl example runs as written too.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from deliverers.testing import IdempotentHttpSink
from outbox import Outbox
from tests.api_client import TOKEN, ApiClient
from tests.support import wait_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as handle:
        return subprocess.Popen(
            [sys.executable, "-m", "outbox", *args],
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
        )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class Stack:
    url: str
    sink: IdempotentHttpSink
    env: dict[str, str]
    logs: Path


@pytest.fixture
def stack(sub_env: dict[str, str], tmp_path: Path) -> Iterator[Stack]:
    """`outbox serve` with an API token, `outbox deliver` and a sink, as an operator runs them."""
    env = {**sub_env, "OUTBOX_API_TOKEN": TOKEN}
    config = tmp_path / "deliverers.toml"
    config.write_text('[kinds."http.request"]\nallow_private = ["127.0.0.1"]\n')
    port = _free_port()
    with IdempotentHttpSink(log_path=tmp_path / "sink.jsonl") as sink:
        serve = _spawn(["serve", "--port", str(port), "--no-console"], env, tmp_path / "serve.log")
        deliver = _spawn(
            ["deliver", "--config", str(config), "--poll", "0.2"], env, tmp_path / "deliver.log"
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_for(lambda: _answers(url), timeout=60, message="outbox serve to listen")
            yield Stack(url, sink, env, tmp_path)
        finally:
            for proc in (serve, deliver):
                _stop(proc)
    for name in ("serve.log", "deliver.log"):
        text = (tmp_path / name).read_text()
        assert "Traceback" not in text, f"{name}:\n{text[-3000:]}"


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz").status_code == 200
    except httpx.HTTPError:
        return False


def test_intents_sent_over_http_are_delivered_exactly_once(ob: Outbox, stack: Stack) -> None:
    with ApiClient(stack.url, timeout=60) as api:
        run_id = api.post("/runs", json={"agent": "mailer", "version": "1"}).json()["run"]["id"]
        step: dict[str, Any] = {
            "step_id": "send",
            "result": {"queued": 3},
            "state": {"sent": 3},
            "intents": [
                {
                    "kind": "http.request",
                    "payload": {
                        "url": f"{stack.sink.url}/mail",
                        "json": {"operation": f"mail-{i}"},
                    },
                }
                for i in range(3)
            ],
        }
        recorded = api.post(f"/runs/{run_id}/steps", json=step)
        assert recorded.status_code == 201, recorded.text
        outcomes = []
        for effect in recorded.json()["effects"]:
            # A long poll answers when the deliverer is done (or says done=false: ask again).

            def done(effect_id: str = effect["id"]) -> dict[str, Any] | None:
                return _done(api, effect_id)

            outcome = wait_for(done, timeout=60, message="the effect to end")
            assert outcome is not None
            outcomes.append(outcome)
        assert [o["status"] for o in outcomes] == ["succeeded"] * 3
        assert all(o["result"]["status"] == 200 for o in outcomes)
        # Replayed after delivery: the recorded step, no new intent, nothing sent again.
        replay = api.post(f"/runs/{run_id}/steps", json=step)
        assert replay.status_code == 200 and replay.json()["replayed"] is True
        assert api.post(f"/runs/{run_id}/complete", json={"result": "ok"}).is_success
    stats = stack.sink.stats()
    assert stats["keys_applied"] == 3 and stats["operations_applied"] == 3
    assert stats["duplicate_keys_applied"] == [] and stats["duplicate_operations"] == []
    assert len(ob.effects(run_id=run_id)) == 3
    assert ob.run(run_id).status == "completed"


def _done(api: ApiClient, effect_id: str) -> dict[str, Any] | None:
    answer = api.get(f"/effects/{effect_id}/outcome", params={"wait": 10})
    assert answer.status_code == 200, answer.text
    outcome: dict[str, Any] = answer.json()
    return outcome if outcome["done"] else None


def test_the_curl_example_runs_as_written(stack: Stack) -> None:
    assert shutil.which("jq") and shutil.which("curl"), "the example needs curl and jq (.ci/run)"
    done = subprocess.run(
        ["bash", str(ROOT / "examples" / "http_api_agent.sh")],
        env={**os.environ, **stack.env, "OUTBOX_API_URL": stack.url, "SINK_URL": stack.sink.url},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert '"replayed":true' in lines[2] and '"effects":3' in lines[2], lines
    assert '"refused":"idempotency_conflict"' in lines[4] and "intents[0].key" in lines[4]
    outcomes = [line for line in lines if '"done"' in line]
    assert len(outcomes) == 4 and all('"status":"succeeded"' in o for o in outcomes), lines
    assert lines[-1].endswith('"status":"completed"}'), lines
    assert stack.sink.stats()["keys_applied"] == 4
    assert stack.sink.stats()["duplicate_keys_applied"] == []
