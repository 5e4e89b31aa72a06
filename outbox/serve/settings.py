"""What ``outbox serve`` accepts: limits, timeouts, and who may do what.

Every limit is checked once here (pydantic), so a NaN tolerance or a negative
timeout is refused when the server is built, naming the field.
Credentials are read from the environment or from files, never from a command
line (which the process list shows).
"""

from __future__ import annotations

import hmac
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from outbox.errors import ConfigurationError
from outbox.serve.hosts import host_entry_problem

__all__ = ["Credentials", "ServeSettings", "read_secret"]

#: Environment variables credentials come from (each ``*_FILE`` twin names a file).
WEBHOOK_SECRET_ENV = "OUTBOX_WEBHOOK_SECRET"
OPERATOR_TOKEN_ENV = "OUTBOX_OPERATOR_TOKEN"
METRICS_TOKEN_ENV = "OUTBOX_METRICS_TOKEN"
API_TOKEN_ENV = "OUTBOX_API_TOKEN"


class ServeSettings(BaseModel):
    """Limits and timeouts of one ``outbox serve`` process."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: Address to listen on (put a TLS-terminating proxy in front to expose it).
    host: str = Field(default="127.0.0.1", min_length=1)
    #: Host names the server answers to (any other ``Host`` is answered 421); a
    #: leading dot allows a domain and its subdomains. Default: the bound address
    #: and localhost. ``/healthz`` answers any name.
    allowed_hosts: tuple[str, ...] | None = None
    #: Port to listen on (0: any free port).
    port: int = Field(default=8080, ge=0, le=65535)
    #: Seconds a signed request stays valid.
    tolerance: float = Field(default=300.0, gt=0, le=86_400)
    #: Largest request body read; past it the request is refused unread (413).
    max_body_bytes: int = Field(default=1024 * 1024, gt=0, le=64 * 1024 * 1024)
    #: Seconds a client has to send a request's headers (slow-header attacks).
    header_timeout: float = Field(default=10.0, gt=0, le=3600)
    #: Seconds a client has to send a request's whole body.
    body_timeout: float = Field(default=30.0, gt=0, le=3600)
    #: Seconds an idle keep-alive connection is kept open.
    idle_timeout: float = Field(default=5.0, gt=0, le=3600)
    #: Requests in progress at once; more are answered 503 (``/healthz`` never is).
    max_concurrency: int = Field(default=100, ge=1, le=100_000)
    #: Open connections from one client address; more are closed at once.
    max_connections_per_client: int = Field(default=32, ge=1, le=100_000)
    #: Open connections in all; past it the oldest one waiting for a request is closed.
    max_connections: int = Field(default=1000, ge=1, le=1_000_000)
    #: Seconds the state counts behind /metrics and the overview are reused.
    counts_cache_seconds: float = Field(default=5.0, ge=0, le=3600)
    #: Serve the operator console (``/console``).
    console: bool = True
    #: The longest an HTTP API long poll (awaiting an effect) may wait, in seconds.
    max_wait: float = Field(default=60.0, gt=0, le=3600)
    #: Seconds between checks of awaited effects (one query for every waiter at once).
    wait_poll: float = Field(default=0.1, gt=0, le=60)

    @field_validator(
        "tolerance",
        "header_timeout",
        "body_timeout",
        "idle_timeout",
        "counts_cache_seconds",
        "max_wait",
        "wait_poll",
    )
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    @field_validator("allowed_hosts")
    @classmethod
    def _host_names(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is None:
            return None
        if not value:
            raise ValueError("name at least one host (or leave it unset for the default)")
        for entry in value:
            problem = host_entry_problem(entry)
            if problem is not None:
                raise ValueError(f"{entry!r} {problem}")
        return value


def read_secret(
    env: Mapping[str, str], name: str, file: Path | None = None, *, required: bool = False
) -> bytes | None:
    """A credential from ``file``, else from ``$name``, else from the file ``$name_FILE``."""
    path = file
    if path is None and env.get(name + "_FILE"):
        path = Path(env[name + "_FILE"])
    if path is not None:
        try:
            value = path.read_bytes().strip()
        except OSError as exc:
            raise ConfigurationError(f"{name}: cannot read {str(path)!r}: {exc.strerror}") from None
        if not value:
            raise ConfigurationError(f"{name}: {str(path)!r} is empty")
        return value
    raw = env.get(name)
    if raw:
        return raw.encode()
    if required:
        raise ConfigurationError(f"{name} is not set (or {name}_FILE): it is required")
    return None


@dataclass(frozen=True)
class Credentials:
    """The secrets one server checks requests against.

    ``webhook_secret`` signs signals (HMAC). ``operator_token`` lets a person
    act in the console (resolve, retry, cancel); without it the console is
    read-only for everyone. ``metrics_token`` is the bearer token ``/metrics``
    wants; the operator token is accepted there too. ``api_token`` is the
    bearer token of the HTTP API (``/api/v1``) agents call; without it the API
    is off. It is the agents' credential only: the operator's and the metrics
    tokens do not open the API, nor does the API token open the console.
    """

    webhook_secret: bytes | None = None
    operator_token: bytes | None = field(default=None, repr=False)
    metrics_token: bytes | None = field(default=None, repr=False)
    api_token: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("webhook_secret", "operator_token", "metrics_token", "api_token"):
            value = getattr(self, name)
            if value is not None and len(value) < 16:
                raise ConfigurationError(f"{name}: must be at least 16 bytes")

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        webhook_secret_file: Path | None = None,
        operator_token_file: Path | None = None,
        metrics_token_file: Path | None = None,
        api_token_file: Path | None = None,
    ) -> Credentials:
        """Read each credential from its file option, its variable, or its ``_FILE`` variable."""
        env = os.environ if environ is None else environ
        return cls(
            webhook_secret=read_secret(env, WEBHOOK_SECRET_ENV, webhook_secret_file),
            operator_token=read_secret(env, OPERATOR_TOKEN_ENV, operator_token_file),
            metrics_token=read_secret(env, METRICS_TOKEN_ENV, metrics_token_file),
            api_token=read_secret(env, API_TOKEN_ENV, api_token_file),
        )

    def is_operator(self, token: str | bytes | None) -> bool:
        """True when ``token`` is the operator credential (constant time)."""
        return _matches(self.operator_token, token)

    def may_scrape(self, token: str | bytes | None) -> bool:
        """True when ``token`` may read ``/metrics``."""
        return _matches(self.metrics_token, token) or _matches(self.operator_token, token)

    def may_call_api(self, token: str | bytes | None) -> bool:
        """True when ``token`` is the HTTP API's credential (constant time)."""
        return _matches(self.api_token, token)


def _matches(expected: bytes | None, given: str | bytes | None) -> bool:
    if expected is None or given is None:
        return False
    raw = given.encode("utf-8", "surrogateescape") if isinstance(given, str) else given
    return hmac.compare_digest(expected, raw)
