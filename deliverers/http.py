"""``http.request``: an HTTP call with the idempotency key in the ``Idempotency-Key`` header.

2xx succeeded; 408, 425, 429 and 5xx, timeouts and connection errors are
retried (``Retry-After`` honoured, in seconds or as an HTTP date; a 429 slows
the whole kind); any other status fails. The status and a bounded excerpt of
the body are recorded. A payload cannot reach private, loopback or link-local
addresses unless the config allows them, so an intent cannot turn the
deliverer into an SSRF tool; credentials come from the environment or a file
named in the config, never from the payload.
"""

from __future__ import annotations

import asyncio
import fnmatch
import ipaddress
import os
import socket
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any, ClassVar, Literal
from urllib.parse import quote, urlsplit

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from outbox.delivery import (
    Deliverer,
    DelivererConfig,
    Delivery,
    Failed,
    NotApplied,
    Outcome,
    Retry,
    Succeeded,
    Unknown,
)
from outbox.errors import ConfigurationError

__all__ = ["Credential", "HttpConfig", "HttpDeliverer", "HttpRequest", "parse_retry_after"]

RETRY_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})
# Statuses that say the request was not processed: safe to resend even without dedup.
NOT_PROCESSED_STATUSES = frozenset({408, 425, 429, 503})
# Headers that carry secrets must come from a configured credential.
SECRET_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie", "x-api-key"})
RESERVED_HEADERS = frozenset({"idempotency-key", "host", "content-length"})
MAX_RETRY_AFTER = 24 * 3600.0


class HttpRequest(BaseModel):
    """Payload of an ``http.request`` effect."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    method: Literal["GET", "POST", "PUT", "PATCH", "DELETE"] = "POST"
    url: str = Field(min_length=1, max_length=8192)
    headers: dict[str, str] = Field(default_factory=dict)
    json_body: Any = Field(default=None, alias="json")
    timeout: float = Field(default=10.0, gt=0, le=300)
    #: Name of a credential in the deliverer's config (never the secret itself).
    credential: str | None = None

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an absolute http:// or https:// URL")
        return value

    @field_validator("headers")
    @classmethod
    def _no_secrets(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            lower = name.lower()
            if lower in SECRET_HEADERS:
                raise ValueError(
                    f"header {name!r} carries a secret: name a configured credential instead"
                )
            if lower in RESERVED_HEADERS:
                raise ValueError(f"header {name!r} is set by the deliverer")
        return value


class Credential(BaseModel):
    """A header whose value is read from the environment or a file when a call is made."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    header: str = "Authorization"
    env: str | None = None
    file: Path | None = None
    prefix: str = ""

    @model_validator(mode="after")
    def _one_source(self) -> Credential:
        if (self.env is None) == (self.file is None):
            raise ValueError("set exactly one of env or file")
        return self

    def value(self) -> str:
        """Read the secret now (so a rotated secret is picked up without a restart)."""
        if self.env is not None:
            secret = os.environ.get(self.env)
            if secret is None:
                raise ConfigurationError(f"credential env {self.env!r} is not set")
        else:
            assert self.file is not None
            secret = self.file.read_text().strip()
        return self.prefix + secret


class HttpConfig(DelivererConfig):
    """Settings of an HTTP deliverer."""

    #: When set, only these host names (``*.example.com`` patterns allowed).
    allowed_hosts: list[str] | None = None
    #: Private/loopback/link-local hosts or networks (CIDR) that may be called anyway.
    allow_private: list[str] = Field(default_factory=list)
    credentials: dict[str, Credential] = Field(default_factory=dict)
    #: How much of a response body is read at most, and how much is recorded.
    read_limit_bytes: int = Field(default=1024 * 1024, ge=0)
    excerpt_bytes: int = Field(default=2048, ge=0)
    #: URL template the sink answers for a key (``{key}``): see :meth:`HttpDeliverer.lookup`.
    lookup_url: str | None = None
    #: Name of a credential (in ``credentials``) sent with lookups.
    lookup_credential: str | None = None
    user_agent: str = "agent-outbox"


def parse_retry_after(value: str | None, *, now: datetime | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or HTTP-date)."""
    if value is None or not value.strip():
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():  # RFC 9110 DIGIT is ASCII; float('²') raises
        return min(float(value), MAX_RETRY_AFTER)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    delta = (when - (now or datetime.now(UTC))).total_seconds()
    return min(max(delta, 0.0), MAX_RETRY_AFTER)


class HttpDeliverer(Deliverer):
    """Calls an HTTP endpoint; idempotent by default (the sink is expected to honour the key)."""

    default_idempotent: ClassVar[bool] = True
    payload_model: ClassVar[type[BaseModel] | None] = HttpRequest
    config_model: ClassVar[type[DelivererConfig]] = HttpConfig

    def __init__(self, kind: str, config: DelivererConfig | None = None) -> None:
        super().__init__(kind, config)
        assert isinstance(self.config, HttpConfig)
        self.http: HttpConfig = self.config
        self._networks = []
        self._private_names = set()
        for entry in self.http.allow_private:
            try:
                self._networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                self._private_names.add(entry.lower())
        self._client: httpx.AsyncClient | None = None

    def _client_for_loop(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                follow_redirects=False,  # a redirect could lead past the allowlist
                headers={"User-Agent": self.http.user_agent},
                limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
            )
        return self._client

    async def _refusal(self, url: str) -> str | None:
        host = (urlsplit(url).hostname or "").lower()
        allowed = self.http.allowed_hosts
        if allowed is not None and not any(fnmatch.fnmatch(host, p.lower()) for p in allowed):
            return f"url host {host!r} is not in allowed_hosts"
        if host in self._private_names:
            return None
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, None, type=socket.SOCK_STREAM
            )
        except OSError:
            return None  # unresolvable: the request fails and is retried like any network error
        for info in infos:
            address = ipaddress.ip_address(info[4][0])
            if any(address in net for net in self._networks):
                continue
            if (
                address.is_private
                or address.is_loopback
                or address.is_link_local
                or address.is_reserved
                or address.is_multicast
                or address.is_unspecified
            ):
                return (
                    f"url host {host!r} resolves to non-public address {address}; "
                    "allow it with allow_private in the deliverer config"
                )
        return None

    def _headers(self, request: HttpRequest, delivery: Delivery) -> dict[str, str]:
        headers = dict(request.headers)
        headers["Idempotency-Key"] = delivery.idempotency_key
        headers["X-Outbox-Effect-Id"] = str(delivery.effect_id)
        headers["X-Outbox-Attempt"] = str(delivery.attempt)
        if delivery.run_id is not None:
            headers["X-Outbox-Run-Id"] = str(delivery.run_id)
        if request.credential is not None:
            credential = self.http.credentials.get(request.credential)
            if credential is None:
                raise KeyError(request.credential)
            headers[credential.header] = credential.value()
        return headers

    async def deliver(self, delivery: Delivery) -> Outcome:
        """Make the request once; classify the answer."""
        request: HttpRequest = delivery.payload
        refusal = await self._refusal(request.url)
        if refusal is not None:
            return Failed(refusal)
        try:
            headers = self._headers(request, delivery)
        except KeyError as exc:
            return Failed(f"credential {exc.args[0]!r} is not configured for kind {self.kind!r}")
        except (ConfigurationError, OSError) as exc:
            return Retry(f"credential unavailable: {exc}")
        client = self._client_for_loop()
        try:
            async with client.stream(
                request.method,
                request.url,
                headers=headers,
                json=request.json_body if request.json_body is not None else None,
                timeout=request.timeout,
            ) as response:
                body, truncated = await self._read(response)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            return Retry(f"not sent: {type(exc).__name__}: {exc}")  # never reached the sink
        except httpx.HTTPError as exc:
            reason = f"{type(exc).__name__} after the request was sent: {exc}"
            if isinstance(exc, httpx.TimeoutException):
                reason = f"timed out after {request.timeout}s ({type(exc).__name__})"
            # A sink that cannot dedup may have applied it: an operator decides.
            return Retry(reason) if self.idempotent else Unknown(reason)
        return self._classify(response, body, truncated)

    async def _read(self, response: httpx.Response) -> tuple[bytes, bool]:
        limit = self.http.read_limit_bytes
        chunks: list[bytes] = []
        size = 0
        async for chunk in response.aiter_bytes():
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                return b"".join(chunks)[:limit], True
        return b"".join(chunks), False

    def _classify(self, response: httpx.Response, body: bytes, truncated: bool) -> Outcome:
        excerpt = body[: self.http.excerpt_bytes].decode("utf-8", errors="replace")
        record = {
            "status": response.status_code,
            "body": excerpt,
            "truncated": truncated or len(body) > self.http.excerpt_bytes,
            "bytes_read": len(body),
        }
        status = response.status_code
        if 200 <= status < 300:
            return Succeeded(record)
        if status in RETRY_STATUSES:
            if not self.idempotent and status not in NOT_PROCESSED_STATUSES:
                return Unknown(f"HTTP {status}: the sink may have applied it", detail=record)
            after = parse_retry_after(response.headers.get("Retry-After"))
            return Retry(f"HTTP {status}", after=after, rate_limited=status == 429, detail=record)
        return Failed(f"HTTP {status}", detail=record)

    async def lookup(self, delivery: Delivery) -> Any:
        """Ask the sink's ``lookup_url`` whether it applied the key (the read-back contract).

        ``GET`` the URL template with ``{key}`` (URL-quoted), the
        ``Idempotency-Key`` header and the ``lookup_credential``, then:

        - 404, or 2xx with a JSON object whose ``applied`` is ``false``: not
          applied (the reconciler sends it again, same key);
        - 2xx otherwise: applied; a JSON object's ``response`` (else the whole
          body) is recorded as the effect's result;
        - anything else (or no answer): unknown yet; the reconciler asks again
          next round and never resends meanwhile.
        """
        template = self.http.lookup_url
        if template is None:
            raise NotImplementedError("no lookup_url configured")
        url = template.format(key=quote(delivery.idempotency_key, safe=""))
        refusal = await self._refusal(url)
        if refusal is not None:
            raise PermissionError(refusal)
        headers = {"Idempotency-Key": delivery.idempotency_key}
        if self.http.lookup_credential is not None:
            credential = self.http.credentials.get(self.http.lookup_credential)
            if credential is None:
                raise ConfigurationError(
                    f"lookup_credential {self.http.lookup_credential!r} is not configured"
                )
            headers[credential.header] = credential.value()
        response = await self._client_for_loop().get(url, headers=headers, timeout=10.0)
        if response.status_code == 404:
            return NotApplied()
        response.raise_for_status()
        try:
            answer = response.json()
        except ValueError:
            answer = None
        if isinstance(answer, dict) and answer.get("applied") is False:
            return NotApplied()
        recorded = answer.get("response", answer) if isinstance(answer, dict) else None
        return Succeeded(
            {
                "status": response.status_code,
                "looked_up": True,
                "response": recorded,
                "body": response.text[: self.http.excerpt_bytes],
            }
        )

    @property
    def has_lookup(self) -> bool:
        """Only with a configured ``lookup_url``."""
        return self.http.lookup_url is not None

    async def aclose(self) -> None:
        """Close the HTTP client (it belongs to the daemon's event loop)."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None
