"""Large values by reference: a row holds a small reference, the value is stored once elsewhere.

Inputs, state, plan, step results, run results, effect payloads and signal
payloads larger than ``Settings.blob_threshold_bytes`` are stored once,
content-addressed by the sha256 of their canonical JSON, in ``outbox_blobs``;
the row holds ``{"__outbox_blob__": {"sha256": ..., "bytes": ...}}`` instead.
Hot rows (the claim reads them) stay small whatever the value's size, and a
value written many times (a long transcript in every step's state) is stored
once. Readers get the value back transparently: the store resolves references
after reading rows (:mod:`outbox.storage.blob_store`), and a deliverer fetches
a payload just before calling its sink; claims never read blobs.

This module only decides and recognises references (no I/O). A top-level
caller value of the reference's shape is refused, so a reference can never be
forged by a payload.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from outbox.errors import PayloadError
from outbox.payloads import content_hash, encode_sized

__all__ = [
    "BLOB_KEY",
    "Blob",
    "Stored",
    "ValueLimits",
    "is_reference",
    "reference_hash",
    "reference_hashes",
    "store_value",
]

#: The one key of a reference object.
BLOB_KEY = "__outbox_blob__"


@dataclass(frozen=True, slots=True)
class ValueLimits:
    """How large a value may be, and above what size it is stored by reference."""

    max_bytes: int
    threshold_bytes: int


@dataclass(frozen=True, slots=True)
class Blob:
    """A value stored by reference: its canonical JSON and that text's sha256."""

    sha256: str
    text: str
    size: int


@dataclass(frozen=True, slots=True)
class Stored:
    """What a row holds for one value (its JSON or a reference's), and the blob if any."""

    json: str
    size: int
    blob: Blob | None = None

    @property
    def value_json(self) -> str:
        """The value's own canonical JSON (the blob's text when stored by reference)."""
        return self.json if self.blob is None else self.blob.text


def is_reference(value: Any) -> bool:
    """True when ``value`` (as read from a row) is a reference to a blob."""
    return (
        isinstance(value, dict)
        and len(value) == 1
        and isinstance(inner := value.get(BLOB_KEY), dict)
        and isinstance(inner.get("sha256"), str)
    )


def reference_hash(value: Any) -> str | None:
    """The sha256 a reference names, or None when ``value`` is not a reference."""
    return value[BLOB_KEY]["sha256"] if is_reference(value) else None


def reference_hashes(values: Iterable[Any]) -> set[str]:
    """The blobs some of ``values`` refer to."""
    return {h for v in values if (h := reference_hash(v)) is not None}


def _reference_json(sha256: str, size: int) -> str:
    # Canonical (sorted keys, no spaces), as encode() writes every other value.
    return f'{{"{BLOB_KEY}":{{"bytes":{size},"sha256":"{sha256}"}}}}'


def store_value(value: Any, *, field: str, limits: ValueLimits) -> Stored:
    """Encode ``value`` for a row: inline, or (over the threshold) as a reference to a blob.

    Raises :class:`~outbox.PayloadError` for what :func:`outbox.payloads.encode`
    refuses, for a value over ``limits.max_bytes``, and for a top-level object
    shaped like a reference (it would be read back as another value).
    """
    if isinstance(value, dict) and BLOB_KEY in value:
        raise PayloadError(field, f"<object with {BLOB_KEY!r}>", f"{BLOB_KEY!r} is reserved")
    text, size = encode_sized(value, field=field, max_bytes=limits.max_bytes)
    if size <= limits.threshold_bytes:
        return Stored(text, size)
    sha = content_hash(text)
    return Stored(_reference_json(sha, size), size, Blob(sha, text, size))
