"""The payload of a ``kafka.publish`` effect: one record, checked before it is stored.

The topic name, the headers a payload may set (not the ones the deliverer sets
on every record) and the W3C ``traceparent`` are validated here, so a bad
record is refused when the effect is written, not when it is published.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deliverers.kafka_readback import IDEMPOTENCY_HEADER

__all__ = ["RESERVED_HEADERS", "TRACEPARENT_HEADER", "KafkaRecord"]

#: Header names the deliverer sets on every record; a payload cannot set them.
RESERVED_HEADERS = frozenset({IDEMPOTENCY_HEADER, "run-id", "effect-id"})
TRACEPARENT_HEADER = "traceparent"
TOPIC_RE = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
# W3C trace context, version 00: version-traceid-parentid-flags, lowercase hex.
TRACEPARENT_RE = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


class KafkaRecord(BaseModel):
    """Payload of a ``kafka.publish`` effect: one record."""

    model_config = ConfigDict(extra="forbid")

    topic: str = Field(
        min_length=1,
        max_length=249,
        description="Kafka topic name (ASCII letters, digits, '.', '_', '-').",
        json_schema_extra={"pattern": TOPIC_RE.pattern},
    )
    key: str | None = Field(
        default=None,
        description="Record key (UTF-8); records with the same key go to the same partition.",
    )
    value: Any = Field(
        default=None,
        description="The value as JSON, sent as UTF-8 JSON bytes. Exactly one of value, value_b64.",
    )
    value_b64: str | None = Field(
        default=None, description="The value as raw bytes, base64-encoded."
    )
    headers: dict[str, str] = Field(
        default_factory=dict,
        description="Extra headers; idempotency-key, run-id, effect-id and traceparent are "
        "set by the deliverer.",
    )
    partition: int | None = Field(
        default=None, ge=0, description="A fixed partition; by default the key decides."
    )
    traceparent: str | None = Field(
        default=None,
        description="W3C trace context of the intent, sent as the traceparent header.",
        json_schema_extra={"pattern": TRACEPARENT_RE.pattern},
    )

    @field_validator("topic")
    @classmethod
    def _topic_name(cls, value: str) -> str:
        if value in (".", "..") or not TOPIC_RE.match(value):
            raise ValueError(
                "not a Kafka topic name (1-249 of ASCII letters, digits, '.', '_', '-'; "
                "not '.' or '..')"
            )
        return value

    @field_validator("value_b64")
    @classmethod
    def _base64(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError):
                raise ValueError("not valid base64") from None
        return value

    @field_validator("headers")
    @classmethod
    def _own_headers(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            lower = name.lower()
            if not name:
                raise ValueError("header names must not be empty")
            if lower in RESERVED_HEADERS:
                raise ValueError(f"header {name!r} is reserved: the deliverer sets it")
            if lower == TRACEPARENT_HEADER:
                raise ValueError("set the trace context with the 'traceparent' field")
        return value

    @field_validator("traceparent")
    @classmethod
    def _w3c_traceparent(cls, value: str | None) -> str | None:
        if value is None:
            return None
        match = TRACEPARENT_RE.match(value)
        if (
            match is None
            or match.group(1) == "ff"
            or set(match.group(2)) == {"0"}
            or set(match.group(3)) == {"0"}
        ):
            raise ValueError(
                "not a W3C traceparent ('00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>')"
            )
        return value

    @model_validator(mode="after")
    def _one_value(self) -> KafkaRecord:
        has_json = "value" in self.model_fields_set
        has_bytes = self.value_b64 is not None
        if has_json and has_bytes:
            raise ValueError("set only one of value (JSON) or value_b64 (base64 bytes), not both")
        if not has_json and not has_bytes:
            raise ValueError("set exactly one of value (JSON) or value_b64 (base64 bytes)")
        return self

    def value_bytes(self) -> bytes:
        """The record value as sent."""
        if self.value_b64 is not None:
            return base64.b64decode(self.value_b64, validate=True)
        return json.dumps(self.value, separators=(",", ":"), ensure_ascii=False).encode()
