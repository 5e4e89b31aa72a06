"""Test doubles an agent author can reuse: a recording deliverer and a real HTTP sink.

``RecordingDeliverer`` stands in for a sink in unit tests of an agent.
``IdempotentHttpSink`` is a real HTTP server (a thread on loopback) that
honours ``Idempotency-Key`` the way Stripe does (the first result for a key is
stored and replayed; a key reused with a different body is refused with 422),
counts what it receives, answers lookups, and can be told to misbehave (429
with ``Retry-After``, 500 before or after applying, hang, be down, answer with
a binary or UTF-16 error page, trickle its answer a byte at a time).
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self

from deliverers.tansu import TANSU_CONSUMER_TUNING, TansuBroker
from outbox.delivery import Deliverer, DelivererConfig, Delivery, Outcome, Succeeded

__all__ = [
    "TANSU_CONSUMER_TUNING",
    "Fault",
    "IdempotentHttpSink",
    "RecordingDeliverer",
    "TansuBroker",
]


class _QuietServer(ThreadingHTTPServer):
    """A client that hangs up mid-answer (a deliverer killed or out of time) is not an error."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


class RecordingDeliverer(Deliverer):
    """Records every delivery; answers with ``outcome(delivery)`` (default: succeeded)."""

    def __init__(
        self,
        kind: str = "test.record",
        *,
        idempotent: bool = True,
        outcome: Callable[[Delivery], Outcome] | None = None,
        config: DelivererConfig | None = None,
    ) -> None:
        super().__init__(kind, config or DelivererConfig(idempotent=idempotent))
        self.deliveries: list[Delivery] = []
        self._outcome = outcome
        self._lock = threading.Lock()

    def deliver(self, delivery: Delivery) -> Outcome:
        """Record, then answer."""
        with self._lock:
            self.deliveries.append(delivery)
        if self._outcome is not None:
            return self._outcome(delivery)
        return Succeeded({"recorded": len(self.deliveries)})

    @property
    def keys(self) -> list[str]:
        """Idempotency keys in delivery order (duplicates included)."""
        return [d.idempotency_key for d in self.deliveries]


@dataclass
class Fault:
    """How the sink misbehaves for the next ``times`` requests (``None``: until cleared)."""

    #: "429" | "500_before" | "500_after" | "hang" | "down" | "bad_body" | "trickle" | "redirect"
    #: | "drop" (read, never apply, hold the connection ``hang_seconds``)
    #: | "hang_after_apply" (apply, then hold it)
    mode: str
    times: int | None = None
    retry_after: str = "1"
    hang_seconds: float = 30.0
    #: "bad_body": answer this status with ``body`` (default: a UTF-16 error page,
    #: full of NUL bytes, as some servers send) without applying the effect.
    status: int = 400
    body: bytes = "<h1>Bad request</h1>".encode("utf-16")
    #: "trickle": answer 200 (after applying; to a GET, at once), one byte of
    #: ``body`` every ``interval``.
    interval: float = 0.5
    #: "redirect": answer ``status`` (a 3xx) pointing at ``location``, without applying.
    location: str = ""


@dataclass
class _State:
    applied: dict[str, dict[str, Any]] = field(default_factory=dict)
    body_hash: dict[str, str] = field(default_factory=dict)
    received: Counter[str] = field(default_factory=Counter)
    applied_count: Counter[str] = field(default_factory=Counter)
    operations: Counter[str] = field(default_factory=Counter)
    #: The ``operation`` of each key applied with one.
    operation_of: dict[str, str] = field(default_factory=dict)
    requests: int = 0
    #: GET requests (lookups, stats, big bodies); ``requests`` counts the others.
    gets: int = 0
    faults: list[Fault] = field(default_factory=list)
    #: Bytes of ``/big/`` bodies actually written (a reader that stops early gets fewer).
    big_bytes_sent: int = 0
    #: Credential-like headers (Authorization, X-Api-Key) of every request received.
    credentials_seen: list[dict[str, str]] = field(default_factory=list)


class IdempotentHttpSink:
    """A real HTTP server that dedups on ``Idempotency-Key``. Use as a context manager.

    ``applied_count[key]`` counts how often a key took effect (at most 1 by
    construction); ``operations[op]`` counts applied effects by the body's
    ``operation`` field, which catches a duplicate *intent* (two keys for one
    business operation). ``log_path`` appends every request as a JSON line.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        log_path: Path | None = None,
        honour_keys: bool = True,
        latency: float = 0.0,
    ) -> None:
        self.state = _State()
        #: Seconds every request takes (so calls are in flight long enough to be killed).
        self.latency = latency
        self.in_progress = 0
        self._lock = threading.Lock()
        self._log_path = log_path
        self.honour_keys = honour_keys
        sink = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                return

            def do_GET(self) -> None:
                sink._get(self)

            def do_POST(self) -> None:
                sink._post(self)

            do_PUT = do_POST
            do_PATCH = do_POST

        self._server = _QuietServer((host, port), Handler)
        self._server.daemon_threads = True
        # socketserver's accept queue holds 5: a burst of deliverer connections on a
        # busy machine would wait past their timeout. A real server queues more.
        self._server.socket.listen(128)
        self._thread: threading.Thread | None = None

    # -- lifecycle --------------------------------------------------------------

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:41234``."""
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> Self:
        """Serve from a daemon thread."""
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- control ----------------------------------------------------------------

    def inject(self, fault: Fault) -> None:
        """Misbehave as ``fault`` says (faults apply in order)."""
        with self._lock:
            self.state.faults.append(fault)

    def clear_faults(self) -> None:
        """Behave again."""
        with self._lock:
            self.state.faults.clear()

    @contextmanager
    def faulty(self, fault: Fault) -> Iterator[None]:
        """Misbehave inside the block."""
        self.inject(fault)
        try:
            yield
        finally:
            self.clear_faults()

    def stats(self, keys: Collection[str] | None = None) -> dict[str, Any]:
        """Counts: requests, keys received/applied, keys applied more than once, operations.

        With ``keys``, the key and operation counts cover only those idempotency
        keys (one user's effects on a sink others may post to); ``requests`` still
        counts every request.
        """
        with self._lock:
            s = self.state
            received, applied_count, operations = s.received, s.applied_count, s.operations
            if keys is not None:
                wanted = set(keys)
                received = Counter({k: n for k, n in received.items() if k in wanted})
                applied_count = Counter({k: n for k, n in applied_count.items() if k in wanted})
                operations = Counter()
                for key, times in applied_count.items():
                    if key in s.operation_of:
                        operations[s.operation_of[key]] += times
            return {
                "requests": s.requests,
                "keys_received": len(received),
                "keys_applied": len(applied_count),
                "redeliveries": sum(received.values()) - len(received),
                "duplicate_keys_applied": sorted(k for k, n in applied_count.items() if n > 1),
                "duplicate_operations": sorted(o for o, n in operations.items() if n > 1),
                "operations_applied": sum(operations.values()),
            }

    # -- serving ----------------------------------------------------------------

    def _next_fault(self) -> Fault | None:
        with self._lock:
            while self.state.faults:
                fault = self.state.faults[0]
                if fault.times is not None:
                    if fault.times <= 0:
                        self.state.faults.pop(0)
                        continue
                    fault.times -= 1
                return fault
        return None

    def _reply(
        self,
        handler: BaseHTTPRequestHandler,
        status: int,
        body: Any,
        headers: dict[str, str] | None = None,
    ) -> None:
        data = json.dumps(body).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            handler.send_header(name, value)
        handler.end_headers()
        handler.wfile.write(data)

    def _get(self, handler: BaseHTTPRequestHandler) -> None:
        with self._lock:
            self.state.gets += 1
        self._note_credentials(handler)
        fault = self._next_fault()
        if fault is not None and fault.mode == "trickle":
            self._trickle(handler, fault)
            return
        if fault is not None and fault.mode == "redirect":
            self._redirect(handler, fault)
            return
        if handler.path.startswith("/idempotency/"):
            key = handler.path.removeprefix("/idempotency/")
            with self._lock:
                stored = self.state.applied.get(key)
            if stored is None:
                self._reply(handler, 404, {"applied": False})
            else:
                self._reply(handler, 200, {"applied": True, "response": stored})
        elif handler.path == "/stats":
            self._reply(handler, 200, self.stats())
        elif handler.path.startswith("/big/"):
            size = int(handler.path.removeprefix("/big/"))
            handler.send_response(200)
            handler.send_header("Content-Length", str(size))
            handler.end_headers()
            chunk = b"x" * 65536
            sent = 0
            try:
                while sent < size:
                    handler.wfile.write(chunk[: size - sent])
                    sent += min(len(chunk), size - sent)
                    with self._lock:
                        self.state.big_bytes_sent += min(len(chunk), size - sent)
            except OSError:
                pass
        else:
            self._reply(handler, 404, {"error": "not found"})

    def _post(self, handler: BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        raw = handler.rfile.read(length) if length else b""
        if len(raw) < length:
            # The sender died mid-body: nothing arrived that could be applied.
            handler.close_connection = True
            return
        key = handler.headers.get("Idempotency-Key")
        self._note_credentials(handler)
        with self._lock:
            self.state.requests += 1
            if key:
                self.state.received[key] += 1
        self._log(
            {
                "t": time.time(),
                "path": handler.path,
                "key": key,
                "effect_id": handler.headers.get("X-Outbox-Effect-Id"),
                "attempt": handler.headers.get("X-Outbox-Attempt"),
                "traceparent": handler.headers.get("traceparent"),
                "body": raw.decode(),
            }
        )
        # Decided as the request arrives, not after the latency: a fault injected
        # while older requests sleep (those of a deliverer just killed, say) is
        # answered to the requests that come after it.
        fault = self._next_fault()
        with self._lock:
            self.in_progress += 1
        try:
            if self.latency:
                time.sleep(self.latency)
            self._answer(handler, key, raw, fault)
        finally:
            with self._lock:
                self.in_progress -= 1

    def _answer(
        self, handler: BaseHTTPRequestHandler, key: str | None, raw: bytes, fault: Fault | None
    ) -> None:
        if fault is not None:
            if fault.mode == "429":
                self._reply(
                    handler, 429, {"error": "slow down"}, {"Retry-After": fault.retry_after}
                )
                return
            if fault.mode == "500_before":
                self._reply(handler, 500, {"error": "failed before applying"})
                return
            if fault.mode == "redirect":
                self._redirect(handler, fault)
                return
            if fault.mode == "bad_body":
                handler.send_response(fault.status)
                handler.send_header("Content-Type", "text/html; charset=utf-16")
                handler.send_header("Content-Length", str(len(fault.body)))
                handler.end_headers()
                handler.wfile.write(fault.body)
                return
            if fault.mode == "hang":
                time.sleep(fault.hang_seconds)
            if fault.mode == "down":
                handler.close_connection = True
                handler.connection.close()
                return
            if fault.mode == "drop":
                time.sleep(fault.hang_seconds)
                handler.close_connection = True
                return
        status, response = self._apply(key, raw, handler.path)
        if fault is not None and fault.mode == "hang_after_apply":
            time.sleep(fault.hang_seconds)
        if fault is not None and fault.mode == "500_after":
            self._reply(handler, 500, {"error": "applied, then failed to answer"})
            return
        if fault is not None and fault.mode == "trickle":
            self._trickle(handler, fault)
            return
        self._reply(handler, status, response)

    def _note_credentials(self, handler: BaseHTTPRequestHandler) -> None:
        seen = {
            name: value
            for name, value in handler.headers.items()
            if name.lower() in ("authorization", "x-api-key")
        }
        with self._lock:
            self.state.credentials_seen.append(seen)

    def _redirect(self, handler: BaseHTTPRequestHandler, fault: Fault) -> None:
        handler.send_response(fault.status)
        handler.send_header("Location", fault.location)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    def _trickle(self, handler: BaseHTTPRequestHandler, fault: Fault) -> None:
        """Send the headers, then the body one byte per ``fault.interval`` (a slow-loris sink)."""
        body = fault.body
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.flush()
        try:
            for i in range(len(body)):
                handler.wfile.write(body[i : i + 1])
                handler.wfile.flush()
                time.sleep(fault.interval)
        except OSError:  # the client gave up: what a deadline is for
            handler.close_connection = True

    def _apply(self, key: str | None, raw: bytes, path: str) -> tuple[int, Any]:
        digest = hashlib.sha256(raw).hexdigest()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        operation = body.get("operation") if isinstance(body, dict) else None
        with self._lock:
            if key and self.honour_keys and key in self.state.applied:
                if self.state.body_hash[key] != digest:
                    return 422, {"error": "idempotency key reused with a different body"}
                return 200, self.state.applied[key]  # replay the first result
            response = {
                "applied": True,
                "path": path,
                "key": key,
                "seq": sum(self.state.applied_count.values()) + 1,
            }
            if key:
                self.state.applied[key] = response
                self.state.body_hash[key] = digest
                self.state.applied_count[key] += 1
            if operation is not None:
                self.state.operations[str(operation)] += 1
                if key:
                    self.state.operation_of[key] = str(operation)
        return 200, response

    def _log(self, entry: dict[str, Any]) -> None:
        if self._log_path is None:
            return
        with self._lock, self._log_path.open("a") as handle:
            handle.write(json.dumps(entry) + "\n")
