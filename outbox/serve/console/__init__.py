"""The operator console: runs, effects, the unknown queue, versions and a live overview.

Server-rendered (Jinja2) on the ``outbox serve`` app, mounted at ``/console``.
See :mod:`outbox.serve.console.pages` for the pages and
:mod:`outbox.serve.console.auth` for who may act.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from starlette.routing import Route, Router

from outbox.serve.console.auth import ConsoleAuth
from outbox.serve.console.pages import Console
from outbox.serve.hosts import HostAllowList
from outbox.serve.ops import CachedCounts
from outbox.serve.settings import Credentials

if TYPE_CHECKING:
    from outbox.client import Outbox

__all__ = ["console_app"]


class ServerTiming:
    """Adds ``Server-Timing: app;dur=<ms>`` (time to the response's headers) to each page.

    Browsers show it in their developer tools; ``python -m bench.console`` reads it.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()

        async def timed(message: Any) -> None:
            if message["type"] == "http.response.start":
                took = (time.perf_counter() - started) * 1000
                message.setdefault("headers", [])
                message["headers"] = [
                    *message["headers"],
                    (b"server-timing", f"app;dur={took:.1f}".encode()),
                ]
            await send(message)

        await self.app(scope, receive, timed)


def console_app(
    outbox: Outbox, credentials: Credentials, counts: CachedCounts, hosts: HostAllowList
) -> Any:
    """The console's routes (mount them at ``/console``); ``hosts`` are its own names."""
    c = Console(outbox, ConsoleAuth(credentials, hosts), counts)
    get, post = ["GET"], ["POST"]
    k = c.checked
    router = Router(
        routes=[
            Route("/", k(c.overview), methods=get),
            Route("/runs", k(c.runs), methods=get),
            Route("/runs/{run_id}", k(c.run), methods=get),
            Route("/runs/{run_id}/cancel", k(c.cancel), methods=post),
            Route("/effects", k(c.effects), methods=get),
            Route("/effects/{effect_id}", k(c.effect), methods=get),
            Route("/effects/{effect_id}/resolve", k(c.resolve), methods=post),
            Route("/effects/{effect_id}/retry", k(c.retry), methods=post),
            Route("/effects/{effect_id}/approve", k(c.approve), methods=post),
            Route("/effects/{effect_id}/reject", k(c.reject), methods=post),
            Route("/unknown", k(c.queue), methods=get),
            Route("/versions", k(c.versions), methods=get),
            Route("/login", k(c.login_form), methods=get),
            Route("/login", k(c.login), methods=post),
            Route("/logout", k(c.logout), methods=post),
        ]
    )
    return ServerTiming(router)
