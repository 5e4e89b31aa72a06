"""`outbox serve`: signals over HTTP only when signed, fresh and not replayed (uvicorn)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from outbox import Outbox
from outbox.serve.app import OutboxServer
from outbox.serve.settings import Credentials, ServeSettings
from outbox.serve.webhooks import SIGNATURE_HEADER, TIMESTAMP_HEADER, sign

SECRET = b"0123456789abcdef-secret"
METRICS_TOKEN = "metrics-token-0123456789"


@pytest.fixture
def server(ob: Outbox) -> Iterator[OutboxServer]:
    running = OutboxServer(
        ob,
        ServeSettings(port=0, tolerance=60, counts_cache_seconds=30, console=False),
        Credentials(webhook_secret=SECRET, metrics_token=METRICS_TOKEN.encode()),
    ).start()
    yield running
    running.shutdown()


def post(
    server: OutboxServer,
    path: str,
    body: dict[str, object],
    *,
    secret: bytes = SECRET,
    at: int | None = None,
    headers: bool = True,
) -> httpx.Response:
    raw = json.dumps(body).encode()
    stamp = int(time.time()) if at is None else at
    sent = {TIMESTAMP_HEADER: str(stamp), SIGNATURE_HEADER: sign(secret, stamp, path, raw)}
    return httpx.post(f"{server.url}{path}", content=raw, headers=sent if headers else {})


def test_signed_signal_is_accepted_once(ob: Outbox, server: OutboxServer) -> None:
    run = ob.start_run("a", "1")
    path = f"/runs/{run.id}/signals/approval"
    stamp = int(time.time())
    ok = post(server, path, {"payload": {"by": "cfo"}, "dedup_key": "mail-7"}, at=stamp)
    assert ok.status_code == 202 and ok.json()["duplicate"] is False
    assert ok.json()["signal_id"] and ok.json()["woke_run"] is False
    # The sender retries with a fresh signature (another timestamp, so it is not a
    # replay of the first request): the dedup key makes it a no-op.
    again = post(server, path, {"payload": {"by": "cfo"}, "dedup_key": "mail-7"}, at=stamp - 1)
    assert again.status_code == 202 and again.json()["duplicate"] is True
    assert run.wait_signal("approval", name="approval", timeout=1) == {"by": "cfo"}


def test_unsigned_forged_stale_and_replayed_requests_are_refused(
    ob: Outbox, server: OutboxServer
) -> None:
    run = ob.start_run("a", "1")
    path = f"/runs/{run.id}/signals/approval"
    assert post(server, path, {"payload": 1}, headers=False).status_code == 401
    assert post(server, path, {"payload": 1}, secret=b"another-secret-xx").status_code == 401
    stale = post(server, path, {"payload": 1}, at=int(time.time()) - 3600)
    assert stale.status_code == 401 and "stale" in stale.json()["error"]
    raw = json.dumps({"payload": 1}).encode()
    stamp = int(time.time())
    headers = {TIMESTAMP_HEADER: str(stamp), SIGNATURE_HEADER: sign(SECRET, stamp, path, raw)}
    url = f"{server.url}{path}"
    assert httpx.post(url, content=raw, headers=headers).status_code == 202
    replay = httpx.post(url, content=raw, headers=headers)
    assert replay.status_code == 409 and "replayed" in replay.json()["error"]


def test_a_request_refused_for_another_reason_can_be_sent_again(
    ob: Outbox, server: OutboxServer
) -> None:
    """M4: the signature is marked used only together with the stored signal."""
    run_id = uuid.uuid4()
    path = f"/runs/{run_id}/signals/approval"
    raw = json.dumps({"payload": "yes"}).encode()
    stamp = int(time.time())
    headers = {TIMESTAMP_HEADER: str(stamp), SIGNATURE_HEADER: sign(SECRET, stamp, path, raw)}
    url = f"{server.url}{path}"
    assert httpx.post(url, content=raw, headers=headers).status_code == 404
    run = ob.start_run("a", "1", run_id=run_id)
    assert httpx.post(url, content=raw, headers=headers).status_code == 202
    assert httpx.post(url, content=raw, headers=headers).status_code == 409
    assert run.wait_signal("approval", name="approval", timeout=1) == "yes"


def test_errors_map_to_statuses(ob: Outbox, server: OutboxServer) -> None:
    done = ob.start_run("a", "1")
    done.complete()
    assert post(server, f"/runs/{done.id}/signals/x", {}).status_code == 409
    assert (
        post(server, "/runs/00000000-0000-0000-0000-000000000000/signals/x", {}).status_code == 404
    )
    assert post(server, "/nowhere", {}).status_code == 404
    assert post(server, "/runs/not-a-run/signals/x", {}).status_code == 404


def test_health_and_metrics(ob: Outbox, server: OutboxServer) -> None:
    ob.start_run("a", "1")
    assert httpx.get(f"{server.url}/healthz").json() == {"ok": True}
    auth = {"Authorization": f"Bearer {METRICS_TOKEN}"}
    metrics = httpx.get(f"{server.url}/metrics", headers=auth).text
    assert 'outbox_runs{status="runnable"} 1.0' in metrics
