"""Frozen settings with named defaults. Environment variables are read only by :meth:`from_env`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from outbox.blobs import ValueLimits
from outbox.errors import ConfigurationError
from outbox.shards import DEFAULT_NAMESPACE, NAMESPACE_PATTERN

__all__ = ["ENV_PREFIX", "Settings"]

ENV_PREFIX = "OUTBOX_"
#: The largest value (inputs, state, a step result, a payload) by default.
DEFAULT_MAX_VALUE_BYTES = 64 * 1024 * 1024
#: Values over this many bytes are stored once, by reference (:mod:`outbox.blobs`).
DEFAULT_BLOB_THRESHOLD_BYTES = 16 * 1024
#: PostgreSQL's limit for one text value; a blob is one.
MAX_VALUE_BYTES = 1024 * 1024 * 1024 - 1
DEFAULT_MAX_STEP_INTENTS = 10_000
DEFAULT_MAX_STEP_BYTES = 64 * 1024 * 1024
#: A step's intents travel as one text parameter, which PostgreSQL caps at 1 GB.
MAX_STEP_BYTES = 512 * 1024 * 1024


class Settings(BaseModel):
    """How an :class:`~outbox.Outbox` connects and what it accepts.

    ``dsn`` ``None`` means the embedded PostgreSQL in ``home`` (started on demand
    and shared by every process on the machine that uses the same ``home``).
    :meth:`from_env` reads it from ``OUTBOX_DSN``, or from the file named by
    ``OUTBOX_DSN_FILE``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: PostgreSQL DSN (``postgresql://user@host/db``; also read from the file named
    #: by ``OUTBOX_DSN_FILE``). None: the embedded server in ``home``.
    dsn: str | None = None
    #: Directory of the embedded PostgreSQL, started on demand and shared by every
    #: process that uses the same ``home``.
    home: Path = Field(default=Path(".outbox"))
    #: The largest value: inputs, state, plan, a step result, a payload, a signal's payload.
    #: Above the default (as for the other ``max_`` caps) PostgreSQL also needs the
    #: database's own ``ALTER DATABASE ... SET outbox.max_payload_bytes``: a session
    #: can only lower a cap.
    max_payload_bytes: int = Field(default=DEFAULT_MAX_VALUE_BYTES, gt=0, le=MAX_VALUE_BYTES)
    #: Values larger than this are stored once, by reference, outside the hot rows.
    blob_threshold_bytes: int = Field(default=DEFAULT_BLOB_THRESHOLD_BYTES, ge=0)
    #: At most this many intents in one step or transaction (they are written
    #: in one statement; a runaway loop should fail here, not in PostgreSQL).
    max_step_intents: int = Field(default=DEFAULT_MAX_STEP_INTENTS, gt=0)
    #: At most this many bytes of intent payloads (and compensations) in one step.
    max_step_bytes: int = Field(default=DEFAULT_MAX_STEP_BYTES, gt=0, le=MAX_STEP_BYTES)
    #: Longest step id, in characters.
    max_step_id_length: int = Field(default=200, gt=0)
    #: Connections this process keeps open (as many again may open in overflow),
    #: handed out last in, first out; one idle 10 s or more is pinged before use.
    pool_size: int = Field(default=5, gt=0)
    #: Our sessions never sit idle inside a transaction longer (0: no limit): an open
    #: transaction stops vacuum and slows every claim.
    # (DESIGN.md, lessons; PostgreSQL takes at most a signed 32-bit number of ms.)
    idle_in_transaction_timeout_ms: int = Field(default=60_000, ge=0, le=2**31 - 1)
    #: A writer sends at most one wake-up NOTIFY per window inline; the commits in
    #: between are covered by one trailing NOTIFY (``outbox.storage.notify.WakeupThrottle``).
    notify_window_ms: float = Field(default=3.0, ge=0)
    #: None: migrate the embedded server only (another database is migrated with
    #: ``outbox migrate``); True or False: always or never.
    auto_migrate: bool | None = None
    #: The namespace (a tenant, a team) this client's runs and intents are in: a
    #: business key or a caller's idempotency key is unique within its namespace.
    namespace: str = Field(default=DEFAULT_NAMESPACE, pattern=NAMESPACE_PATTERN)

    @property
    def value_limits(self) -> ValueLimits:
        """The size limit and the by-reference threshold of stored values."""
        return ValueLimits(self.max_payload_bytes, self.blob_threshold_bytes)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Build settings from ``OUTBOX_*`` variables; keyword overrides win."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            raw = env.get(ENV_PREFIX + name.upper())
            if raw is not None and raw != "":
                values[name] = raw
        dsn_file = env.get(ENV_PREFIX + "DSN_FILE")
        if dsn_file and "dsn" in values and overrides.get("dsn") is None:
            raise ConfigurationError(
                f"{ENV_PREFIX}DSN and {ENV_PREFIX}DSN_FILE are both set: keep one"
            )
        if dsn_file and overrides.get("dsn") is None:
            # A secret mounted as a file keeps the password out of the environment too.
            try:
                values["dsn"] = Path(dsn_file).read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigurationError(f"{ENV_PREFIX}DSN_FILE={dsn_file!r}: {exc}") from exc
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**values)
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"])
            raise ConfigurationError(
                f"{ENV_PREFIX}{field.upper()}={first.get('input')!r}: {first['msg']}"
            ) from exc
