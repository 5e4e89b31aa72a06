"""``/healthz`` and ``/metrics`` of ``outbox serve``.

``/healthz`` says whether the database answers, never why not (the driver's
text can name hosts and users; it goes to the log). ``/metrics`` wants a bearer
token and reads the state counts through :class:`CachedCounts`, so scrapes
from many collectors cost one set of counting queries every few seconds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Generic, TypeVar

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from outbox.errors import OutboxError
from outbox.serve.settings import Credentials
from outbox.storage.sql.maintenance import StateCounts

if TYPE_CHECKING:
    from outbox.client import Outbox

__all__ = ["CachedCounts", "Health", "Metrics", "bearer"]

log = logging.getLogger("outbox.serve")

T = TypeVar("T")


class Cached(Generic[T]):
    """A value computed at most once per ``ttl`` seconds; concurrent readers share one load."""

    def __init__(self, load: Callable[[], T], ttl: float) -> None:
        self._load = load
        #: Seconds a loaded value is reused.
        self.ttl = ttl
        self._lock = threading.Lock()
        self._value: T | None = None
        self._at = float("-inf")
        #: How many times the value was actually loaded (tests and curiosity).
        self.loads = 0

    def get(self) -> T:
        """The value, loaded again when older than ``ttl``."""
        with self._lock:
            if self._value is None or time.monotonic() - self._at >= self.ttl:
                self._value = self._load()
                self._at = time.monotonic()
                self.loads += 1
            return self._value


class CachedCounts(Cached[StateCounts]):
    """Runs by status and open effects by (status, kind), at most one query per ``ttl``."""

    def __init__(self, outbox: Outbox, ttl: float) -> None:
        super().__init__(outbox.store.state_counts, ttl)


class _StateCollector:
    """The cached state counts as Prometheus gauges."""

    def __init__(self, counts: CachedCounts) -> None:
        self._counts = counts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        counts = self._counts.get()
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
        yield GaugeMetricFamily(
            "outbox_oldest_pending_seconds",
            "Seconds the longest-due pending effect has waited",
            value=counts.oldest_pending_seconds,
        )


def bearer(request: Request) -> str | None:
    """The token of an ``Authorization: Bearer`` header, if any."""
    value = request.headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


class Health:
    """``GET /healthz``: 200 ``{"ok": true}`` or 503 ``{"ok": false}``."""

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox

    async def handle(self, request: Request) -> JSONResponse:
        """One round trip to the database."""
        try:
            await run_in_threadpool(self.outbox.store.ping)
        except OutboxError as exc:
            log.warning("health check: the database does not answer: %s", exc)
            return JSONResponse({"ok": False, "error": "database unavailable"}, status_code=503)
        return JSONResponse({"ok": True})


class Metrics:
    """``GET /metrics``: Prometheus text, for a holder of the metrics (or operator) token."""

    def __init__(self, counts: CachedCounts, credentials: Credentials) -> None:
        self.credentials = credentials
        self.registry = CollectorRegistry()
        self.registry.register(_StateCollector(counts))

    async def handle(self, request: Request) -> Response:
        """Refuse without the token; else the gauges."""
        if self.credentials.metrics_token is None and self.credentials.operator_token is None:
            return JSONResponse(
                {"error": "metrics are off: set OUTBOX_METRICS_TOKEN (a bearer token)"},
                status_code=403,
            )
        if not self.credentials.may_scrape(bearer(request)):
            return JSONResponse(
                {"error": "Authorization: Bearer <OUTBOX_METRICS_TOKEN> required"},
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        try:
            data = await run_in_threadpool(generate_latest, self.registry)
        except OutboxError as exc:
            log.warning("metrics: counting states failed: %s", exc)
            return JSONResponse({"error": "database unavailable"}, status_code=503)
        return Response(data, media_type="text/plain; version=0.0.4")
