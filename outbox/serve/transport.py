"""The HTTP side of ``outbox serve``: uvicorn with every wait bounded, and a bounded body.

uvicorn bounds idle keep-alive connections. It does not bound how long a
client may take to send its headers, nor how many connections one client may
hold, and its own ``limit_concurrency`` counts every open connection, so a
hundred half-sent requests would make it answer 503 to everyone, its liveness
probe included. So:

- :class:`_GuardedH11` closes a connection whose request headers have not all
  arrived in time, closes a new connection at once when its client already
  holds ``max_connections_per_client``, and, past ``max_connections`` in all,
  closes the oldest connection that is waiting for a request;
- :class:`Gate` answers only the allowed host names (421 otherwise) and counts
  requests in progress, not connections: past ``max_concurrency`` it answers
  503, except ``/healthz``;
- :class:`BodyLimit` reads each request's body before anything else sees it,
  stops at the size limit whatever ``Content-Length`` says (or whether it is
  there at all), and gives up when the body takes too long.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Self

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from outbox.serve.hosts import HostAllowList
from outbox.serve.settings import ServeSettings

__all__ = ["BODY_KEY", "HOST_KEY", "BodyLimit", "Gate", "HttpServer"]

log = logging.getLogger("outbox.serve")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Where :class:`BodyLimit` leaves the body it read (``request.scope[BODY_KEY]``).
BODY_KEY = "outbox.body"
#: Where :class:`Gate` leaves the request's allowed (host name, port).
HOST_KEY = "outbox.host"
#: Answered whatever the load and the ``Host``: a liveness probe must not fail
#: because the server is busy, nor because it names the pod by its address.
HEALTH_PATH = "/healthz"
#: Seconds between two warnings about refused connections (an attack must not flood the log).
_WARN_EVERY = 10.0


class _Connections:
    """The open connections of one server: how many per client, which wait for a request."""

    def __init__(self, per_client: int, total: int) -> None:
        self.per_client = per_client
        self.total = total
        self.by_client: dict[str, int] = {}
        self.count = 0
        #: Connections waiting for a request's headers, oldest first (dicts keep order).
        self.waiting: dict[_GuardedH11, None] = {}
        self.refused = 0
        self._warned = float("-inf")

    def admit(self, conn: _GuardedH11, client: str) -> bool:
        """Count ``conn`` in, or say it must be closed (its client holds too many)."""
        if self.by_client.get(client, 0) >= self.per_client:
            self._refuse(f"a client holds {self.per_client} connections")
            return False
        if self.count >= self.total:
            oldest = next(iter(self.waiting), None)
            if oldest is None:
                self._refuse(f"{self.total} connections are open, all busy")
                return False
            # Room for the new one: the longest wait for a request loses its connection.
            self.waiting.pop(oldest, None)
            oldest.transport.close()
        self.by_client[client] = self.by_client.get(client, 0) + 1
        self.count += 1
        return True

    def release(self, client: str) -> None:
        left = self.by_client.get(client, 0) - 1
        if left > 0:
            self.by_client[client] = left
        else:
            self.by_client.pop(client, None)
        self.count -= 1

    def _refuse(self, why: str) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._warned >= _WARN_EVERY:
            self._warned = now
            log.warning("connections refused (%d so far): %s", self.refused, why)


class _GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's headers and connection caps."""

    header_timeout = 10.0
    connections_state: _Connections
    _header_timer: asyncio.TimerHandle | None = None
    _client_key: str | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        peer = transport.get_extra_info("peername")
        client = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        if not self.connections_state.admit(self, client):
            transport.close()
            return
        self._client_key = client
        self._arm()

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before:
            # A request's headers arrived: the body has its own deadline (BodyLimit).
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._client_key is not None:
            self.connections_state.release(self._client_key)
            self._client_key = None
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self.connections_state.waiting[self] = None
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm(self) -> None:
        self.connections_state.waiting.pop(self, None)
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        self.connections_state.waiting.pop(self, None)
        if not self.transport.is_closing():
            self.transport.close()


def _protocol(settings: ServeSettings) -> type[H11Protocol]:
    state = _Connections(settings.max_connections_per_client, settings.max_connections)
    return type(
        "GuardedH11",
        (_GuardedH11,),
        {"header_timeout": settings.header_timeout, "connections_state": state},
    )


class Gate:
    """ASGI middleware: only allowed host names, and at most ``max_concurrency`` requests at once.

    A request whose ``Host`` is not on the allow-list is answered 421 before its
    body is read (``/healthz`` answers any name). Past ``max_concurrency``
    requests in progress a request is answered 503 with ``Retry-After: 1``,
    except ``/healthz``. The allowed (name, port) is left in ``scope[HOST_KEY]``.
    """

    def __init__(self, app: ASGIApp, hosts: HostAllowList, max_concurrency: int) -> None:
        self.app = app
        self.hosts = hosts
        self.max_concurrency = max_concurrency
        self.in_progress = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Refuse a foreign host (421) or a request over the cap (503); else pass on."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = _nosniff(send)
        if scope.get("path") == HEALTH_PATH:
            await self.app(scope, receive, send)
            return
        host = self.hosts.check(_header(scope, b"host"))
        if host is None:
            # The name is not echoed: the answer must not help whoever chose it.
            await _refuse(send, 421, "this server does not answer to that host name", "misdirected")
            return
        scope[HOST_KEY] = host
        if self.in_progress >= self.max_concurrency:
            await _refuse(
                send,
                503,
                f"{self.max_concurrency} requests are in progress; try again",
                "busy",
                retry_after=1,
            )
            return
        self.in_progress += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_progress -= 1


def _nosniff(send: Send) -> Send:
    """``send`` that marks every answer ``X-Content-Type-Options: nosniff``.

    No answer of this server is to be read as another type than it says (a JSON
    error or a redacted value sniffed as HTML would run as a page).
    """

    async def marked(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", ()))
            if not any(name.lower() == b"x-content-type-options" for name, _ in headers):
                headers.append((b"x-content-type-options", b"nosniff"))
            message["headers"] = headers
        await send(message)

    return marked


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value).decode("latin-1")
    return None


class BodyLimit:
    """ASGI middleware: read the whole body first, at most ``max_bytes``, within ``timeout``.

    The body is left in ``scope[BODY_KEY]`` and replayed to the app, so a
    handler never reads the socket itself. A body over the limit is answered
    413 as soon as the limit is passed (the rest is never read, and the
    connection is closed); a body that takes longer than ``timeout`` is
    answered 408; a client that goes away is dropped without a trace.
    """

    def __init__(self, app: ASGIApp, *, max_bytes: int, timeout: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Read the body (bounded), then call the app with it replayed."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _refuse(send, 413, f"body over {self.max_bytes} bytes", "body_too_large")
            return
        chunks: list[bytes] = []
        size = 0
        deadline = time.monotonic() + self.timeout
        more = True
        while more:
            left = deadline - time.monotonic()
            try:
                message = await asyncio.wait_for(receive(), timeout=max(left, 0.001))
            except TimeoutError:
                await _refuse(
                    send, 408, f"body not received within {self.timeout:g}s", "body_timeout"
                )
                return
            if message["type"] == "http.disconnect":
                return  # the client went away: nothing to answer, nothing to log
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await _refuse(send, 413, f"body over {self.max_bytes} bytes", "body_too_large")
                return
            chunks.append(chunk)
            more = bool(message.get("more_body", False))
        body = b"".join(chunks)
        scope[BODY_KEY] = body
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            # After the body, a receive waits for the disconnect like uvicorn's would.
            return await receive()

        try:
            await self.app(scope, replay, send)
        except Exception as exc:
            # Starlette answered 500 already; one line here, the trace only at DEBUG.
            log.error(
                "%s %s failed: %s: %s",
                scope.get("method"),
                scope.get("path"),
                type(exc).__name__,
                exc,
            )
            log.debug("trace", exc_info=True)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses it before us; never trust it anyway
    return None


async def _refuse(
    send: Send, status: int, error: str, code: str, *, retry_after: int | None = None
) -> None:
    # ``code`` is the HTTP API's error code (docs/http-api.md); other routes ignore it.
    body = json.dumps({"error": error, "code": code}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    with contextlib.suppress(OSError, RuntimeError):
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class _Server(uvicorn.Server):
    """uvicorn's server, calling ``on_stop`` hooks (on its loop) as soon as it begins to stop."""

    def __init__(self, config: uvicorn.Config, on_stop: list[Callable[[], None]]) -> None:
        super().__init__(config)
        self.on_stop = on_stop

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        # Before uvicorn waits for requests in progress: a long poll answers now
        # rather than holding the stop for the whole grace period and being cut.
        for hook in self.on_stop:
            try:
                hook()
            except Exception:
                log.exception("a shutdown hook failed")
        await super().shutdown(sockets)


class HttpServer:
    """One uvicorn server for ``app``, in the foreground or on a thread.

    :meth:`serve_forever` blocks until :meth:`shutdown` (or SIGTERM/SIGINT when
    it runs on the main thread); :meth:`start` runs it on a daemon thread and
    returns once the socket is bound. ``on_stop`` functions are called on the
    server's event loop when it begins to stop.
    """

    def __init__(
        self,
        app: ASGIApp,
        settings: ServeSettings,
        on_stop: list[Callable[[], None]] | None = None,
    ) -> None:
        self.settings = settings
        self.hosts = HostAllowList(settings.allowed_hosts, settings.host)
        bounded = BodyLimit(app, max_bytes=settings.max_body_bytes, timeout=settings.body_timeout)
        config = uvicorn.Config(
            Gate(bounded, self.hosts, settings.max_concurrency),
            host=settings.host,
            port=settings.port,
            http=_protocol(settings),
            ws="none",
            lifespan="off",
            timeout_keep_alive=max(1, round(settings.idle_timeout)),
            # Requests in progress are counted by Gate: uvicorn's own limit counts
            # connections, so half-sent requests would shut everyone out.
            limit_concurrency=None,
            timeout_graceful_shutdown=5,
            access_log=False,
            log_config=None,
            server_header=False,
        )
        self._server = _Server(config, list(on_stop or ()))
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The port actually bound (useful with port 0)."""
        for server in self._server.servers:
            for sock in server.sockets:
                return int(sock.getsockname()[1])
        return self.settings.port

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:8080``."""
        return f"http://{self.settings.host}:{self.port}"

    def serve_forever(self) -> None:
        """Serve until :meth:`shutdown` (or a signal, on the main thread)."""
        self._server.run()

    def start(self, timeout: float = 10.0) -> Self:
        """Serve from a daemon thread; return once listening."""
        self._thread = threading.Thread(target=self.serve_forever, daemon=True, name="serve")
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def shutdown(self) -> None:
        """Stop accepting, finish requests in progress (5 s at most), close."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
