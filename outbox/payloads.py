"""JSON at the boundary: encoding, validation, and content hashes.

Everything agent-outbox stores as JSON (inputs, state, plan, step results,
effect payloads) passes through :func:`encode` or :func:`jsonb_text`, so bad
values are refused with the field name before anything is written.

A stored value's hash (an effect's ``payload_hash``, a run's ``inputs_hash``, a
blob's key) is the sha256 of the value's text as PostgreSQL renders its
``jsonb`` (``value::text``): the write functions compute it there, for every
client, and the audit verifier hashes the text it reads back. :func:`jsonb_text`
renders a Python value exactly so, which lets the client answer with an effect's
hash and size before its step commits.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from pydantic import BaseModel

from outbox.errors import PayloadError

__all__ = [
    "DEFAULT_MAX_BYTES",
    "Encoded",
    "content_hash",
    "decode",
    "encode",
    "encode_sized",
    "encode_value",
    "jsonb_sized",
    "jsonb_text",
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
    canonical = functools.partial(
        json.dumps,
        sort_keys=True,
        separators=(",", ":"),
        allow_nan=False,
        ensure_ascii=False,
    )
    return _sized(lambda: canonical(to_jsonable(value)), value, field, max_bytes)


def _sized(render: Callable[[], str], value: Any, field: str, max_bytes: int) -> tuple[str, int]:
    """``render()``'s text and its size in bytes, or :class:`PayloadError` naming ``field``."""
    try:
        text = render()
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


def jsonb_text(value: Any) -> str:
    """``value``'s JSON text as PostgreSQL renders the ``jsonb`` it parses to (``::text``).

    Object keys ordered by their UTF-8 length, then bytes, each once (the last
    wins); ``", "`` and ``": "`` between items; strings escaped as ``json.dumps``
    escapes them with ``ensure_ascii=False``; a float's shortest round-trip
    digits written without an exponent, as ``numeric`` prints them. Raises what
    ``json.dumps`` raises for a value JSON cannot hold (``TypeError``,
    ``ValueError``, ``RecursionError``); :func:`jsonb_sized` turns those into
    :class:`PayloadError`.
    """
    parts: list[str] = []
    _render(to_jsonable(value), parts.append)
    return "".join(parts)


def jsonb_sized(value: Any, *, field: str, max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[str, int]:
    """:func:`jsonb_text` and its size in bytes (UTF-8), or :class:`PayloadError` naming ``field``.

    Refused: what JSON cannot hold (NaN and Infinity, types it has no form for,
    integers too long to print, nesting too deep), NUL characters and lone
    surrogates (not text ``jsonb`` can hold), and a text over ``max_bytes``.
    """
    return _sized(lambda: jsonb_text(value), value, field, max_bytes)


_dumps_string = json.JSONEncoder(ensure_ascii=False).encode


def _key_text(key: Any) -> str:
    """An object key as ``json.dumps`` turns it into text."""
    if isinstance(key, str):
        return key
    if key is True or key is False or key is None:
        return json.dumps(key)
    if isinstance(key, int | float):
        return _number(key)
    raise TypeError(f"keys must be str, int, float, bool or None, not {type(key).__name__}")


def _number(value: int | float) -> str:
    if isinstance(value, int):
        return int.__repr__(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"Out of range float values are not JSON compliant: {value!r}")
    text = float.__repr__(value)
    if value == 0:
        return "0.0"  # numeric has no negative zero
    if "e" not in text:
        return text
    # numeric prints the value of the shortest digits with a scale of
    # max(0, -exponent), never an exponent: 1e+16 as 10000000000000000.
    return format(Decimal(text), "f")


def _render(value: Any, out: Any) -> None:
    if value is None:
        out("null")
    elif value is True:
        out("true")
    elif value is False:
        out("false")
    elif isinstance(value, str):
        out(_dumps_string(value))
    elif isinstance(value, int | float):
        out(_number(value))
    elif isinstance(value, dict):
        items: dict[str, Any] = {}
        for key, item in value.items():
            items[_key_text(key)] = item
        if not items:
            out("{}")
            return
        out("{")
        for n, key in enumerate(sorted(items, key=_key_order)):
            if n:
                out(", ")
            out(_dumps_string(key))
            out(": ")
            _render(items[key], out)
        out("}")
    elif isinstance(value, list | tuple):
        if not value:
            out("[]")
            return
        out("[")
        for n, item in enumerate(value):
            if n:
                out(", ")
            _render(item, out)
        out("]")
    else:
        raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _key_order(key: str) -> tuple[int, bytes]:
    data = key.encode("utf-8", "surrogatepass")
    return len(data), data


#: The one key of a reference to a value stored once, by its hash (``outbox.blobs``):
#: a caller's value of that shape would read back as another value.
RESERVED_KEY = "__outbox_blob__"


@dataclass(frozen=True, slots=True)
class Encoded:
    """A value as a write sends it: its JSON text (as ``jsonb`` renders it) and size."""

    json: str
    size: int

    def value(self) -> Any:
        """The value, as a reader gets it back."""
        return json.loads(self.json)

    @property
    def hash(self) -> str:
        """Its content hash, as the database computes it (``payload_hash``, ``inputs_hash``)."""
        return content_hash(self.json)


def encode_value(value: Any, *, field: str, max_bytes: int = DEFAULT_MAX_BYTES) -> Encoded:
    """``value`` encoded for a write, or :class:`PayloadError` naming ``field``.

    Also refused: a top-level object with the key of a reference (``__outbox_blob__``).
    """
    if isinstance(value, dict) and RESERVED_KEY in value:
        raise PayloadError(
            field, f"<object with {RESERVED_KEY!r}>", f"{RESERVED_KEY!r} is reserved"
        )
    return Encoded(*jsonb_sized(value, field=field, max_bytes=max_bytes))
