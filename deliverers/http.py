"""``http.request``: an HTTP call with the idempotency key in the ``Idempotency-Key`` header.

2xx succeeded; 408, 425, 429 and 5xx, timeouts and connection errors are
retried (``Retry-After`` honoured, in seconds or as an HTTP date; a 429 slows
the whole kind); any other status fails. The status and a bounded excerpt of
the body are recorded. Each call has one deadline for the whole exchange
(connect, send, every byte of the answer: a sink trickling its answer cannot
hold a call past its ``timeout``) and reads at most ``read_limit_bytes`` of
any answer, lookups included. A payload cannot reach private, loopback,
link-local or other special-purpose addresses unless the config allows them,
so an intent cannot turn the deliverer into an SSRF tool: every connection
resolves its host once and connects to the address it checked
(:mod:`deliverers.http_guard`), redirect hops included. Credentials come from
the environment or a file named in the config, never from the payload, and are
not carried to another origin by a redirect. Logged URLs hide their query
string and userinfo.

The intent rules (:mod:`outbox.governance.intent_rules`) are checked again when a payload
is read for sending, whatever road its row took (written before the current
rules, or by a direct ``INSERT``): a URL with userinfo (which httpx would turn
into an ``Authorization`` header) or a credential parameter, and a framing,
reserved or credential header, fail the effect at once, nothing sent.
"""

from __future__ import annotations

import asyncio
import json
import os
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar
from urllib.parse import quote, urlsplit

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deliverers.http_guard import (
    AddressPolicy,
    AddressRefused,
    GuardedTransport,
    Resolver,
    install_log_redaction,
    system_resolver,
)
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
from outbox.governance.intent_rules import find_violation

__all__ = ["Credential", "HttpConfig", "HttpDeliverer", "HttpRequest", "parse_retry_after"]

_V = TypeVar("_V")

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
        return _intent_rules("url", value)

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
        return _intent_rules("headers", value)


def _intent_rules(field: str, value: _V) -> _V:
    """``value``, or a ValueError when the intent rules refuse it (defence in depth).

    The write path checks the same rules; a row can still reach the table
    around them (written before the current rules, or by a direct ``INSERT``),
    so they are checked again when the payload is read for sending.
    """
    found = find_violation({field: value})
    if found is not None:
        raise ValueError(str(found.error()))  # names the field, never a secret value
    return value


class Credential(BaseModel):
    """A header whose value is read from the environment or a file when a call is made."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: The header the secret is sent in.
    header: str = "Authorization"
    #: Read the secret from this environment variable at each call...
    env: str | None = None
    #: ... or from this file (exactly one of the two).
    file: Path | None = None
    #: Put before the secret (``"Bearer "``).
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
    #: Credentials by name: a payload's ``credential`` names one (never the secret).
    credentials: dict[str, Credential] = Field(default_factory=dict)
    #: How much of a response body is read at most.
    read_limit_bytes: int = Field(default=1024 * 1024, ge=0)
    #: How much of it is kept in the attempt log.
    excerpt_bytes: int = Field(default=2048, ge=0)
    #: URL template the sink answers for a key (``{key}``): see :meth:`HttpDeliverer.lookup`.
    #: Reached under ``allow_private`` and ``allowed_hosts``, as every call is.
    lookup_url: str | None = None
    #: Name of a credential (in ``credentials``) sent with lookups.
    lookup_credential: str | None = None
    #: The deadline of one lookup, answer included.
    lookup_timeout: float = Field(default=10.0, gt=0, le=300)
    #: Follow 3xx answers (each hop is checked like the first; credentials stay
    #: with the first origin). Off by default: an effect's URL is where it goes.
    follow_redirects: bool = False
    #: Most redirects followed for one call.
    max_redirects: int = Field(default=5, ge=0, le=20)
    #: The ``User-Agent`` header sent.
    user_agent: str = "agent-outbox"


def parse_retry_after(
    value: str | None, *, now: datetime | None = None, date: str | None = None
) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or HTTP-date).

    An HTTP-date is a moment on the sink's clock: when the answer's ``Date``
    header (``date``) is given and valid, the wait is measured from it, so a
    deliverer whose clock is off (or a sink's) waits what the sink meant.
    Otherwise from ``now`` (default: this machine's clock, in UTC). A date
    without a zone is UTC, as every HTTP-date is.
    """
    if value is None or not value.strip():
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():  # RFC 9110 DIGIT is ASCII; float('²') raises
        return min(float(value), MAX_RETRY_AFTER)
    when = _http_date(value)
    if when is None:
        return None
    reference = (_http_date(date) if date else None) or now or datetime.now(UTC)
    delta = (when - reference).total_seconds()
    return min(max(delta, 0.0), MAX_RETRY_AFTER)


def _http_date(value: str) -> datetime | None:
    try:
        when = parsedate_to_datetime(value.strip())
    except (TypeError, ValueError, IndexError):
        return None
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when


class HttpDeliverer(Deliverer[HttpConfig]):
    """Calls an HTTP endpoint; idempotent by default (the sink is expected to honour the key).

    ``resolver`` answers host names (default: the system's ``getaddrinfo``);
    tests pass their own to play a rebinding DNS server.
    """

    default_idempotent: ClassVar[bool] = True
    payload_model: ClassVar[type[BaseModel] | None] = HttpRequest

    def __init__(
        self, kind: str, config: DelivererConfig | None = None, *, resolver: Resolver | None = None
    ) -> None:
        super().__init__(kind, config)
        self.policy = AddressPolicy(self.config.allowed_hosts, self.config.allow_private)
        self.resolver = resolver or system_resolver
        # Made once, here: loading the CA bundle takes a while, and inside a call it
        # would count against that call's deadline.
        self._ssl_context = httpx.create_ssl_context()
        self._client: httpx.AsyncClient | None = None
        install_log_redaction()

    def _client_for_loop(self) -> httpx.AsyncClient:
        if self._client is None:
            limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
            self._client = httpx.AsyncClient(
                transport=GuardedTransport(
                    self.policy,
                    resolver=self.resolver,
                    limits=limits,
                    ssl_context=self._ssl_context,
                ),
                follow_redirects=self.config.follow_redirects,
                max_redirects=self.config.max_redirects,
                # No environment proxies (the guard could not see where a proxy
                # connects) and no .netrc credentials for a payload's URL.
                trust_env=False,
                headers={"User-Agent": self.config.user_agent},
                event_hooks={"request": [_drop_credentials_across_origins]},
            )
        return self._client

    def _headers(self, request: HttpRequest, delivery: Delivery) -> dict[str, str]:
        headers = dict(request.headers)
        headers["Idempotency-Key"] = delivery.idempotency_key
        headers["X-Outbox-Effect-Id"] = str(delivery.effect_id)
        headers["X-Outbox-Attempt"] = str(delivery.attempt)
        if delivery.traceparent is not None:
            # The attempt's span: the sink's own spans join the intent's trace.
            headers["traceparent"] = delivery.traceparent
        if delivery.run_id is not None:
            headers["X-Outbox-Run-Id"] = str(delivery.run_id)
        if request.credential is not None:
            credential = self.config.credentials.get(request.credential)
            if credential is None:
                raise KeyError(request.credential)
            headers[credential.header] = credential.value()
        return headers

    async def deliver(self, delivery: Delivery) -> Outcome:
        """Make the request once, within one deadline; classify the answer."""
        request: HttpRequest = delivery.payload
        try:
            headers = self._headers(request, delivery)
        except KeyError as exc:
            return Failed(f"credential {exc.args[0]!r} is not configured for kind {self.kind!r}")
        except (ConfigurationError, OSError) as exc:
            return Retry(f"credential unavailable: {exc}")
        sent = _SentFlag()
        extensions: dict[str, Any] = {"trace": sent.trace, ORIGIN: _origin(request.url)}
        if request.credential is not None:
            extensions[CREDENTIAL_HEADER] = self.config.credentials[request.credential].header
        client = self._client_for_loop()
        try:
            # One deadline for the whole exchange; httpx's own timeout bounds each
            # read, which a sink trickling a byte at a time never trips.
            async with asyncio.timeout(request.timeout):
                async with client.stream(
                    request.method,
                    request.url,
                    headers=headers,
                    json=request.json_body if request.json_body is not None else None,
                    timeout=request.timeout,
                    extensions=extensions,
                ) as response:
                    body, truncated = await self._read(response)
        except AddressRefused as exc:
            return Failed(str(exc))
        except (TimeoutError, httpx.HTTPError) as exc:
            timed_out = isinstance(exc, TimeoutError | httpx.TimeoutException)
            what = f"timed out after {request.timeout}s" if timed_out else f"{exc}"
            if not sent.value or isinstance(exc, httpx.ConnectError | httpx.PoolTimeout):
                return Retry(f"not sent: {type(exc).__name__}: {what}")  # never reached the sink
            if timed_out:
                reason = f"timed out after {request.timeout}s: no complete answer"
            else:
                reason = f"{type(exc).__name__} after the request was sent: {exc}"
            # A sink that cannot dedup may have applied it: an operator decides.
            return Retry(reason) if self.idempotent else Unknown(reason)
        return self._classify(response, body, truncated)

    async def _read(self, response: httpx.Response) -> tuple[bytes, bool]:
        limit = self.config.read_limit_bytes
        chunks: list[bytes] = []
        size = 0
        async for chunk in response.aiter_bytes():
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                return b"".join(chunks)[:limit], True
        return b"".join(chunks), False

    def _classify(self, response: httpx.Response, body: bytes, truncated: bool) -> Outcome:
        excerpt = body[: self.config.excerpt_bytes].decode("utf-8", errors="replace")
        record = {
            "status": response.status_code,
            "body": excerpt,
            "truncated": truncated or len(body) > self.config.excerpt_bytes,
            "bytes_read": len(body),
        }
        status = response.status_code
        if 200 <= status < 300:
            return Succeeded(record)
        if status in RETRY_STATUSES:
            if not self.idempotent and status not in NOT_PROCESSED_STATUSES:
                return Unknown(f"HTTP {status}: the sink may have applied it", detail=record)
            after = parse_retry_after(
                response.headers.get("Retry-After"), date=response.headers.get("Date")
            )
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
        template = self.config.lookup_url
        if template is None:
            raise NotImplementedError("no lookup_url configured")
        url = template.format(key=quote(delivery.idempotency_key, safe=""))
        headers = {"Idempotency-Key": delivery.idempotency_key}
        extensions: dict[str, Any] = {ORIGIN: _origin(url)}
        if self.config.lookup_credential is not None:
            credential = self.config.credentials.get(self.config.lookup_credential)
            if credential is None:
                raise ConfigurationError(
                    f"lookup_credential {self.config.lookup_credential!r} is not configured"
                )
            headers[credential.header] = credential.value()
            extensions[CREDENTIAL_HEADER] = credential.header
        deadline = self.config.lookup_timeout
        client = self._client_for_loop()
        try:
            async with asyncio.timeout(deadline):
                async with client.stream(
                    "GET", url, headers=headers, timeout=deadline, extensions=extensions
                ) as response:
                    body, _ = await self._read(response)
        except AddressRefused as exc:
            raise PermissionError(str(exc)) from exc
        except TimeoutError as exc:
            raise TimeoutError(f"lookup gave no complete answer within {deadline}s") from exc
        if response.status_code == 404:
            return NotApplied()
        response.raise_for_status()
        try:
            answer = json.loads(body)
        except (ValueError, RecursionError):
            answer = None
        if isinstance(answer, dict) and answer.get("applied") is False:
            return NotApplied()
        recorded = answer.get("response", answer) if isinstance(answer, dict) else None
        return Succeeded(
            {
                "status": response.status_code,
                "looked_up": True,
                "response": recorded,
                "body": body[: self.config.excerpt_bytes].decode("utf-8", errors="replace"),
            }
        )

    @property
    def has_lookup(self) -> bool:
        """Only with a configured ``lookup_url``."""
        return self.config.lookup_url is not None

    async def aclose(self) -> None:
        """Close the HTTP client (it belongs to the daemon's event loop)."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None


#: Request extensions the redirect hook reads: where the call started, and the
#: header that carries its credential.
ORIGIN = "outbox.origin"
CREDENTIAL_HEADER = "outbox.credential_header"


def _origin(url: str | httpx.URL) -> tuple[str, str, int | None]:
    parsed = httpx.URL(url)
    return parsed.scheme, parsed.host, parsed.port


async def _drop_credentials_across_origins(request: httpx.Request) -> None:
    """On a redirect hop to another origin, the credential stays behind.

    httpx drops ``Authorization`` there, but a credential may use any header
    (``X-Api-Key``, say).
    """
    origin = request.extensions.get(ORIGIN)
    if origin is not None and origin != _origin(request.url):
        header = request.extensions.get(CREDENTIAL_HEADER)
        if header is not None:
            request.headers.pop(header, None)
        request.headers.pop("Authorization", None)


class _SentFlag:
    """Set once the request's headers start going out (httpcore's trace events)."""

    def __init__(self) -> None:
        self.value = False

    async def trace(self, event: str, info: dict[str, Any]) -> None:
        if ".send_request_headers." in event:
            self.value = True
