"""``testing.record``: a stand-in for any effect kind, and the sink that records what it applied.

``outbox check --sink record`` serves every kind an agent intends with a
:class:`RecordDeliverer` posting to one :class:`RecordingSink` (an HTTP server
in the checking process), so an agent can be checked without its real sinks.
A stand-in keeps the declaration of the kind it replaces: an idempotent kind's
sink dedups on the key (as Stripe does), a non-idempotent kind's sink applies
every request it receives (so a blind resend would show as a duplicate), and
only a kind with a lookup answers lookups.

:class:`RecordingSink` is the real :class:`~deliverers.testing.IdempotentHttpSink`
with one addition to its JSON-lines request log: an ``applied`` line each time
a request takes effect (``{"event": "applied", "key", "operation", "path",
"body"}``), which is what the invariant checker of :mod:`outbox.check`
counts. Requests that do not come from a stand-in (an agent calling the sink
itself, a real ``http.request`` deliverer) are applied and logged the same way.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import quote

import httpx

from deliverers.testing import IdempotentHttpSink
from outbox.delivery import (
    Deliverer,
    DelivererConfig,
    Delivery,
    NotApplied,
    Outcome,
    Retry,
    Succeeded,
    Unknown,
)

__all__ = ["BLIND_PREFIX", "RECORD_PREFIX", "RecordConfig", "RecordDeliverer", "RecordingSink"]

#: Paths of requests from a stand-in of an idempotent kind: the sink dedups on the key.
RECORD_PREFIX = "/record/"
#: Paths of requests from a stand-in of a non-idempotent kind: every request takes effect.
BLIND_PREFIX = "/blind/"


class RecordConfig(DelivererConfig):
    """Settings of a stand-in: where the recording sink listens, and whether it answers lookups."""

    #: Where the recording sink listens (``outbox check`` sets it to its own sink).
    url: str = "http://127.0.0.1:8080"
    #: Whether the stand-in answers "was this key applied?" as the real kind's deliverer does.
    lookup: bool = False
    #: Seconds one post to the recording sink may take.
    timeout: float = 10.0


class RecordDeliverer(Deliverer[RecordConfig]):
    """Posts ``{"kind", "payload", "run_id", "effect_id"}`` to a :class:`RecordingSink`.

    The key travels as ``Idempotency-Key``. Declare ``idempotent`` (default
    true) and ``lookup`` as the kind it stands in for does.
    """

    default_idempotent: ClassVar[bool] = True
    default_registered: ClassVar[bool] = False

    def __init__(self, kind: str, config: DelivererConfig | None = None) -> None:
        super().__init__(kind, config)
        self._client = httpx.Client(timeout=self.config.timeout)

    @property
    def has_lookup(self) -> bool:
        """As configured: a stand-in answers lookups only for a kind that has them."""
        return self.config.lookup

    def _url(self, prefix: str, tail: str) -> str:
        return self.config.url.rstrip("/") + prefix + quote(tail, safe="")

    def deliver(self, delivery: Delivery) -> Outcome:
        """One POST; 200 is a success, anything else is retried (or unknown, if not idempotent)."""
        envelope = {
            "kind": delivery.kind,
            "payload": delivery.payload,
            "run_id": None if delivery.run_id is None else str(delivery.run_id),
            "effect_id": str(delivery.effect_id),
        }
        prefix = RECORD_PREFIX if self.idempotent else BLIND_PREFIX
        try:
            response = self._client.post(
                self._url(prefix, delivery.kind),
                json=envelope,
                headers={
                    "Idempotency-Key": delivery.idempotency_key,
                    "X-Outbox-Effect-Id": str(delivery.effect_id),
                    "X-Outbox-Attempt": str(delivery.attempt),
                },
            )
        except httpx.HTTPError as exc:
            reason = f"recording sink unreachable: {type(exc).__name__}: {exc}"
            return Retry(reason) if self.idempotent else Unknown(reason)
        if response.status_code == 200:
            return Succeeded(response.json())
        reason = f"recording sink answered {response.status_code}"
        return Retry(reason) if self.idempotent else Unknown(reason)

    def lookup(self, delivery: Delivery) -> Any:
        """Ask the sink whether the key was applied."""
        response = self._client.get(self._url("/idempotency/", delivery.idempotency_key))
        if response.status_code == 404:
            return NotApplied()
        response.raise_for_status()
        return Succeeded(response.json().get("response"))

    def close(self) -> None:
        """Close the HTTP client."""
        self._client.close()


class RecordingSink(IdempotentHttpSink):
    """An :class:`IdempotentHttpSink` whose log also records every application.

    The base class logs each request as it arrives (``{"t", "path", "key",
    "effect_id", "attempt", "body"}``), before it knows whether it will be
    applied, refused by a fault or replayed from the stored result. This class
    appends ``{"event": "applied", ...}`` when a request actually takes
    effect, under its own lock so the before/after comparison is exact.
    Requests under :data:`BLIND_PREFIX` always take effect (a sink that
    cannot dedup); their keys are remembered only to answer lookups.
    """

    def __init__(
        self,
        log_path: Path,
        *,
        lookup_latency: float = 0.0,
        lookup_barrier: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(log_path=log_path, **kwargs)
        self.log_path = log_path
        log_path.touch()
        #: Seconds every lookup (``GET /idempotency/KEY``) takes.
        self.lookup_latency = lookup_latency
        #: Lookups wait until this many client connections have asked (at most 60 s):
        #: proof that that many processes were looking up at the same time.
        self.lookup_barrier = lookup_barrier
        self.lookup_peers: set[Any] = set()
        self._peers_changed = threading.Condition()
        self._apply_lock = threading.Lock()

    def _get(self, handler: Any) -> None:
        if handler.path.startswith("/idempotency/"):
            with self._peers_changed:
                self.lookup_peers.add(handler.client_address)
                self._peers_changed.notify_all()
                self._peers_changed.wait_for(
                    lambda: len(self.lookup_peers) >= self.lookup_barrier, timeout=60
                )
            time.sleep(self.lookup_latency)
        super()._get(handler)

    def _apply_blind(self, key: str | None, raw: bytes, path: str) -> tuple[int, Any]:
        with self._lock:
            response = {
                "applied": True,
                "path": path,
                "key": key,
                "seq": sum(self.state.applied_count.values()) + 1,
            }
            if key:
                self.state.applied.setdefault(key, response)
                self.state.applied_count[key] += 1
        return 200, response

    def _apply(self, key: str | None, raw: bytes, path: str) -> tuple[int, Any]:
        with self._apply_lock:
            if path.startswith(BLIND_PREFIX):
                status, response = self._apply_blind(key, raw, path)
                applied = True
            else:
                fresh = not key or not self.honour_keys or key not in self.state.applied
                status, response = super()._apply(key, raw, path)
                # A request without a key cannot be deduplicated: it always takes effect.
                applied = status == 200 and fresh
        if applied:
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = None
            operation = body.get("operation") if isinstance(body, dict) else None
            self._log(
                {
                    "event": "applied",
                    "t": time.time(),
                    "path": path,
                    "key": key,
                    "operation": operation,
                    "body": raw.decode(errors="replace"),
                    "seq": response.get("seq") if isinstance(response, dict) else None,
                }
            )
        return status, response
