"""Signed signals: ``POST /runs/{run_id}/signals/{name}``.

The JSON body is ``{"payload": ..., "dedup_key": "..."}``, signed like Stripe's
webhooks: the header ``X-Outbox-Timestamp`` carries unix seconds and
``X-Outbox-Signature`` carries ``sha256=<hex HMAC-SHA256 of
"<timestamp>.<path>.<body>" under the deployment's secret>`` (the path is signed
too, so a body signed for one run cannot be pointed at another).
Anything unsigned, signed wrongly, older than the tolerance, or a signature
already seen (stored in PostgreSQL, so every server process shares it) is
refused before it touches the run. The signature is marked used in the same
transaction that stores the signal, so a request refused for another reason
(an unknown run, a failure) can be sent again.

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
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse

from outbox.errors import NotFound, OutboxError, ReplayRefused, RunTerminal, ValidationError
from outbox.serve.transport import BODY_KEY

if TYPE_CHECKING:
    from outbox.client import Outbox

__all__ = ["SIGNATURE_HEADER", "TIMESTAMP_HEADER", "SignalEndpoint", "sign", "verify"]

log = logging.getLogger("outbox.serve")

TIMESTAMP_HEADER = "X-Outbox-Timestamp"
SIGNATURE_HEADER = "X-Outbox-Signature"
#: Route of signed signals (Starlette path syntax).
SIGNAL_ROUTE = "/runs/{run_id}/signals/{name}"
_RUN_ID = re.compile(r"^[0-9a-fA-F-]{36}$")
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,200}$")
_TIMESTAMP = re.compile(r"^[0-9]{1,12}$")
_SIGNATURE = re.compile(r"^sha256=[0-9a-f]{64}$")
#: JSON nested deeper than this is refused before it is parsed.
MAX_DEPTH = 64


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
    """None when the request is authentic and fresh, else why it is refused.

    Header values are checked for shape before use, so any text a client
    sends yields a refusal, never an exception.
    """
    if not timestamp or not signature:
        return "unsigned: both X-Outbox-Timestamp and X-Outbox-Signature are required"
    if not _TIMESTAMP.match(timestamp):
        return "bad timestamp: expected unix seconds"
    age = (time.time() if now is None else now) - int(timestamp)
    if abs(age) > tolerance:
        return f"stale: timestamp is {age:.0f}s away from now (tolerance {tolerance:.0f}s)"
    if not _SIGNATURE.match(signature):
        return "bad signature: expected sha256=<64 hex digits>"
    expected = sign(secret, int(timestamp), path, body)
    if not hmac.compare_digest(expected.encode(), signature.encode()):
        return "bad signature"
    return None


def too_deep(body: bytes, limit: int = MAX_DEPTH) -> bool:
    """True when the JSON text nests arrays/objects deeper than ``limit`` (outside strings)."""
    depth = 0
    in_string = escaped = False
    for byte in body:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            if depth > limit:
                return True
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return False


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


class SignalEndpoint:
    """The Starlette endpoint for signed signals of one Outbox."""

    def __init__(self, outbox: Outbox, secret: bytes | None, tolerance: float) -> None:
        self.outbox = outbox
        self.secret = secret
        self.tolerance = tolerance
        self._last_cleanup = 0.0
        self._cleanup_lock = threading.Lock()

    async def handle(self, request: Request) -> JSONResponse:
        """Verify, then store the signal; 202 with the receipt."""
        run_id = request.path_params["run_id"]
        name = request.path_params["name"]
        if not _RUN_ID.match(run_id) or not _NAME.match(name):
            return _error(404, "POST /runs/{run_id}/signals/{name}")
        if self.secret is None:
            return _error(503, "signals are off: OUTBOX_WEBHOOK_SECRET is not set")
        body: bytes = request.scope.get(BODY_KEY, b"")
        signature = request.headers.get(SIGNATURE_HEADER)
        refusal = verify(
            self.secret,
            request.headers.get(TIMESTAMP_HEADER),
            signature,
            request.scope.get("raw_path", b"").decode("latin-1") or request.url.path,
            body,
            tolerance=self.tolerance,
        )
        if refusal is not None:
            return _error(401, refusal)
        assert signature is not None
        if too_deep(body):
            return _error(400, f"JSON nested deeper than {MAX_DEPTH} levels")
        try:
            message = json.loads(body or b"{}")
        except (ValueError, RecursionError) as exc:
            return _error(400, f"not JSON: {str(exc)[:200]}")
        if not isinstance(message, dict):
            return _error(400, "the body must be a JSON object")
        return await run_in_threadpool(self._store, run_id, name, message, signature)

    def _store(
        self, run_id: str, name: str, message: dict[str, Any], signature: str
    ) -> JSONResponse:
        self._forget_old()
        try:
            receipt = self.outbox.signal(
                run_id,
                name,
                message.get("payload"),
                dedup_key=message.get("dedup_key"),
                request_id=hashlib.sha256(signature.encode()).hexdigest(),
            )
        except ReplayRefused:
            return _error(409, "replayed: this signature was already accepted")
        except ValidationError as exc:
            return _error(400, str(exc)[:1000])
        except NotFound as exc:
            return _error(404, str(exc))
        except RunTerminal as exc:
            return _error(409, str(exc))
        except OutboxError as exc:
            log.warning("signal to run %s failed: %s", run_id, exc)
            return _error(500, "the signal could not be stored; send it again")
        return JSONResponse(receipt.model_dump(mode="json"), status_code=202)

    def _forget_old(self) -> None:
        # Signatures older than the tolerance can no longer pass the freshness check.
        with self._cleanup_lock:
            if time.monotonic() - self._last_cleanup < 60:
                return
            self._last_cleanup = time.monotonic()
        with self.outbox.store.run_tx() as tx:
            tx.forget_replays(self.tolerance * 2)
