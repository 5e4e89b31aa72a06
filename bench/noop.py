"""Sinks for the benchmark's deliverer processes (``python.call`` functions).

A deliverer subprocess serves kind ``bench.noop`` with :func:`noop`, kind
``bench.slow`` with :func:`slow` and kind ``bench.latency`` with
:func:`record_start`, configured by :func:`deliverers_config`. Both
are ``async def``, so the ``python.call`` deliverer awaits them on its event
loop (a plain function would go through a thread per call).
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
#: Where :func:`slow` appends the key of every call it receives (set by the parent).
SINK_LOG_ENV = "BENCH_SINK_LOG"
SLOW_SECONDS = 0.5


async def noop(payload: Any, key: str) -> None:
    """Succeed at once, doing nothing."""
    return None


async def slow(payload: Any, key: str) -> None:
    """A sink call that takes ``SLOW_SECONDS``; it is applied (logged) when it starts.

    The key goes to the sink log with one ``O_APPEND`` write before the sleep,
    so a call cut short by ``kill -9`` still counts as applied: the sink saw it.
    An idempotent sink applies each key once however often it is called; the
    parent counts both the raw calls and the keys.
    """
    _append_line(os.environ.get(SINK_LOG_ENV), f"{os.getpid()} {key}")
    await asyncio.sleep(SLOW_SECONDS)


async def record_start(payload: Any, key: str) -> None:
    """Record when the handler started (``time.time()``), by the payload's ``i``."""
    started = time.time()
    _append_line(os.environ.get(LATENCY_LOG_ENV), f"{payload['i']} {started!r}")


def deliverers_config(path: Path) -> Path:
    """Write the deliverers config (TOML) serving both benchmark kinds; return its path."""
    path.write_text(
        f'[kinds."{NOOP_KIND}"]\n'
        'type = "python.call"\n'
        'function = "bench.noop:noop"\n'
        "idempotent = true\n"
        "\n"
        f'[kinds."{SLOW_KIND}"]\n'
        'type = "python.call"\n'
        'function = "bench.noop:slow"\n'
        "idempotent = true\n"
        "\n"
        f'[kinds."{LATENCY_KIND}"]\n'
        'type = "python.call"\n'
        'function = "bench.noop:record_start"\n'
        "idempotent = true\n"
    )
    return path


def _append_line(path: str | None, line: str) -> None:
    """One ``O_APPEND`` write, so lines of concurrent processes never interleave."""
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{line}\n".encode())
    finally:
        os.close(fd)
