"""The ``runctl`` section of ``python -m bench``: large payloads, lanes, pausing a run.

- ``large``: claim p50/p99 draining effects with small payloads, with large payloads
  stored by reference, and (to show what that buys) the same large payloads in the
  row; row and table sizes;
- ``lanes``: claim p50 with 1, 10 and 100 fairness keys holding backlogs (one probe
  per lane);
- ``pause``: how long pausing and resuming a run with 10,000 pending effects takes,
  and the claim p50 of another run's backlog while they are held (paused rows leave
  the claim index, as in-flight ones do).

Each repetition runs in a scratch database of the bench's server
(:mod:`bench.runctl_support`).
"""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg

from bench.runctl_support import (
    MB,
    backlog,
    claim_times,
    libpq,
    migrated,
    quantiles,
    scratch,
    spread,
)

# -- large payloads ---------------------------------------------------------------------


def fill_payloads(dsn: str, kind: str, n: int, size: int, threshold: int) -> float:
    """``n`` effects of ``kind`` whose payloads are ``size`` bytes of distinct text."""
    from outbox import Outbox

    started = time.perf_counter()
    with Outbox.connect(dsn, blob_threshold_bytes=threshold) as ob:
        run = ob.start_run("bench", "1", {})
        per_step = 50
        for s in range(n // per_step):

            def step(tx: Any, s: int = s) -> None:
                for i in range(per_step):
                    body = os.urandom(size // 2).hex()[: size - 40]
                    tx.intend(kind, {"n": s * per_step + i, "body": body})

            run.transaction(f"fill-{s}", step)
    return time.perf_counter() - started


def sizes(dsn: str, kind: str) -> dict[str, float]:
    with psycopg.connect(libpq(dsn)) as conn:
        row = conn.execute(
            "SELECT avg(pg_column_size(e.*)), max(pg_column_size(e.*)) FROM outbox_effects e "
            "WHERE kind = %s",
            (kind,),
        ).fetchone()
        table = conn.execute(
            "SELECT pg_total_relation_size('outbox_effects'),"
            " pg_total_relation_size('outbox_blobs')"
        ).fetchone()
    assert row is not None and table is not None
    return {
        "row_bytes_avg": float(row[0]),
        "row_bytes_max": float(row[1]),
        "effects_table_mb": table[0] / MB,
        "blobs_table_mb": table[1] / MB,
    }


def warm(dsn: str) -> None:
    """Read the effects table and its claim index into shared buffers (each variant alike)."""
    with psycopg.connect(libpq(dsn), autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
        conn.execute("CHECKPOINT")
        conn.execute("SELECT count(*), sum(length(payload::text)) FROM outbox_effects")
        conn.execute(
            "SELECT count(*) FROM outbox_effects WHERE status = 'pending' AND kind = 'bench.large'"
        )


def large_section(admin: str, reps: int, n: int, size: int) -> dict[str, Any]:
    """Claims draining ``n`` effects: small payloads, large ones by reference, large in the row.

    The variants take turns, one repetition each, so a machine that gets busier
    or quieter while this runs does not favour one of them.
    """
    variants = {
        "small payloads (100 B)": (100, 16 * 1024),
        f"large payloads ({size // 1024} KiB) by reference": (size, 16 * 1024),
        f"large payloads ({size // 1024} KiB) in the row": (size, 2 * size),
    }
    got: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    for _rep in range(reps):
        for name, (payload, threshold) in variants.items():
            with scratch(admin, "bench_runctl_large") as dsn:
                migrated(dsn)
                fill = fill_payloads(dsn, "bench.large", n, payload, threshold)
                warm(dsn)
                found = sizes(dsn, "bench.large")
                times = claim_times(dsn, "bench.large", 100, n // 100 - 5)
                got[name].append({"fill_seconds": fill, **found, **quantiles(times)})
                print(f"  large {name}: p50 {got[name][-1]['p50'] * 1000:.2f} ms", flush=True)
    out: dict[str, Any] = {}
    small = next(iter(got.values()))
    for name, runs in got.items():
        figures = [key for key in runs[0] if isinstance(runs[0][key], float)]
        out[name] = {key: spread([r[key] for r in runs]) for key in figures}
        # Each repetition's p50 over the small payloads' of the same turn: the pair a target judges.
        out[name]["p50_vs_small"] = spread(
            [r["p50"] / s["p50"] for r, s in zip(runs, small, strict=True)]
        )
    return out


# -- lanes ----------------------------------------------------------------------------------


def lanes_section(admin: str, reps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for lanes in (1, 10, 100):
        p50s = []
        for _rep in range(reps):
            with scratch(admin, "bench_runctl_lanes") as dsn:
                migrated(dsn)
                per = max(2_000, 40_000 // lanes)
                for lane in range(lanes):
                    backlog(dsn, "bench.lanes", per, fairness_key=f"tenant-{lane:03d}")
                with psycopg.connect(libpq(dsn), autocommit=True) as conn:
                    conn.execute("VACUUM ANALYZE outbox_effects")
                p50s.append(quantiles(claim_times(dsn, "bench.lanes", 100, 150))["p50"])
        out[str(lanes)] = spread(p50s)
        print(f"  lanes {lanes}: p50 {out[str(lanes)]['median'] * 1000:.2f} ms", flush=True)
    return out


# -- pause ------------------------------------------------------------------------------------


def pause_section(admin: str, reps: int) -> dict[str, Any]:
    from outbox import Outbox

    got: list[dict[str, float]] = []
    for _rep in range(reps):
        with scratch(admin, "bench_runctl_pause") as dsn:
            migrated(dsn)
            backlog(dsn, "bench.other", 30_000)
            with Outbox.connect(dsn) as ob:
                run = ob.start_run("bench", "1", {})
                with psycopg.connect(libpq(dsn), autocommit=True) as conn:
                    conn.execute(
                        """INSERT INTO outbox_effects (id, shard, run_id, kind, payload,
                                  payload_hash, idempotency_key, status)
                           SELECT gen_random_uuid(), outbox_shard_of(%(run)s), %(run)s,
                                  'bench.held', '{}'::jsonb, 'x',
                                  md5(%(run)s::text || g::text), 'pending'
                             FROM generate_series(1, 10000) g""",
                        {"run": run.id},
                    )
                    conn.execute("VACUUM ANALYZE outbox_effects")
                before = quantiles(claim_times(dsn, "bench.other", 100, 50))["p50"]
                started = time.perf_counter()
                ob.pause(run.id, "bench")
                paused = time.perf_counter() - started
                during = quantiles(claim_times(dsn, "bench.other", 100, 50))["p50"]
                started = time.perf_counter()
                ob.resume(run.id)
                resumed = time.perf_counter() - started
            got.append(
                {
                    "pause_s": paused,
                    "resume_s": resumed,
                    "claim_p50_before": before,
                    "claim_p50_while_paused": during,
                }
            )
            print(f"  pause: {got[-1]}", flush=True)
    return {key: spread([g[key] for g in got]) for key in got[0]}
