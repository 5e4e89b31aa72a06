"""``outbox serve``: signals over HTTP (signed), health and metrics.

``POST /runs/{run_id}/signals/{name}`` with a JSON body ``{"payload": ...,
"dedup_key": "..."}``, signed like Stripe's webhooks: the header
``X-Outbox-Timestamp`` carries unix seconds and ``X-Outbox-Signature`` carries
``sha256=<hex HMAC-SHA256 of "<timestamp>.<path>.<body>" under the deployment's
secret>`` (the path is signed too, so a body signed for one run cannot be
pointed at another).
Anything unsigned, signed wrongly, older than the tolerance, or a signature
already seen (stored in PostgreSQL, so every server process shares it) is
refused before it touches the run.

``POST /effects/{effect_id}/approval`` decides an effect held by an approval
gate, signed the same way (:mod:`outbox.serve.approvals`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from outbox.errors import NotFound, OutboxError, ReplayRefused, RunTerminal, ValidationError

if TYPE_CHECKING:
    from collections.abc import Iterator

    from outbox.client import Outbox

__all__ = ["SignalServer", "sign", "verify"]

log = logging.getLogger(__name__)

TIMESTAMP_HEADER = "X-Outbox-Timestamp"
SIGNATURE_HEADER = "X-Outbox-Signature"
_ROUTE = re.compile(r"^/runs/([0-9a-fA-F-]{36})/signals/([A-Za-z0-9_.:-]{1,200})$")
MAX_BODY = 1024 * 1024


def sign(secret: bytes, timestamp: int, path: str, body: bytes) -> str:
    """The signature header value for ``body`` posted to ``path`` at ``timestamp``."""
    message = f"{timestamp}.{path}.".encode() + body
    return "sha256=" + hmac.new(secret, message, hashlib.sha256).hexdigest()


def verify(
    secret: bytes,
    timestamp: str | None,
    signature: str | None,
    path: str,
    body: bytes,
    *,
    tolerance: float,
    now: float | None = None,
) -> str | None:
    """None when the request is authentic and fresh, else why it is refused."""
    if not timestamp or not signature:
        return "unsigned: both X-Outbox-Timestamp and X-Outbox-Signature are required"
    if not timestamp.isdigit():
        return "bad timestamp"
    age = (time.time() if now is None else now) - int(timestamp)
    if abs(age) > tolerance:
        return f"stale: timestamp is {age:.0f}s away from now (tolerance {tolerance:.0f}s)"
    expected = sign(secret, int(timestamp), path, body)
    if not hmac.compare_digest(expected, signature):
        return "bad signature"
    return None


class _StateCollector:
    """Runs and unfinished effects by status, read at scrape time."""

    def __init__(self, outbox: Outbox) -> None:
        self._outbox = outbox

    def collect(self) -> Iterator[GaugeMetricFamily]:
        counts = self._outbox.store.state_counts()
        gauge = GaugeMetricFamily("outbox_runs", "Runs by status", labels=["status"])
        for status, n in counts.runs.items():
            gauge.add_metric([status], n)
        yield gauge
        gauge = GaugeMetricFamily(
            "outbox_effects", "Unfinished effects by state and kind", labels=["state", "kind"]
        )
        for (status, kind), n in counts.effects.items():
            gauge.add_metric([status, kind], n)
        yield gauge


class SignalServer:
    """A threaded HTTP server; ``serve_forever`` until ``shutdown``."""

    def __init__(
        self,
        outbox: Outbox,
        secret: bytes,
        *,
        host: str = "127.0.0.1",
        port: int = 8080,
        tolerance: float = 300.0,
    ) -> None:
        if len(secret) < 16:
            raise ValidationError("secret", "<hidden>", "must be at least 16 bytes")
        self.outbox = outbox
        self.secret = secret
        self.tolerance = tolerance
        self.registry = CollectorRegistry()
        self.registry.register(_StateCollector(outbox))
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                log.info("%s %s", self.address_string(), format % args)

            def do_GET(self) -> None:
                server._get(self)

            def do_POST(self) -> None:
                server._post(self)

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self._last_cleanup = 0.0
        self._cleanup_lock = threading.Lock()

    @property
    def port(self) -> int:
        """The port actually bound (useful with port 0)."""
        return int(self.httpd.server_address[1])

    def serve_forever(self) -> None:
        """Serve until :meth:`shutdown`."""
        self.httpd.serve_forever(poll_interval=0.2)

    def shutdown(self) -> None:
        """Stop serving and close the socket."""
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- handlers ---------------------------------------------------------------

    def _reply(
        self,
        handler: BaseHTTPRequestHandler,
        status: int,
        body: Any,
        content_type: str = "application/json",
    ) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", content_type)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def _get(self, handler: BaseHTTPRequestHandler) -> None:
        if handler.path == "/healthz":
            try:
                self.outbox.store.ping()
            except Exception as exc:
                self._reply(handler, 503, {"ok": False, "error": str(exc)[:200]})
                return
            self._reply(handler, 200, {"ok": True})
        elif handler.path == "/metrics":
            self._reply(handler, 200, generate_latest(self.registry), "text/plain; version=0.0.4")
        else:
            self._reply(handler, 404, {"error": "not found"})

    def _post(self, handler: BaseHTTPRequestHandler) -> None:
        from outbox.serve.approvals import APPROVAL_ROUTE, handle_approval

        approval = APPROVAL_ROUTE.match(handler.path) is not None
        match = _ROUTE.match(handler.path)
        if match is None and not approval:
            self._reply(
                handler,
                404,
                {"error": "POST /runs/{run_id}/signals/{name} or /effects/{effect_id}/approval"},
            )
            return
        length = int(handler.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            self._reply(handler, 413, {"error": f"body over {MAX_BODY} bytes"})
            return
        body = handler.rfile.read(length)
        if approval:
            self._forget_old()
            status, answer = handle_approval(
                self.outbox,
                self.secret,
                path=handler.path,
                header=handler.headers.get,
                body=body,
                tolerance=self.tolerance,
            )
            self._reply(handler, status, answer)
            return
        assert match is not None
        signature = handler.headers.get(SIGNATURE_HEADER)
        refusal = verify(
            self.secret,
            handler.headers.get(TIMESTAMP_HEADER),
            signature,
            handler.path,
            body,
            tolerance=self.tolerance,
        )
        if refusal is not None:
            self._reply(handler, 401, {"error": refusal})
            return
        assert signature is not None
        self._forget_old()
        try:
            message = json.loads(body or b"{}")
            if not isinstance(message, dict):
                raise ValueError("the body must be a JSON object")
            receipt = self.outbox.signal(
                match[1],
                match[2],
                message.get("payload"),
                dedup_key=message.get("dedup_key"),
                # Marked used in the signal's own transaction: a request refused
                # (unknown run, a failure) can be sent again.
                request_id=hashlib.sha256(signature.encode()).hexdigest(),
            )
        except ReplayRefused:
            self._reply(handler, 409, {"error": "replayed: this signature was already accepted"})
            return
        except (ValueError, ValidationError) as exc:
            self._reply(handler, 400, {"error": str(exc)})
            return
        except NotFound as exc:
            self._reply(handler, 404, {"error": str(exc)})
            return
        except RunTerminal as exc:
            self._reply(handler, 409, {"error": str(exc)})
            return
        except OutboxError as exc:
            self._reply(handler, 500, {"error": str(exc)})
            return
        self._reply(
            handler,
            202,
            {
                "signal_id": None if receipt.signal_id is None else str(receipt.signal_id),
                "duplicate": receipt.duplicate,
                "woke_run": receipt.woke_run,
            },
        )

    def _forget_old(self) -> None:
        # Signatures older than the tolerance can no longer pass the freshness check.
        with self._cleanup_lock:
            if time.monotonic() - self._last_cleanup < 60:
                return
            self._last_cleanup = time.monotonic()
        with self.outbox.store.run_tx() as tx:
            tx.forget_replays(self.tolerance * 2)
