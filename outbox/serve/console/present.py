"""How the console shows values: secrets redacted, times as ages, the delivery chart as SVG."""

from __future__ import annotations

import json
import re
from collections.abc import Sized
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from markupsafe import Markup, escape

from outbox.governance.intent_rules import CREDENTIAL_SCHEMES, credential_name
from outbox.storage import views

__all__ = [
    "age",
    "clip",
    "delivery_chart",
    "next_attempt",
    "pretty",
    "redact",
    "redact_text",
    "shown",
]

REDACTED = "[redacted]"
_MAX_DEPTH = 50
#: Display-only additions to the intent rules' table: OAuth's authorization code.
_EXTRA_URL_PARAMETERS = frozenset({"code"})
# Any URL in a text (an exception message quotes the URL it failed on).
_URL_IN_TEXT = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s\"'<>`]+")
# A scheme and its secret anywhere in a text. The rules refuse a header value that
# is exactly this with a secret of 16+ characters; a reader hides shorter ones too
# (8+: "Token expired" stays readable), and a value that is a scheme and one word.
_SECRET = r"[A-Za-z0-9._~+/-]{8,}=*"
_SCHEME_IN_TEXT = re.compile(rf"\b({CREDENTIAL_SCHEMES})(\s+){_SECRET}", re.IGNORECASE)
_SCHEME_ALONE = re.compile(rf"^\s*({CREDENTIAL_SCHEMES})\s+\S+\s*$", re.IGNORECASE)
# ``name=value``, ``name: value``, ``"name": "value"`` where the name carries a credential.
_NAMED_VALUE = re.compile(
    r"(?P<name>[A-Za-z][A-Za-z0-9_.-]{1,63})(?P<sep>[\"']?\s*[:=]\s*[\"']?)"
    rf"(?P<value>(?:(?:{CREDENTIAL_SCHEMES})\s+)?[^\s\"'&;,)\]}}\[][^\s\"'&;,)\]}}]*)",
    re.IGNORECASE,
)
# A JSON Web Token, whatever surrounds it.
_JWT = re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*")


class Shown(str):
    """Text already redacted (the page's last pass skips it)."""

    __slots__ = ()


def redact_text(text: str) -> str:
    """``text`` with credentials replaced, wherever they sit in it.

    URLs lose their userinfo and the values of credential parameters; an
    authorization scheme (``Bearer``, ``Basic``, ``Token``, ``ApiKey``, ``Key``,
    ``SSWS``, ``OAuth``) loses the secret after it; ``name=value`` and
    ``name: value`` lose the value when the name carries a credential (the intent
    rules' table: ``authorization``, ``password``, ``api_key``, ``token``, ...);
    JSON Web Tokens are hidden whole.
    """
    if _SCHEME_ALONE.match(text):
        return REDACTED
    text = _URL_IN_TEXT.sub(lambda m: _redact_url(m[0]), text)
    text = _JWT.sub(REDACTED, text)
    text = _SCHEME_IN_TEXT.sub(lambda m: f"{m[1]}{m[2]}{REDACTED}", text)
    return _NAMED_VALUE.sub(_named, text)


def _named(match: re.Match[str]) -> str:
    if match["value"] == REDACTED or not credential_name(match["name"]):
        return match[0]
    return f"{match['name']}{match['sep']}{REDACTED}"


def redact(value: Any, _depth: int = 0) -> Any:
    """``value`` with secrets replaced: values of credential fields, and :func:`redact_text`.

    Applied to every payload, result, state, signal and attempt detail the
    console shows; the stored data is untouched. A field is a credential by the
    intent rules' table (``outbox.governance.intent_rules.credential_name``).
    """
    if _depth > _MAX_DEPTH:
        return "…"
    if isinstance(value, dict):
        return {
            k: (REDACTED if credential_name(str(k)) else redact(v, _depth + 1))
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [redact(v, _depth + 1) for v in value]
    if isinstance(value, str):
        return redact_text(value)
    return value


def _redact_url(url: str) -> str:
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            netloc = f"{REDACTED}@{netloc.rsplit('@', 1)[1]}"
        query = _redact_parameters(parts.query)
        fragment = _redact_parameters(parts.fragment) if "=" in parts.fragment else parts.fragment
        return urlunsplit((parts.scheme, netloc, parts.path, query, fragment))
    except ValueError:
        return REDACTED


def _redact_parameters(text: str) -> str:
    if not text:
        return text
    pairs = parse_qsl(text, keep_blank_values=True)
    return urlencode(
        [
            (k, REDACTED if credential_name(k, in_url=True) or k in _EXTRA_URL_PARAMETERS else v)
            for k, v in pairs
        ],
        safe="[]",
    )


def clip(value: Any, length: int) -> str:
    """Redacted text cut to ``length`` characters, with an ellipsis when cut.

    Redacted first: cutting first could leave the head of a secret too short to
    recognise.
    """
    text = redact_text(str(value or ""))
    return Shown(text if len(text) <= length else text[: length - 1] + "…")


def last_pass(value: Any) -> Any:
    """Jinja's ``finalize``: every text a page prints is redacted, unless it was already."""
    if isinstance(value, str) and not isinstance(value, (Shown, Markup)):
        return redact_text(value)
    return value


def pretty(value: Any, *, secret_safe: bool = True) -> str:
    """Indented JSON for a ``<pre>`` (redacted unless told otherwise)."""
    shown = redact(value) if secret_safe else value
    text = json.dumps(shown, indent=2, sort_keys=True, default=str, ensure_ascii=False)
    return Shown(text) if secret_safe else text


def shown(items: Sized) -> str:
    """How many rows a page part shows: their count, or "the first N" when it hit its cap.

    A run's steps and effects and an effect's attempt log stop at
    ``views.PART_LIMIT`` rows; a bare count would pass for the whole.
    """
    cap = views.PART_LIMIT
    return f"the first {cap}" if len(items) >= cap else str(len(items))


def age(moment: datetime | None, now: datetime | None = None) -> str:
    """``3m ago`` / ``in 2h`` for a timestamp; empty for None."""
    if moment is None:
        return ""
    now = now or datetime.now(UTC)
    delta = now - moment
    future = delta < timedelta(0)
    seconds = abs(delta.total_seconds())
    if seconds < 1:
        text = "now"
        return text
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size:
            text = f"{int(seconds // size)}{unit}"
            break
    return f"in {text}" if future else f"{text} ago"


#: Further off than any delay a caller may ask for (ten years): the hold of an effect
#: of a stopping run (``outbox_effects_hold_paused``: a hundred years ahead).
_HELD_BEYOND = timedelta(days=20 * 365)


def next_attempt(effect: Any, now: datetime | None = None) -> str:
    """When an effect is due next, or why never: the hold of a stopping run's effect."""
    due = effect.available_at
    if due is None:
        return ""
    if effect.status == "pending" and due - (now or datetime.now(UTC)) > _HELD_BEYOND:
        return "never: its run is being stopped (the stopping sweep cancels it)"
    return str(due.isoformat())


def duration(seconds: float | None) -> str:
    """``850 ms`` / ``2.4 s`` / ``3m 10s``."""
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m {int(seconds % 60)}s"
    return f"{seconds / 3600:.1f} h"


def delivery_chart(
    buckets: list[dict[str, Any]], *, now: datetime | None = None, minutes: int = 60
) -> Markup:
    """Delivered effects per minute (bars) and p95 latency (line) over the last hour, as SVG."""
    now = (now or datetime.now(UTC)).replace(second=0, microsecond=0)
    start = now - timedelta(minutes=minutes - 1)
    by_minute = {b["minute"]: b for b in buckets if b.get("minute") is not None}
    counts, p95s = [], []
    for i in range(minutes):
        bucket = by_minute.get(start + timedelta(minutes=i))
        counts.append(int(bucket["delivered"]) if bucket else 0)
        p95s.append(float(bucket["p95"]) if bucket and bucket["p95"] is not None else None)
    width, height, pad = 600, 140, 22
    plot_h = height - 2 * pad
    bar_w = (width - 2 * pad) / minutes
    top_count = max(counts) or 1
    top_p95 = max((p for p in p95s if p is not None), default=0.0) or 1.0
    parts = [
        f'<svg class="chart" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="effects delivered per minute and p95 latency, last {minutes} minutes" '
        f'xmlns="http://www.w3.org/2000/svg">',
        f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" '
        'stroke="#999" stroke-width="1"/>',
    ]
    for i, n in enumerate(counts):
        if n:
            h = plot_h * n / top_count
            x = pad + i * bar_w
            parts.append(
                f'<rect x="{x:.1f}" y="{height - pad - h:.1f}" width="{max(bar_w - 1, 1):.1f}" '
                f'height="{h:.1f}" fill="#5b8def"><title>{n} delivered</title></rect>'
            )
    points = [
        f"{pad + (i + 0.5) * bar_w:.1f},{height - pad - plot_h * p / top_p95:.1f}"
        for i, p in enumerate(p95s)
        if p is not None
    ]
    if points:
        parts.append(
            f'<polyline points="{" ".join(points)}" fill="none" stroke="#e07b39" stroke-width="2"/>'
        )
    parts += [
        f'<text x="{pad}" y="14" font-size="11" fill="#5b8def">max {top_count}/min</text>',
        f'<text x="{width - pad}" y="14" font-size="11" fill="#e07b39" text-anchor="end">'
        f"p95 max {escape(duration(top_p95 if points else None))}</text>",
        f'<text x="{pad}" y="{height - 6}" font-size="10" fill="#666">-{minutes} min</text>',
        f'<text x="{width - pad}" y="{height - 6}" font-size="10" fill="#666" '
        'text-anchor="end">now</text>',
        "</svg>",
    ]
    return Markup("".join(parts))
