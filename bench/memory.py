"""Memory: peak RSS of one ``outbox deliver`` process draining a small and a large backlog.

The process (default settings) starts on a committed backlog of no-op effects
and drains it; its RSS is sampled every 20 ms, and the kernel's high-water
mark (``VmHWM``) is read before it is stopped. The rate includes start-up.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench.harness import Bench, log, memory_of
from bench.processes import DelivererProcess, wait_drained
from bench.sinks import NOOP_KIND


def memory_rep(bench: Bench, workdir: Path, n: int) -> dict[str, Any]:
    bench.reset()
    bench.insert_backlog(n, NOOP_KIND)
    with bench.connect() as conn:
        conn.execute("CHECKPOINT")
    started = time.time()
    proc = DelivererProcess(bench, workdir, NOOP_KIND, name=f"memory-{n}", sample_rss=True)
    try:
        finished = wait_drained(bench, [proc], timeout=3600, poll=0.5)
        hwm = memory_of(proc.pid, "VmHWM")
        assert proc.rss is not None
        proc.rss.stop()
    finally:
        proc.stop()
    return {
        "peak_rss_mb": proc.rss.peak / 2**20,
        "vm_hwm_mb": hwm / 2**20,
        "rss_samples": proc.rss.samples,
        "seconds": finished - started,
        "rate": n / (finished - started),
    }


def memory(bench: Bench, workdir: Path, quick: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n in (1_000, 100_000 if quick else 1_000_000):
        out[str(n)] = got = memory_rep(bench, workdir, n)
        log(f"memory, backlog {n}: VmHWM {got['vm_hwm_mb']:.1f} MB, {got['rate']:.0f} effects/s")
    bench.reset()
    return out
