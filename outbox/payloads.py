"""JSON at the boundary: canonical encoding, validation, and content hashes.

Everything agent-outbox stores as JSON (inputs, state, plan, step results,
effect payloads) passes through :func:`encode`, so bad values are refused with
the field name before anything is written, and equal values hash equally.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from pydantic import BaseModel

from outbox.errors import PayloadError

__all__ = [
    "DEFAULT_MAX_BYTES",
    "content_hash",
    "decode",
    "encode",
    "encode_sized",
    "to_jsonable",
]

DEFAULT_MAX_BYTES = 1024 * 1024
# An escape \u0000 preceded by an even number of backslashes (each pair is one literal "\\").
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def to_jsonable(value: Any) -> Any:
    """Turn pydantic models into plain JSON data; leave everything else as is."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return value


def encode(value: Any, *, field: str, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """Return the canonical JSON text of ``value`` or raise :class:`PayloadError`.

    Canonical means sorted keys and no insignificant whitespace, so the text can
    be hashed to compare payloads. NaN and Infinity are refused (JSON has no such
    numbers and PostgreSQL's jsonb rejects them), and so are NUL characters,
    which jsonb cannot store, lone surrogates (not text), values nested too
    deeply to encode and integers too long to print.
    """
    return encode_sized(value, field=field, max_bytes=max_bytes)[0]


def encode_sized(value: Any, *, field: str, max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[str, int]:
    """:func:`encode`, also returning the text's size in bytes (UTF-8)."""
    try:
        text = json.dumps(
            to_jsonable(value),
            sort_keys=True,
            separators=(",", ":"),
            allow_nan=False,
            ensure_ascii=False,
        )
    except RecursionError:
        raise PayloadError(field, value, "nested too deeply to store as JSON") from None
    except ValueError as exc:  # NaN / Infinity, circular references, 4300+ digit integers
        reason = f"not valid JSON: {exc}"
        if "integer string conversion" in str(exc):
            reason = "holds an integer too long to write (over 4300 digits)"
        raise PayloadError(field, value, reason) from exc
    except TypeError as exc:
        raise PayloadError(field, value, f"not JSON-serialisable: {exc}") from exc
    # json.dumps writes a NUL as the escape \u0000; a literal backslash before
    # "u0000" is written as \\u0000, which is text, not a NUL (so look closer).
    if "\\u0000" in text and _NUL_ESCAPE.search(text) is not None:
        raise PayloadError(field, value, "contains a NUL character, which PostgreSQL cannot store")
    try:
        size = len(text.encode())
    except UnicodeEncodeError:
        raise PayloadError(
            field, value, "contains a lone surrogate, which is not valid Unicode text"
        ) from None
    if size > max_bytes:
        raise PayloadError(
            field, f"<{size} bytes>", f"is {size} bytes, over the limit of {max_bytes} bytes"
        )
    return text, size


def decode(text: str | None) -> Any:
    """Parse stored JSON text (``None`` stays ``None``)."""
    return None if text is None else json.loads(text)


def content_hash(canonical_json: str) -> str:
    """Hex sha256 of a canonical JSON text: equal payloads, equal hashes."""
    return hashlib.sha256(canonical_json.encode()).hexdigest()
