"""Issue 27, items 4 and 12: `outbox serve` answers only its own names and outlasts slow headers.

DNS rebinding: a web page on ``rebind.example`` whose name is made to resolve to
127.0.0.1 talks to the console with ``Host: rebind.example``. The server must
refuse any name it was not told is its own, and the console's CSRF check must not
take "own origin" from that header. Slow headers: a hundred connections that
never finish their headers, from one client, must not take the server from
everyone else, its liveness probe included.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from outbox import Outbox
from outbox.serve.app import OutboxServer
from outbox.serve.settings import Credentials, ServeSettings
from tests.api_client import TOKEN
from tests.support import wait_for

OPERATOR = "operator-token-0123456789"
CREDENTIALS = Credentials(operator_token=OPERATOR.encode(), api_token=TOKEN.encode())


@pytest.fixture
def server(ob: Outbox) -> Iterator[OutboxServer]:
    running = OutboxServer(ob, ServeSettings(port=0, counts_cache_seconds=0), CREDENTIALS).start()
    yield running
    running.shutdown()


def get(server: OutboxServer, path: str, host: str, **headers: str) -> httpx.Response:
    return httpx.get(server.url + path, headers={"Host": host, **headers})


# -- item 4: the Host allow-list ----------------------------------------------------------


@pytest.mark.parametrize(
    "path", ["/console/", "/console/runs", "/console/login", "/api/v1/effects", "/metrics"]
)
def test_a_foreign_host_name_is_refused(server: OutboxServer, path: str) -> None:
    port = server.port
    answer = get(server, path, f"rebind.example:{port}", Authorization=f"Bearer {TOKEN}")
    assert answer.status_code == 421, (path, answer.status_code, answer.text[:200])
    assert "rebind.example" not in answer.text  # nothing echoed back


def test_a_missing_or_malformed_host_is_refused(server: OutboxServer) -> None:
    for host in ("", "127.0.0.1:notaport", "127.0.0.1\\@x", "[::1"):
        answer = get(server, "/console/", host)
        assert answer.status_code in (400, 421), (host, answer.status_code)


def test_the_bound_address_and_localhost_are_answered(server: OutboxServer) -> None:
    port = server.port
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST", "localhost."):
        answer = get(server, "/console/runs", host)
        assert answer.status_code == 200, (host, answer.status_code)
    api = get(server, "/api/v1/effects", f"localhost:{port}", Authorization=f"Bearer {TOKEN}")
    assert api.status_code == 200


def test_healthz_answers_any_host_for_probes(server: OutboxServer) -> None:
    # A liveness probe names the pod's address; /healthz reads nothing worth stealing.
    answer = get(server, "/healthz", "10.1.2.3:8080")
    assert answer.status_code == 200 and answer.json() == {"ok": True}


def test_allowed_hosts_are_configurable(ob: Outbox) -> None:
    settings = ServeSettings(port=0, allowed_hosts=["console.example.com", ".internal.example"])
    running = OutboxServer(ob, settings, CREDENTIALS).start()
    try:
        assert get(running, "/console/", "console.example.com").status_code == 200
        assert get(running, "/console/", "ops.internal.example:443").status_code == 200
        assert get(running, "/console/", "internal.example").status_code == 200
        assert get(running, "/console/", "evil-internal.example").status_code == 421
        # Only the names given: the defaults are replaced, not added to.
        assert get(running, "/console/", "localhost").status_code == 421
    finally:
        running.shutdown()


def test_allowed_hosts_refuse_nonsense() -> None:
    for bad in (["*"], ["a b"], ["http://x.example"], [""]):
        with pytest.raises(ValueError, match="allowed_hosts"):
            ServeSettings(allowed_hosts=bad)


def test_a_form_from_a_rebound_name_is_refused_even_with_a_matching_origin(
    server: OutboxServer,
) -> None:
    """The CSRF check used to take "own origin" from the Host header the page chose."""
    port = server.port
    with httpx.Client(base_url=server.url) as browser:
        login = browser.get("/console/login")
        csrf = login.text.split('name="csrf" value="', 1)[1].split('"', 1)[0]
        rebound = f"rebind.example:{port}"
        answer = browser.post(
            "/console/login",
            headers={"Host": rebound, "Origin": f"http://{rebound}"},
            data={"csrf": csrf, "name": "mallory", "token": OPERATOR, "next": "/console/"},
        )
        assert answer.status_code == 421
        assert "outbox_session" not in answer.headers.get("set-cookie", "")


def test_csrf_own_origin_comes_from_the_allow_list_not_the_host_header(
    server: OutboxServer,
) -> None:
    port = server.port
    with httpx.Client(base_url=server.url) as browser:
        login = browser.get("/console/login")
        csrf = login.text.split('name="csrf" value="', 1)[1].split('"', 1)[0]
        form = {"csrf": csrf, "name": "alice", "token": OPERATOR, "next": "/console/"}
        # Another allowed name of this server (localhost) is its own origin too ...
        ok = browser.post(
            "/console/login",
            headers={"Host": f"127.0.0.1:{port}", "Origin": f"http://localhost:{port}"},
            data=form,
        )
        assert ok.status_code == 303, ok.text
        # ... but a page on another port of the same name is another origin.
        other = browser.post(
            "/console/login",
            headers={"Host": f"127.0.0.1:{port}", "Origin": f"http://127.0.0.1:{port + 1}"},
            data=form,
        )
        assert other.status_code == 403 and "cross-origin" in other.text
        for origin in ("null", "http://rebind.example", f"https://127.0.0.1:{port}"):
            refused = browser.post(
                "/console/login",
                headers={"Host": f"127.0.0.1:{port}", "Origin": origin},
                data=form,
            )
            assert refused.status_code == 403, origin


# -- item 12: slow headers from one client do not take the server -----------------------


def _half_open(port: int, source: str, count: int) -> list[socket.socket]:
    """``count`` connections from ``source`` that send half a request line and stop."""
    held = []
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((source, 0))
        sock.settimeout(5)
        try:
            sock.connect(("127.0.0.1", port))
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        except OSError:
            sock.close()
            continue
        held.append(sock)
    return held


def test_a_hundred_slow_header_connections_leave_others_and_healthz_answering(
    ob: Outbox,
) -> None:
    # The defaults of `outbox serve` (100 at once, 10 s for the headers): the
    # attacker comes from 127.0.0.2, the probe and the operator from 127.0.0.1.
    running = OutboxServer(ob, ServeSettings(port=0), CREDENTIALS).start()
    held: list[socket.socket] = []
    try:
        held = _half_open(running.port, "127.0.0.2", 120)
        time.sleep(0.3)
        health = httpx.get(f"{running.url}/healthz")
        assert health.status_code == 200, health.text
        page = httpx.get(f"{running.url}/console/runs")
        assert page.status_code == 200
        api = httpx.get(
            f"{running.url}/api/v1/effects", headers={"Authorization": f"Bearer {TOKEN}"}
        )
        assert api.status_code == 200
        # The client over its cap lost the extra connections at once.
        open_ones = sum(not _closed(sock) for sock in held)
        assert open_ones <= running.settings.max_connections_per_client
    finally:
        for sock in held:
            sock.close()
        running.shutdown()


def test_requests_in_progress_over_the_cap_are_503_but_healthz_answers(ob: Outbox) -> None:
    running = OutboxServer(ob, ServeSettings(port=0, max_concurrency=3), CREDENTIALS).start()
    busy: list[socket.socket] = []
    try:
        # Three requests in progress: their headers came, their bodies never do.
        for _ in range(3):
            sock = socket.create_connection(("127.0.0.1", running.port))
            sock.sendall(
                b"POST /api/v1/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{"
            )
            busy.append(sock)
        wait_for(
            lambda: httpx.get(f"{running.url}/console/versions").status_code == 503,
            timeout=5,
            message="the requests in progress to fill the cap",
        )
        assert httpx.get(f"{running.url}/healthz").status_code == 200
    finally:
        for sock in busy:
            sock.close()
        running.shutdown()


def _closed(sock: socket.socket) -> bool:
    sock.settimeout(0.05)
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
