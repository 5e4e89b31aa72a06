"""How the performance page shows a figure: medians, ranges, ratios, table cells.

A table is a string of columns ``HEADER=KEY[:F]`` joined by ``" | "``. ``KEY`` is
a dotted path into a row's record; ``F`` formats it: ``r2`` median (min-max)
with 2 decimals, ``m0`` the median, ``x2`` a ratio (``1.23x``); without ``F``
the value is shown as it is. Templates (``{key:,.0f}``) are filled with the
medians of a record.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

DISCUSSION = "discussions/performance.md"
VERDICT = {True: "met", False: "**missed**", None: "—"}


def get(data: Any, *path: str) -> Any:
    """``data[path[0]][path[1]]...``, or None where any step is missing."""
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


def med(s: Any) -> float | None:
    """The median of a summary, or a plain number."""
    if isinstance(s, dict):
        s = s.get("median")
    return float(s) if isinstance(s, int | float) else None


def num(x: float | None, digits: int = 0) -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}"


def rng(s: Any, digits: int = 0, unit: str = "") -> str:
    """``median (min-max)`` of a summary; a plain number as is."""
    if isinstance(s, dict) and "median" in s and s["min"] != s["max"]:
        lo, hi = f"{s['min']:,.{digits}f}", f"{s['max']:,.{digits}f}"
        return f"{s['median']:,.{digits}f}{unit} ({lo}-{hi})"
    return num(med(s), digits) + unit * (med(s) is not None)


def div(a: Any, b: Any) -> float | None:
    a, b = med(a), med(b)
    return a / b if a is not None and b else None


def keys(section: Any) -> list[str]:
    """The numeric keys of a section (writers, clients, sizes), in order."""
    return sorted((k for k in section or {} if k.isdigit()), key=int)


def fill(template: str, record: dict[str, Any]) -> str:
    """``template`` filled with the medians of ``record``'s figures."""
    values = {k: med(v) if med(v) is not None else v for k, v in record.items()}
    # A figure a saved run predates reads "nan" rather than failing the page.
    return template.format_map(defaultdict(lambda: float("nan"), values))


def cell(record: dict[str, Any], spec: str) -> str:
    key, _, f = spec.partition(":")
    value = get(record, *key.split("."))
    if not f:
        return "n/a" if value is None else str(value)
    digits = int(f[1:])
    return rng(value, digits) if f[0] == "r" else rng(med(value), digits, "x" * (f[0] == "x"))


def table(columns: str, records: Iterable[dict[str, Any]]) -> str:
    heads, specs = zip(*(c.rsplit("=", 1) for c in columns.split(" | ")), strict=True)
    rows = ["| " + " | ".join(cell(rec, s) for s in specs) + " |" for rec in records]
    head = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    return "\n".join(head + rows) if rows else ""
