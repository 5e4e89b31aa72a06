"""Issue 11, H2 and L3: `outbox serve` cannot be exhausted, crashed or made to leak.

Each test talks to a real uvicorn server: on a thread for behaviour, as a real
`outbox serve` subprocess where its memory or its log is what is measured.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from outbox import Outbox
from outbox.serve.app import OutboxServer
from outbox.serve.settings import Credentials, ServeSettings
from outbox.serve.webhooks import SIGNATURE_HEADER, TIMESTAMP_HEADER, sign
from outbox.storage.engine import make_engine
from tests.support import wait_for

SECRET = b"0123456789abcdef-secret"
METRICS = b"metrics-token-0123456789"


def serve(ob: Outbox, **limits: object) -> OutboxServer:
    settings = ServeSettings(port=0, tolerance=60, console=False, **limits)
    return OutboxServer(
        ob, settings, Credentials(webhook_secret=SECRET, metrics_token=METRICS)
    ).start()


@pytest.fixture
def server(ob: Outbox) -> Iterator[OutboxServer]:
    running = serve(ob, header_timeout=1, body_timeout=1, idle_timeout=1)
    yield running
    running.shutdown()


def raw_request(port: int, data: bytes, *, read_timeout: float = 10) -> bytes:
    """Send ``data`` on a fresh connection; everything the server answers until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=read_timeout) as sock:
        # a refusal may answer and close before all was sent: what it said is read below
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks)


def signed_headers(path: str, body: bytes) -> dict[str, str]:
    stamp = int(time.time())
    return {TIMESTAMP_HEADER: str(stamp), SIGNATURE_HEADER: sign(SECRET, stamp, path, body)}


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """True when the server closes the connection within ``within`` seconds (data is skipped)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            if sock.recv(4096) == b"":
                return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False
    return False


# -- H2: bounded body, timeouts, bounded concurrency ---------------------------------


def test_a_negative_content_length_does_not_skip_the_body_limit(
    ob: Outbox, server: OutboxServer
) -> None:
    run = ob.start_run("a", "1")
    head = (
        f"POST /runs/{run.id}/signals/x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: -1\r\n\r\n"
    ).encode()
    answer = raw_request(server.port, head + b"x" * (2 * 1024 * 1024))
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]


def test_a_chunked_body_without_length_stops_at_the_limit(ob: Outbox, server: OutboxServer) -> None:
    run = ob.start_run("a", "1")
    path = f"/runs/{run.id}/signals/x"

    def body() -> Iterator[bytes]:
        for _ in range(40):  # 2.5 MiB, sent without a Content-Length
            yield b"[" + b" " * 65534 + b"]"

    answer = httpx.post(f"{server.url}{path}", content=body(), headers=signed_headers(path, b""))
    assert answer.status_code == 413 and "body over 1048576 bytes" in answer.json()["error"]
    declared = httpx.post(
        f"{server.url}{path}", content=b"x" * (1024 * 1024 + 1), headers=signed_headers(path, b"")
    )
    assert declared.status_code == 413


def test_headers_sent_too_slowly_lose_the_connection(server: OutboxServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /runs/x/signals/y HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        assert closed_by_server(sock, within=5)


def test_a_body_sent_too_slowly_is_answered_408(ob: Outbox, server: OutboxServer) -> None:
    run = ob.start_run("a", "1")
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(
            f"POST /runs/{run.id}/signals/x HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            "Content-Length: 100\r\n\r\n"
            "0123456789".encode()
        )
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 408"), answer


def test_an_idle_keep_alive_connection_is_closed(server: OutboxServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert b"200 OK" in sock.recv(4096)
        started = time.monotonic()
        assert closed_by_server(sock, within=5)
        assert time.monotonic() - started >= 0.5  # kept open for the next request first


def test_half_sent_requests_are_cut_off_and_do_not_count_as_requests(ob: Outbox) -> None:
    # Issue 27 item 12: uvicorn's limit counted connections, so four half-sent
    # requests made a server of `--max-concurrency 4` answer 503 to everyone.
    running = serve(ob, max_concurrency=4, header_timeout=1)
    try:
        idle = [socket.create_connection(("127.0.0.1", running.port)) for _ in range(4)]
        for sock in idle:
            sock.sendall(b"GET /healthz HTTP/1.1\r\n")  # headers never finished
        time.sleep(0.2)
        assert httpx.get(f"{running.url}/metrics").status_code == 401  # answered, not 503
        for sock in idle:
            assert closed_by_server(sock, within=5)  # the header deadline
            sock.close()
    finally:
        running.shutdown()


# -- L3: bad input never raises in a handler, nothing leaks ---------------------------


def test_malformed_signature_headers_are_refused_not_raised(
    ob: Outbox, server: OutboxServer
) -> None:
    run = ob.start_run("a", "1")
    path = f"/runs/{run.id}/signals/x"
    body = b'{"payload": 1}'
    stamp = str(int(time.time())).encode()
    for timestamp, signature in [
        (b"\xb2", b"sha256=00"),  # a superscript digit: str.isdigit() says yes
        (stamp, "sha256=é".encode("latin-1") + b"0" * 63),  # non-ASCII signature
        (stamp, b"sha256=" + b"z" * 64),
        (b"9" * 40, b"sha256=" + b"0" * 64),
    ]:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n".encode()
            + b"X-Outbox-Timestamp: "
            + timestamp
            + b"\r\n"
            + b"X-Outbox-Signature: "
            + signature
            + b"\r\n\r\n"
        )
        answer = raw_request(server.port, head + body, read_timeout=3)
        assert answer.startswith(b"HTTP/1.1 401"), answer[:300]


def test_deeply_nested_json_is_a_400(ob: Outbox, server: OutboxServer) -> None:
    run = ob.start_run("a", "1")
    path = f"/runs/{run.id}/signals/x"
    for body in [b'{"payload": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", b"[" * 200_000]:
        answer = httpx.post(f"{server.url}{path}", content=body, headers=signed_headers(path, body))
        assert answer.status_code == 400 and "nested deeper" in answer.json()["error"]


def test_tolerance_must_be_finite(sub_env: dict[str, str]) -> None:
    for bad in ("nan", "inf", "-1"):
        done = subprocess.run(
            [sys.executable, "-m", "outbox", "serve", "--tolerance", bad],
            env={**sub_env, "OUTBOX_WEBHOOK_SECRET": SECRET.decode()},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, done.stderr
        assert "--tolerance" in done.stderr and "Traceback" not in done.stderr


def test_metrics_want_a_token_and_reuse_their_counts(ob: Outbox, server: OutboxServer) -> None:
    ob.start_run("a", "1")
    url = f"{server.url}/metrics"
    assert httpx.get(url).status_code == 401
    assert (
        httpx.get(url, headers={"Authorization": "Bearer wrong-token-0000000"}).status_code == 401
    )
    auth = {"Authorization": f"Bearer {METRICS.decode()}"}
    counts = server.app.state.counts
    before = counts.loads
    for _ in range(5):
        answer = httpx.get(url, headers=auth)
        assert answer.status_code == 200 and "outbox_runs" in answer.text
    assert counts.loads - before <= 1  # five scrapes, one set of counting queries


def test_metrics_are_off_without_any_token(ob: Outbox) -> None:
    running = OutboxServer(ob, ServeSettings(port=0, console=False), Credentials()).start()
    try:
        assert httpx.get(f"{running.url}/metrics").status_code == 403
    finally:
        running.shutdown()


def test_health_does_not_leak_the_drivers_error(caplog: pytest.LogCaptureFixture) -> None:
    nowhere = Outbox(make_engine("postgresql+psycopg://secretuser:pw@127.0.0.1:9/db"))
    running = OutboxServer(nowhere, ServeSettings(port=0, console=False), Credentials()).start()
    try:
        answer = httpx.get(f"{running.url}/healthz")
    finally:
        running.shutdown()
        nowhere.close()
    assert answer.status_code == 503
    assert answer.json() == {"ok": False, "error": "database unavailable"}
    assert "Connection refused" not in answer.text
    assert "port 9 failed: Connection refused" in caplog.text  # the operator sees why, in the log


# -- the real `outbox serve`: memory and log under abuse ------------------------------


@pytest.fixture
def serve_process(sub_env: dict[str, str], tmp_path: Path) -> Iterator[tuple[int, int, Path]]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log_path = tmp_path / "serve.log"
    env = {**sub_env, "OUTBOX_WEBHOOK_SECRET": SECRET.decode()}
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "outbox", "serve", "--port", str(port), "--no-console"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(lambda: _answers(port), timeout=30, message="outbox serve to listen")
        yield port, proc.pid, log_path
    finally:
        proc.terminate()
        proc.wait(20)


def _answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
    except httpx.HTTPError:
        return False


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_300_mb_streamed_does_not_grow_the_server(
    ob: Outbox, serve_process: tuple[int, int, Path]
) -> None:
    port, pid, _ = serve_process
    run = ob.start_run("a", "1")
    before = _rss_bytes(pid)
    chunk = b"%x\r\n%s\r\n" % (1024 * 1024, b"x" * 1024 * 1024)
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            f"POST /runs/{run.id}/signals/x HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            "Transfer-Encoding: chunked\r\n\r\n".encode()
        )
        try:
            while sent < 300 * 1024 * 1024:
                sock.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            answer = sock.recv(4096)
        except ConnectionResetError:
            answer = b""
    grown = _rss_bytes(pid) - before
    assert grown < 20 * 1024 * 1024, f"the server grew by {grown / 1e6:.0f} MB"
    assert sent < 300 * 1024 * 1024 or answer.startswith(b"HTTP/1.1 413")
    assert _answers(port)


def test_client_disconnects_log_no_trace(ob: Outbox, serve_process: tuple[int, int, Path]) -> None:
    port, _, log_path = serve_process
    run = ob.start_run("a", "1")
    for _ in range(20):
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(
                f"POST /runs/{run.id}/signals/x HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                'Content-Length: 1000\r\n\r\n{"payload":'.encode()
            )
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    # 40 connections in a burst from one address pass the per-client limit (32) until
    # the server has seen them close, which on a loaded machine takes a moment
    wait_for(lambda: _answers(port), timeout=10, message="outbox serve to answer again")
    time.sleep(0.5)
    logged = log_path.read_text()
    assert "Traceback" not in logged and "Exception" not in logged, logged[-3000:]


def test_serve_cli_reports_bad_options_in_one_line(sub_env: dict[str, str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "outbox", "serve", "--no-console", "--header-timeout", "0"],
        env={**sub_env, "OUTBOX_WEBHOOK_SECRET": SECRET.decode()},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--header-timeout" in done.stderr
    short = subprocess.run(
        [sys.executable, "-m", "outbox", "serve", "--no-console"],
        env={**sub_env, "OUTBOX_WEBHOOK_SECRET": "short"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert short.returncode == 1 and "at least 16 bytes" in short.stderr
    assert "Traceback" not in short.stderr


@pytest.mark.parametrize(
    ("args", "env", "code", "said"),
    [
        (["--max-wait", "0"], {"OUTBOX_API_TOKEN": "api-token-0123456789"}, 2, "--max-wait"),
        ([], {}, 1, "OUTBOX_API_TOKEN"),
    ],
)
def test_serve_cli_refuses_bad_api_settings_in_one_line(
    sub_env: dict[str, str], args: list[str], env: dict[str, str], code: int, said: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "outbox", "serve", "--no-console", *args],
        env={**sub_env, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == code and said in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
