"""Every path ``outbox serve`` answers is in docs/reference/http.md, with its method."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from starlette.routing import BaseRoute, Mount, Route

from outbox import Outbox
from outbox.serve.app import build_app
from outbox.serve.settings import Credentials, ServeSettings

DOC = Path(__file__).resolve().parents[2] / "docs" / "reference" / "http.md"


def _routes(routes: list[BaseRoute], prefix: str = "") -> list[tuple[str, str]]:
    found = []
    for route in routes:
        if isinstance(route, Mount):
            inner: Any = route.app  # a router, or middleware around one
            while not hasattr(inner, "routes") and hasattr(inner, "app"):
                inner = inner.app  # middleware around the mounted router
            found += _routes(list(inner.routes), prefix + route.path)
        elif isinstance(route, Route):
            path = (prefix + route.path) or "/"
            for method in sorted((route.methods or set()) - {"HEAD"}):
                found.append((method, path))
    return found


def test_every_route_is_in_the_http_reference(ob: Outbox) -> None:
    app = build_app(ob, ServeSettings(), Credentials())
    routes = _routes(list(app.routes))
    assert ("POST", "/runs/{run_id}/signals/{name}") in routes
    assert len(routes) > 10
    text = DOC.read_text(encoding="utf-8")
    missing = []
    for method, path in routes:
        # "GET /console/runs/{run_id}", or "GET /`, `GET /console" in one cell
        if not re.search(rf"`{method} {re.escape(path)}[`/]", text):
            missing.append(f"{method} {path}")
    assert missing == []
