"""Sinks of the benchmark's ``outbox deliver`` processes (``python.call`` functions).

Kind ``bench.noop`` is served by :func:`noop`, ``bench.slow`` by :func:`slow`
and ``bench.latency`` by :func:`record_start` (see :func:`deliverers_config`).
All are ``async def``, so the ``python.call`` deliverer awaits them on its
event loop (a plain function would go through a thread per call).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

NOOP_KIND = "bench.noop"
SLOW_KIND = "bench.slow"
LATENCY_KIND = "bench.latency"
#: Where :func:`record_start` appends ``i time`` for every call (set by the parent).
LATENCY_LOG_ENV = "BENCH_LATENCY_LOG"
#: Where :func:`slow` appends ``pid key`` for every call it receives (set by the parent).
SINK_LOG_ENV = "BENCH_SINK_LOG"
SLOW_SECONDS = 0.5


async def noop(payload: Any, key: str) -> None:
    """Succeed at once, doing nothing."""


async def slow(payload: Any, key: str) -> None:
    """A call that takes ``SLOW_SECONDS``, applied (logged) when it starts.

    One ``O_APPEND`` write before the sleep, so a call cut short by ``kill -9``
    still counts as applied: the sink saw it. An idempotent sink applies each
    key once however often it is called; the parent counts calls and keys.
    """
    _append_line(os.environ.get(SINK_LOG_ENV), f"{os.getpid()} {key}")
    await asyncio.sleep(SLOW_SECONDS)


async def record_start(payload: Any, key: str) -> None:
    """Record when the handler started (``time.time()``), by the payload's ``i``."""
    _append_line(os.environ.get(LATENCY_LOG_ENV), f"{payload['i']} {time.time()!r}")


def deliverers_config(path: Path) -> Path:
    """Write the deliverers config (TOML) serving the three kinds; return its path."""
    path.write_text(
        "".join(
            f'[kinds."{kind}"]\ntype = "python.call"\nfunction = "bench.sinks:{function}"\n'
            "idempotent = true\n\n"
            for kind, function in (
                (NOOP_KIND, "noop"),
                (SLOW_KIND, "slow"),
                (LATENCY_KIND, "record_start"),
            )
        )
    )
    return path


def _append_line(path: str | None, line: str) -> None:
    """One ``O_APPEND`` write, so lines of concurrent processes never interleave."""
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{line}\n".encode())
        finally:
            os.close(fd)
