"""Write overhead: ``run.transaction`` with one intent versus a bare insert, 1/4/8 writers.

Built on ``bench.delivery``'s writer harness (threads of one process, each with
its own run, on the same SQLAlchemy engine kind), with the wake-up variants
that answer the NOTIFY question from the product's side:

- ``bare_insert``: a one-row insert transaction through the same driver;
- ``step``: the default (``WakeupThrottle``, one inline NOTIFY per 3 ms per
  process, a trailing one for skipped commits);
- ``step_notify_every_commit``: ``notify_window_ms=0``, a NOTIFY in every step;
- ``step_no_notify``: a window of an hour: no NOTIFY while measuring (the poll
  alone would have to find the work).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from bench.delivery import (
    Bench,
    aggregate,
    bare_workers,
    log,
    outbox_workers,
    run_writers,
    summary,
)
from outbox import Outbox
from outbox.storage.store import make_engine

VARIANTS = {
    "step": None,
    "step_notify_every_commit": 0.0,
    "step_no_notify": 3_600_000.0,
}


def wal_lsn(bench: Bench) -> int:
    """The server's WAL insert position in bytes."""
    with bench.connect() as conn:
        row = conn.execute(
            "SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint"
        ).fetchone()
    assert row is not None
    return int(row[0])


def write_section(
    bench: Bench, writers: tuple[int, ...], seconds: float, reps: int
) -> dict[str, Any]:
    engine = make_engine(bench.dsn)
    outboxes = {
        name: Outbox.connect(bench.dsn)
        if window is None
        else Outbox.connect(bench.dsn, notify_window_ms=window)
        for name, window in VARIANTS.items()
    }
    makers: dict[str, Callable[[], Callable[[int], Callable[[int], None]]]] = {
        "bare_insert": lambda: bare_workers(engine)
    }
    for name, ob in outboxes.items():
        makers[name] = functools.partial(outbox_workers, ob)
    names = list(makers)
    out: dict[str, Any] = {"seconds": seconds}
    try:
        for make in makers.values():  # warm: connections, compiled statements, plans
            run_writers(bench, 2, 0.5, make())
        for count in writers:
            got: dict[str, list[dict[str, float]]] = {name: [] for name in names}
            for rep in range(reps):
                for name in names[rep % len(names) :] + names[: rep % len(names)]:
                    bench.reset(runs=True)
                    lsn = wal_lsn(bench)
                    one = run_writers(bench, count, seconds, makers[name]())
                    # Approximate: transactions = rate x the measured seconds.
                    one["wal_bytes_per_tx"] = (wal_lsn(bench) - lsn) / (one["rate"] * seconds)
                    got[name].append(one)
                log(
                    f"write {count} writer(s) rep {rep + 1}: "
                    + ", ".join(f"{n} {got[n][-1]['rate']:.0f}/s" for n in names)
                )
            result: dict[str, Any] = {name: aggregate(r) for name, r in got.items()}
            for name in names[1:]:
                ratios = [
                    s["rate"] / b["rate"]
                    for s, b in zip(got[name], got["bare_insert"], strict=True)
                ]
                result[name]["ratio_to_bare"] = summary(ratios)
            out[str(count)] = result
    finally:
        for ob in outboxes.values():
            ob.close()
        engine.dispose()
        bench.reset(runs=True)
    return out
