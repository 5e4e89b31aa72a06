"""How the console shows values: secrets redacted, times as ages, the delivery chart as SVG."""

from __future__ import annotations

import json
import re
from collections.abc import Sized
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from markupsafe import Markup, escape

from outbox.storage import views

__all__ = ["age", "delivery_chart", "pretty", "redact", "shown"]

REDACTED = "[redacted]"
#: Object keys (and URL query parameters) whose values are never shown.
_SECRET_NAME = re.compile(
    r"(authori[sz]ation|passw(or)?d|passwd|secret|token|api[-_]?key|apikey|cookie|"
    r"credential|private[-_]?key|session|signature|sig$|^auth$|^key$|x-amz-|client[-_]?secret)",
    re.IGNORECASE,
)
_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
_BEARER = re.compile(r"^(bearer|basic|token)\s+\S+", re.IGNORECASE)
_MAX_DEPTH = 50


def redact(value: Any, _depth: int = 0) -> Any:
    """``value`` with secrets replaced: values of secret-looking keys, URL userinfo and tokens.

    Applied to every payload, result and attempt detail the console shows; the
    stored data is untouched.
    """
    if _depth > _MAX_DEPTH:
        return "…"
    if isinstance(value, dict):
        return {
            k: (REDACTED if _SECRET_NAME.search(str(k)) else redact(v, _depth + 1))
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [redact(v, _depth + 1) for v in value]
    if isinstance(value, str):
        if _BEARER.match(value):
            return REDACTED
        if _URL.match(value):
            return _redact_url(value)
    return value


def _redact_url(url: str) -> str:
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            netloc = f"{REDACTED}@{netloc.rsplit('@', 1)[1]}"
        query = parts.query
        if query:
            pairs = parse_qsl(query, keep_blank_values=True)
            query = urlencode(
                [
                    (k, REDACTED if _SECRET_NAME.search(k) or k in _TOKEN_PARAMS else v)
                    for k, v in pairs
                ]
            )
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    except ValueError:
        return REDACTED


_TOKEN_PARAMS = {"code", "access_token", "refresh_token", "id_token", "sig", "x-amz-signature"}


def pretty(value: Any, *, secret_safe: bool = True) -> str:
    """Indented JSON for a ``<pre>`` (redacted unless told otherwise)."""
    shown = redact(value) if secret_safe else value
    return json.dumps(shown, indent=2, sort_keys=True, default=str, ensure_ascii=False)


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
