r"""Make what a sink or a deliverer returned storable: text escaped, numbers finite, sizes capped.

A deliverer's outcome is outside input: a sink's error page may be UTF-16 or
binary (NUL bytes), a Python function's error message may hold a lone
surrogate, a result may hold ``NaN``. PostgreSQL's ``text`` and ``jsonb``
refuse NUL characters, lone surrogates and non-finite numbers, and one such
value would fail the whole completion statement of its batch. So every string,
number and structure of an outcome passes through here before it reaches SQL:

- a NUL becomes the four characters ``\x00`` and an unencodable character
  (a lone surrogate) its ``\udXXX`` escape, as Python's ``repr`` writes them;
- a non-finite float becomes its name as a string (``"nan"``, ``"inf"``);
  an integer too long for JSON text becomes a note of its size;
- anything else that is not JSON (bytes, objects) becomes its text;
- nesting deeper than :data:`MAX_DEPTH` and containers longer than
  :data:`MAX_ITEMS` are cut, with a note;
- text and JSON are capped in bytes; a JSON value over its cap is replaced by
  ``{"unrecordable": <why>, "excerpt": <its first bytes as text>}``.

Well-formed values (nearly all of them) take the fast path: one ``json.dumps``
in C and two scans of its text.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

__all__ = [
    "MAX_DEPTH",
    "MAX_DETAIL_BYTES",
    "MAX_ERROR_BYTES",
    "MAX_ITEMS",
    "storable_json",
    "storable_text",
]

#: ``last_error`` and other reasons are kept up to this many bytes of UTF-8.
MAX_ERROR_BYTES = 4096
#: The attempt log's ``detail`` of one attempt is kept up to this many bytes.
MAX_DETAIL_BYTES = 16 * 1024
#: Deeper nesting is cut (a cycle is cut here too).
MAX_DEPTH = 32
#: Longer lists and objects are cut.
MAX_ITEMS = 10_000
#: Bytes of the JSON text kept as the excerpt of a value over its cap.
EXCERPT_BYTES = 2048
#: Integers longer than this many bits are stored as a note (JSON text of a
#: longer one is refused by Python's int-to-str limit, and means nothing here).
MAX_INT_BITS = 3000


def _escape(text: str) -> str:
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates (from surrogateescape'd bytes, say)
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _cut(text: str, max_bytes: int) -> str:
    data = text.encode("utf-8")
    if len(data) <= max_bytes:
        return text
    marker = f" ... [{len(data)} bytes, cut to {max_bytes}]"
    keep = max(0, max_bytes - len(marker.encode()))
    # errors="ignore" drops a character split by the cut
    return data[:keep].decode("utf-8", errors="ignore") + marker


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("utf-8", errors="backslashreplace")
    try:
        return str(value)
    except Exception:  # a __str__ that raises is the deliverer's bug, not a reason to wedge
        return f"<unprintable {type(value).__name__}>"


def storable_text(value: Any, *, max_bytes: int = MAX_ERROR_BYTES) -> str:
    """``value`` as text PostgreSQL stores: NULs and invalid characters escaped, capped."""
    return _cut(_escape(_as_text(value)), max_bytes)


def _clean(value: Any, depth: int) -> Any:
    if value is None or isinstance(value, bool | str):
        return _escape(value) if isinstance(value, str) else value
    if isinstance(value, int):
        if value.bit_length() > MAX_INT_BITS:
            return f"<integer of {value.bit_length()} bits>"
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else str(value)
    if depth >= MAX_DEPTH:
        return f"<nested deeper than {MAX_DEPTH} levels>"
    if isinstance(value, BaseModel):
        return _clean(value.model_dump(mode="json"), depth)
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for i, (key, item) in enumerate(value.items()):
            if i >= MAX_ITEMS:
                out["..."] = f"<{len(value) - MAX_ITEMS} more entries cut>"
                break
            out[_escape(_as_text(key))] = _clean(item, depth + 1)
        return out
    if isinstance(value, list | tuple | set | frozenset):
        items = list(value)
        cleaned = [_clean(item, depth + 1) for item in items[:MAX_ITEMS]]
        if len(items) > MAX_ITEMS:
            cleaned.append(f"<{len(items) - MAX_ITEMS} more items cut>")
        return cleaned
    return _escape(_as_text(value))


# One encoder, made once: json.dumps with any option builds a new one per call,
# which costs more than encoding a small result.
_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _fast(value: Any) -> str | None:
    """The JSON text when ``value`` is already storable as it is, else None."""
    try:
        text = _ENCODER.encode(value)
    except (TypeError, ValueError, RecursionError):
        return None
    # json escapes a NUL as \u0000; a literal backslash-u0000 text shows up here
    # too and merely takes the slow path, which leaves it as it is.
    if "\\u0000" in text:
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return text


def storable_json(value: Any, *, max_bytes: int) -> str | None:
    """JSON text of ``value`` that PostgreSQL's ``jsonb`` accepts, at most ``max_bytes``.

    ``None`` stays ``None`` (SQL NULL).
    """
    if value is None:
        return None
    text = _fast(value)
    if text is None:
        text = _ENCODER.encode(_clean(value, 0))
    size = len(text.encode("utf-8"))
    if size <= max_bytes:
        return text
    return json.dumps(
        {
            "unrecordable": f"{size} bytes of JSON, over the limit of {max_bytes} bytes",
            "excerpt": _cut(text, min(EXCERPT_BYTES, max(0, max_bytes // 2))),
        },
        ensure_ascii=False,
    )
