"""`outbox serve`: signals over HTTP only when signed, fresh and not replayed."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from outbox import Outbox
from outbox.serve.webhooks import SIGNATURE_HEADER, TIMESTAMP_HEADER, SignalServer, sign

SECRET = b"0123456789abcdef-secret"


@pytest.fixture
def server(ob: Outbox) -> Iterator[SignalServer]:
    running = SignalServer(ob, SECRET, port=0, tolerance=60)
    thread = threading.Thread(target=running.serve_forever, daemon=True)
    thread.start()
    yield running
    running.shutdown()
    thread.join(5)


def post(
    server: SignalServer,
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
    return httpx.post(
        f"http://127.0.0.1:{server.port}{path}", content=raw, headers=sent if headers else {}
    )


def test_signed_signal_is_accepted_once(ob: Outbox, server: SignalServer) -> None:
    run = ob.start_run("a", "1")
    path = f"/runs/{run.id}/signals/approval"
    stamp = int(time.time())
    ok = post(server, path, {"payload": {"by": "cfo"}, "dedup_key": "mail-7"}, at=stamp)
    assert ok.status_code == 202 and ok.json()["duplicate"] is False
    # The sender retries with a fresh signature (another timestamp, so it is not a
    # replay of the first request): the dedup key makes it a no-op.
    again = post(server, path, {"payload": {"by": "cfo"}, "dedup_key": "mail-7"}, at=stamp - 1)
    assert again.status_code == 202 and again.json()["duplicate"] is True
    assert run.wait_signal("approval", name="approval", timeout=1) == {"by": "cfo"}


def test_unsigned_forged_stale_and_replayed_requests_are_refused(
    ob: Outbox, server: SignalServer
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
    url = f"http://127.0.0.1:{server.port}{path}"
    assert httpx.post(url, content=raw, headers=headers).status_code == 202
    replay = httpx.post(url, content=raw, headers=headers)
    assert replay.status_code == 409 and "replayed" in replay.json()["error"]


def test_errors_map_to_statuses(ob: Outbox, server: SignalServer) -> None:
    done = ob.start_run("a", "1")
    done.complete()
    assert post(server, f"/runs/{done.id}/signals/x", {}).status_code == 409
    assert (
        post(server, "/runs/00000000-0000-0000-0000-000000000000/signals/x", {}).status_code == 404
    )
    assert post(server, "/nowhere", {}).status_code == 404


def test_health_and_metrics(ob: Outbox, server: SignalServer) -> None:
    ob.start_run("a", "1")
    base = f"http://127.0.0.1:{server.port}"
    assert httpx.get(f"{base}/healthz").json() == {"ok": True}
    metrics = httpx.get(f"{base}/metrics").text
    assert 'outbox_runs{status="runnable"} 1.0' in metrics
