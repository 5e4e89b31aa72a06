"""The HTTP API of ``outbox serve`` (``/api/v1``), for agents that cannot reach PostgreSQL.

Start a run, record steps with their intents, send signals, finish the run,
read runs and effects, and await an effect's outcome, all under a bearer token
(``OUTBOX_API_TOKEN``), with the limits of the rest of ``outbox serve`` (body
size and time, concurrency). Routes: :data:`~outbox.serve.api.operations.OPERATIONS`;
the OpenAPI document: ``GET /api/v1/openapi.json`` and ``schemas/http-api.openapi.json``;
the guide: ``docs/http-api.md``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from outbox.serve.api.errors import error_response
from outbox.serve.api.handlers import ApiHandlers
from outbox.serve.api.openapi import openapi_document
from outbox.serve.api.operations import API_PREFIX, OPENAPI_PATH, OPERATIONS
from outbox.serve.ops import bearer
from outbox.serve.settings import Credentials, ServeSettings
from outbox.serve.transport import ASGIApp, Receive, Scope, Send

if TYPE_CHECKING:
    from outbox.client import Outbox

__all__ = ["API_PREFIX", "ApiAuth", "api_app"]

log = logging.getLogger("outbox.serve")

#: Paths served without the token (inside the mount, or seen from the root).
_PUBLIC = frozenset({OPENAPI_PATH, API_PREFIX + OPENAPI_PATH})


class ApiAuth:
    """ASGI middleware: every API request but the OpenAPI document needs the API token."""

    def __init__(self, app: ASGIApp, credentials: Credentials, handlers: ApiHandlers) -> None:
        self.app = app
        self.credentials = credentials
        #: The handlers behind it (their long-poll watch, say).
        self.handlers = handlers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Refuse without the token (401), or when the API is off (503); else pass on."""
        if scope["type"] != "http" or scope.get("path") in _PUBLIC:
            await self.app(scope, receive, send)
            return
        refusal: Response | None = None
        if self.credentials.api_token is None:
            refusal = error_response(
                "api_disabled", "the HTTP API is off: set OUTBOX_API_TOKEN (a bearer token)"
            )
        elif not self.credentials.may_call_api(bearer(Request(scope))):
            refusal = error_response(
                "unauthenticated",
                "Authorization: Bearer <OUTBOX_API_TOKEN> required",
                headers={"WWW-Authenticate": 'Bearer realm="outbox"'},
            )
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def _not_found(request: Request, exc: Exception) -> Response:
    return error_response("not_found", f"no route {request.url.path[:200]!r} in the HTTP API")


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return error_response(
        "method_not_allowed", f"{request.method} is not allowed on {request.url.path[:200]!r}"
    )


async def _server_error(request: Request, exc: Exception) -> Response:
    # Logged by BodyLimit (the outermost layer); the caller learns only that it failed.
    return error_response("internal", "the request failed; send it again")


def api_app(outbox: Outbox, settings: ServeSettings, credentials: Credentials) -> ApiAuth:
    """The API's ASGI app, to be mounted at :data:`API_PREFIX`."""
    handlers = ApiHandlers(outbox, settings)
    document = openapi_document()

    async def openapi(request: Request) -> Response:
        return JSONResponse(document)

    routes = [
        Route(op.path, getattr(handlers, op.handler), methods=[op.method]) for op in OPERATIONS
    ]
    routes.append(Route(OPENAPI_PATH, openapi, methods=["GET"]))
    app = Starlette(
        routes=routes,
        exception_handlers={404: _not_found, 405: _not_allowed, Exception: _server_error},
    )
    return ApiAuth(app, credentials, handlers)
