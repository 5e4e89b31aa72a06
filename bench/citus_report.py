"""How ``python -m bench``'s page shows the ``citus`` section (bench/citus.py measures it)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

#: The two databases measured side by side, in the table's order.
DATABASES = ("plain", "citus")

TABLE = (
    "database=what | steps/s, 1 writer=steps_per_s_1 | steps/s, 4 writers=steps_per_s_4"
    " | coordinator CPU µs/step=coordinator_cpu_us_per_step"
    " | workers CPU µs/step=workers_cpu_us_per_step | deliveries/s=effects_per_s"
)
CAPTION = (
    "A plain database on the coordinator's server and one over two workers; 3 servers"
    " share the cores. CPU per step: 4 writers, per server, from /proc."
)
TARGETS = {
    "steps_per_s_1": "a step with one intent, 1 writer",
    "steps_per_s_4": "a step with one intent, 4 writers",
    "effects_per_s": "deliveries",
}


def ratios(section: dict[str, Any] | None) -> Iterator[tuple[str, float, float, Any]]:
    """(target, Citus's figure, the plain server's, the ratio per repetition or None) each."""
    for key, what in TARGETS.items() if section else ():
        assert section is not None
        per_rep = section.get("ratio_reps", {}).get(key)  # (runs saved before it: None)
        target = f"citus: {what} ≥ 0.5x a plain server"
        yield target, section["citus"][key], section["plain"][key], per_rep


def rows(section: dict[str, Any], num: Callable[[float], str]) -> list[dict[str, str]]:
    """The table's rows: each database's figures, rendered by ``num``."""
    return [{"what": db, **{k: num(v) for k, v in section[db].items()}} for db in DATABASES]
