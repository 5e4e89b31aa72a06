"""``outbox serve``: signals, approvals, health, metrics, the HTTP API and the console.

:func:`build_app` composes the Starlette routes; :class:`OutboxServer` runs
them on uvicorn with the limits of :class:`~outbox.serve.settings.ServeSettings`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route

from outbox.serve.api import API_PREFIX, api_app
from outbox.serve.approvals import APPROVAL_PATH, ApprovalEndpoint
from outbox.serve.hosts import HostAllowList
from outbox.serve.ops import CachedCounts, Health, Metrics
from outbox.serve.settings import Credentials, ServeSettings
from outbox.serve.transport import HttpServer
from outbox.serve.webhooks import SIGNAL_ROUTE, SignalEndpoint

if TYPE_CHECKING:
    from outbox.client import Outbox

__all__ = ["OutboxServer", "build_app"]

log = logging.getLogger("outbox.serve")


async def _not_found(request: Request, exc: Exception) -> Response:
    return JSONResponse({"error": "not found"}, status_code=404)


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return JSONResponse({"error": "method not allowed"}, status_code=405)


async def _server_error(request: Request, exc: Exception) -> Response:
    # Logged once by BodyLimit (the outermost layer), without the request's body or headers.
    return JSONResponse({"error": "internal error"}, status_code=500)


def build_app(outbox: Outbox, settings: ServeSettings, credentials: Credentials) -> Starlette:
    """The Starlette app of one server (console included when ``settings.console``)."""
    counts = CachedCounts(outbox, settings.counts_cache_seconds)
    api = api_app(outbox, settings, credentials)
    routes: list[BaseRoute] = [
        Route(
            SIGNAL_ROUTE,
            SignalEndpoint(outbox, credentials.webhook_secret, settings.tolerance).handle,
            methods=["POST"],
        ),
        Route(
            APPROVAL_PATH,
            ApprovalEndpoint(outbox, credentials.webhook_secret, settings.tolerance).handle,
            methods=["POST"],
        ),
        Route("/healthz", Health(outbox).handle, methods=["GET"]),
        Route("/metrics", Metrics(counts, credentials).handle, methods=["GET"]),
        Mount(API_PREFIX, app=api),
    ]
    if settings.console:
        from outbox.serve.console import console_app

        hosts = HostAllowList(settings.allowed_hosts, settings.host)
        routes.append(Mount("/console", app=console_app(outbox, credentials, counts, hosts)))

        async def home(request: Request) -> Response:
            return RedirectResponse("/console/", status_code=303)

        routes.append(Route("/", home, methods=["GET"]))
        routes.append(Route("/console", home, methods=["GET"]))
    app = Starlette(
        routes=routes,
        exception_handlers={404: _not_found, 405: _not_allowed, Exception: _server_error},
    )
    app.state.counts = counts
    app.state.api = api
    return app


class OutboxServer(HttpServer):
    """``outbox serve``: the app of :func:`build_app` on uvicorn.

    ``OutboxServer(ob, settings, credentials).start()`` serves from a thread
    (tests, embedding); ``serve_forever()`` serves in the foreground.
    """

    def __init__(
        self,
        outbox: Outbox,
        settings: ServeSettings | None = None,
        credentials: Credentials | None = None,
    ) -> None:
        self.settings = settings or ServeSettings()
        self.credentials = credentials or Credentials()
        self.app = build_app(outbox, self.settings, self.credentials)
        super().__init__(
            self.app, self.settings, on_stop=[self.app.state.api.handlers.watch.release]
        )
