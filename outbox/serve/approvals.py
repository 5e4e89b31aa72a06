"""``POST /effects/{effect_id}/approval``: approve or reject a held effect by a signed request.

Signed exactly like the signal webhook (:func:`outbox.serve.webhooks.sign`: HMAC-SHA256
of ``"<timestamp>.<path>.<body>"`` under the deployment's secret, in
``X-Outbox-Signature``, with ``X-Outbox-Timestamp``), refused when stale, and
accepted once (the signature is remembered in the decision's own transaction).
The body::

    {"decision": "approve", "digest": "<sha256 of the payload>", "note": "why", "by": "who"}

``decision`` is ``approve`` or ``reject`` (a rejection may name the digest too).
Answers: 200 with the effect's new status; 409 when the approval is refused
(wrong digest, not awaiting approval, past its deadline) or replayed; 401
unsigned or badly signed; 400 bad body; 404 no such effect.

:func:`handle_approval` is a plain function of (path, headers, body);
:class:`ApprovalEndpoint` mounts it on ``outbox serve``'s Starlette app.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse

from outbox.errors import (
    ApprovalRefused,
    NotFound,
    OutboxError,
    ReplayRefused,
    ValidationError,
)
from outbox.serve.transport import BODY_KEY
from outbox.serve.webhooks import (
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    SignalEndpoint,
    too_deep,
    verify,
)

if TYPE_CHECKING:
    from outbox.client import Outbox

__all__ = [
    "APPROVAL_PATH",
    "APPROVAL_ROUTE",
    "ApprovalEndpoint",
    "ApprovalRequest",
    "handle_approval",
]

APPROVAL_ROUTE = re.compile(r"^/effects/([0-9a-fA-F-]{36})/approval$")
#: The same route in Starlette's path syntax.
APPROVAL_PATH = "/effects/{effect_id}/approval"


class ApprovalRequest(BaseModel):
    """The body of an approval request."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    decision: Literal["approve", "reject"]
    digest: str | None = None
    note: str = Field(min_length=1, max_length=2000)
    by: str = Field(min_length=1, max_length=200)


def handle_approval(
    outbox: Outbox,
    secret: bytes,
    *,
    path: str,
    header: Callable[[str], str | None],
    body: bytes,
    tolerance: float,
) -> tuple[int, dict[str, Any]]:
    """Verify, decide, and answer ``(status, json)`` for one request to :data:`APPROVAL_ROUTE`."""
    match = APPROVAL_ROUTE.match(path)
    if match is None:
        return 404, {"error": "POST /effects/{effect_id}/approval"}
    signature = header(SIGNATURE_HEADER)
    refusal = verify(secret, header(TIMESTAMP_HEADER), signature, path, body, tolerance=tolerance)
    if refusal is not None:
        return 401, {"error": refusal}
    assert signature is not None
    if too_deep(body):
        return 400, {"error": "JSON nested too deep"}
    try:
        request = ApprovalRequest.model_validate(json.loads(body or b"{}"))
    except (ValueError, RecursionError, pydantic.ValidationError) as exc:
        return 400, {"error": str(exc).splitlines()[0][:300]}
    request_id = hashlib.sha256(signature.encode()).hexdigest()
    given = {"note": request.note, "by": request.by, "request_id": request_id, "via": "http"}
    try:
        if request.decision == "approve":
            if request.digest is None:
                return 400, {"error": "digest: an approval names the digest of the payload"}
            effect = outbox.approve_effect(match[1], digest=request.digest, **given)
        else:
            effect = outbox.reject_effect(match[1], digest=request.digest, **given)
    except ReplayRefused:
        return 409, {"error": "replayed: this signature was already accepted"}
    except ApprovalRefused as exc:
        return 409, {"error": str(exc), "refused": exc.reason}
    except ValidationError as exc:
        return 400, {"error": str(exc)}
    except NotFound as exc:
        return 404, {"error": str(exc)}
    except OutboxError as exc:
        return 500, {"error": str(exc)}
    return 200, {"effect_id": str(effect.id), "status": effect.status.value}


class ApprovalEndpoint:
    """The Starlette endpoint of :data:`APPROVAL_PATH` for one Outbox (503 without a secret)."""

    def __init__(self, outbox: Outbox, secret: bytes | None, tolerance: float) -> None:
        self.outbox = outbox
        self.secret = secret
        self.tolerance = tolerance
        # Shares the signal endpoint's sweep of old signatures (one table holds both).
        self._signals = SignalEndpoint(outbox, secret, tolerance)

    async def handle(self, request: Request) -> JSONResponse:
        """Verify and decide in a worker thread; answer as :func:`handle_approval` does."""
        if self.secret is None:
            return JSONResponse(
                {"error": "approvals over HTTP are off: OUTBOX_WEBHOOK_SECRET is not set"},
                status_code=503,
            )
        body: bytes = request.scope.get(BODY_KEY, b"")
        path = request.scope.get("raw_path", b"").decode("latin-1") or request.url.path
        secret = self.secret

        def decide() -> tuple[int, dict[str, Any]]:
            self._signals._forget_old()
            return handle_approval(
                self.outbox,
                secret,
                path=path,
                header=request.headers.get,
                body=body,
                tolerance=self.tolerance,
            )

        status, answer = await run_in_threadpool(decide)
        return JSONResponse(answer, status_code=status)
