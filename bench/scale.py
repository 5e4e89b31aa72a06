"""Scale: claims with 10k, 1M and 10M finished rows in the table; and retention (``outbox gc``).

Finished rows (``succeeded``, completed 20 to 40 days ago, run-less) are loaded
with SQL in 1M-row transactions, then VACUUM ANALYZE. At each level a backlog of
2k pending effects of another kind is drained ``reps`` times through the
store's own ``claim_many`` (batches of 100) and ``complete``, every call timed;
an ``EXPLAIN (ANALYZE, BUFFERS)`` of one claim (rolled back) shows the pages it
touches. After the 1M level, :func:`~outbox.storage.admin.retention.collect_garbage`
deletes every finished row older than a day (batches of 1000, each timed) and
the claims are measured again, after gc and after a VACUUM; then the archive
variant (JSON lines written before deleting) on 100k rows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from bench.delivery import succeeded
from bench.harness import BACKLOG_INSERT, Bench, log, percentile, summary
from outbox.storage.admin.archive import ArchiveWriter
from outbox.storage.admin.retention import collect_garbage
from outbox.storage.async_store import AsyncStore
from outbox.storage.engine import make_async_engine, make_engine
from outbox.storage.sql.queue import EFFECT_QUEUE, claim, claim_params

DONE_KIND = "bench.done"
SCALE_KIND = "bench.scale"
FINISHED_INSERT = """
INSERT INTO outbox_effects
    (id, shard, kind, payload, payload_hash, idempotency_key, status, available_at, attempt,
     attempt_started_at, created_at, updated_at, completed_at)
SELECT id, outbox_shard_of(id), %(kind)s, '{}'::jsonb, md5('{}'),
       %(tag)s || lpad(g::text, 10, '0'), 'succeeded', ts, 1, ts, ts, ts, ts
  FROM (SELECT uuidv7() AS id, g,
               now() - interval '40 days' + (g::float8 / %(n)s) * interval '20 days' AS ts
          FROM generate_series(1, %(n)s) AS g) AS s
"""
DISK_NEEDED = 10 * 2**30


def load_finished(bench: Bench, add: int) -> dict[str, float]:
    """Add ``add`` finished rows (1M per transaction); vacuum, analyse and checkpoint."""
    began = time.perf_counter()
    with bench.connect() as conn:
        for first in range(0, add, 1_000_000):
            n = min(1_000_000, add - first)
            conn.execute(FINISHED_INSERT, {"kind": DONE_KIND, "tag": uuid.uuid4().hex, "n": n})
        loaded = time.perf_counter()
        conn.execute("VACUUM (ANALYZE) outbox_effects")
        conn.execute("CHECKPOINT")
    return {"load_s": loaded - began, "vacuum_s": time.perf_counter() - loaded}


def finished(bench: Bench) -> int:
    return int(bench.value("SELECT count(*) FROM outbox_effects WHERE status = 'succeeded'"))


def table_size(bench: Bench) -> dict[str, float]:
    total, rows, dead = bench.rows(
        "SELECT pg_total_relation_size('outbox_effects'), (SELECT count(*) FROM outbox_effects), "
        "(SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'outbox_effects')"
    )[0]
    return {"total_mb": total / 2**20, "rows": rows, "dead_tuples": dead or 0}


def explain_claim(engine: Engine) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, BUFFERS) of one claim of 100 from a 2k backlog, all rolled back."""
    compiled = claim(EFFECT_QUEUE).compile(dialect=engine.dialect)
    params = compiled.construct_params(
        claim_params({"kind": SCALE_KIND}, limit=100, owner="explain", lease_seconds=30)
    )
    with engine.connect() as conn:
        tag = uuid.uuid4().hex
        conn.exec_driver_sql(BACKLOG_INSERT, {"kind": SCALE_KIND, "tag": tag, "n": 2000})
        sql = "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + str(compiled)
        plan = conn.exec_driver_sql(sql, params).scalar_one()[0]
        conn.rollback()
    top = plan["Plan"]
    return {
        "execution_ms": plan["Execution Time"],
        "planning_ms": plan["Planning Time"],
        "buffers": top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0),
    }


async def _drains(bench: Bench, reps: int, backlog: int = 2000) -> list[dict[str, Any]]:
    store = AsyncStore(make_async_engine(bench.dsn))
    quota = [({"kind": SCALE_KIND}, 100)]
    out = []
    try:
        for rep in range(reps + 1):  # the first, small, warms
            n = backlog if rep else 200
            with bench.connect() as conn:
                conn.execute(BACKLOG_INSERT, {"kind": SCALE_KIND, "tag": uuid.uuid4().hex, "n": n})
            claims, completes, done = [], [], 0
            lsn, began = bench.wal_lsn(), time.perf_counter()
            while True:
                t = time.perf_counter()
                rows = await store.claim_many(EFFECT_QUEUE, quota, owner="scale", lease_seconds=30)
                claims.append(1000 * (time.perf_counter() - t))
                if not rows:
                    break
                t = time.perf_counter()
                await store.complete("scale", succeeded(rows))
                completes.append(1000 * (time.perf_counter() - t))
                done += len(rows)
            wall = time.perf_counter() - began
            if done != n:
                raise RuntimeError(f"scale drain claimed {done} of {n}")
            if rep:
                wal = (bench.wal_lsn() - lsn) / n
                out.append(
                    {"rate": n / wall, "wal": wal, "claims": claims[:-1], "completes": completes}
                )
    finally:
        await store.dispose()
    return out


def measure_level(bench: Bench, engine: Engine, reps: int) -> dict[str, Any]:
    got = asyncio.run(_drains(bench, reps))
    claims = [c for g in got for c in g["claims"]]  # the last claim of each found nothing
    return {
        "claims": len(claims),
        "claim_p50_ms": percentile(claims, 50),
        "claim_p99_ms": percentile(claims, 99),
        "complete_p50_ms": percentile([c for g in got for c in g["completes"]], 50),
        "rate": summary([g["rate"] for g in got]),
        "wal_bytes_per_effect": summary([g["wal"] for g in got]),
        "explain": explain_claim(engine),
        "table": table_size(bench),
    }


def gc_run(engine: Engine, *, archive: ArchiveWriter | None = None) -> dict[str, Any]:
    """collect_garbage of rows older than a day, every batch (one transaction each) timed."""
    ms: list[float] = []
    last = [time.perf_counter()]

    def progress(table: str, n: int) -> None:
        ms.append(1000 * (time.perf_counter() - last[0]))
        last[0] = time.perf_counter()

    began = time.perf_counter()
    report = collect_garbage(engine, timedelta(days=1), archive=archive, progress=progress)
    wall = time.perf_counter() - began
    rows, tenth = sum(report.deleted.values()), max(1, len(ms) // 10)
    ms = ms or [0.0]
    return {
        "rows": rows,
        "batches": report.batches,
        "seconds": wall,
        "rows_per_s": rows / wall,
        "batch_p50_ms": percentile(ms, 50),
        "batch_p99_ms": percentile(ms, 99),
        "batch_max_ms": max(ms),
        "first_tenth_mean_ms": sum(ms[:tenth]) / tenth,
        "last_tenth_mean_ms": sum(ms[-tenth:]) / tenth,
    }


def retention(bench: Bench, engine: Engine, workdir: Path, reps: int) -> dict[str, Any]:
    out: dict[str, Any] = {"table_before": table_size(bench), "gc": gc_run(engine)}
    gc = out["gc"]
    log(f"gc: {gc['rows']:,} rows, {gc['rows_per_s']:.0f}/s, longest {gc['batch_max_ms']:.0f} ms")
    out["after_gc"] = measure_level(bench, engine, reps)
    began = time.perf_counter()
    with bench.connect() as conn:
        conn.execute("VACUUM (ANALYZE) outbox_effects")
    out["vacuum_s"] = time.perf_counter() - began
    out["after_vacuum"] = measure_level(bench, engine, reps)
    load_finished(bench, 100_000)
    path = workdir / "gc-archive.jsonl"
    with ArchiveWriter.open(path) as writer:
        out["archive"] = gc_run(engine, archive=writer)
    out["archive"]["archive_mb"] = path.stat().st_size / 2**20
    path.unlink()
    return out


def scale(
    bench: Bench, workdir: Path, quick: bool, *, levels: Sequence[int] | None = None
) -> dict[str, Any]:
    """The levels (default 10k, 1M, 10M; quick: 10k, 1M, 3 reps), retention after the 1M one."""
    default, reps = ((10_000, 1_000_000), 3) if quick else ((10_000, 1_000_000, 10_000_000), 10)
    levels = default if levels is None else sorted(levels)
    bench.reset()
    engine = make_engine(bench.dsn)
    out: dict[str, Any] = {"levels": {}, "skipped": [], "gc_level": 1_000_000}
    have = 0
    try:
        for level in levels:
            free = shutil.disk_usage(workdir).free
            if level >= 5_000_000 and free < DISK_NEEDED:
                out["skipped"].append(f"{level:,} rows: {free / 2**30:.1f} GB free, 10 GB needed")
                continue
            if have > level:  # after retention: start again from an empty table
                bench.reset()
                have = 0
            load = load_finished(bench, level - have)
            have = level
            out["levels"][str(level)] = result = {**measure_level(bench, engine, reps), **load}
            log(
                f"scale {level:,} finished rows: claim p50 {result['claim_p50_ms']:.2f} ms, "
                f"p99 {result['claim_p99_ms']:.2f} ms (loaded in {load['load_s']:.0f} s)"
            )
            if level == out["gc_level"]:
                out["retention"] = retention(bench, engine, workdir, reps)
                have = finished(bench)
    finally:
        engine.dispose()
        bench.reset()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Some levels alone (e.g. 10k and 10M, no retention); JSON on stdout, no page written."""
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__)
    parser.add_argument("--levels", type=int, nargs="+", default=[10_000, 10_000_000])
    parser.add_argument("--quick", action="store_true", help="3 repetitions a level, not 10")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="outbox-scale-") as tmp:
        home = Path(tmp)
        home.chmod(0o711)  # as root, the server runs as another user, who must enter it
        bench = Bench(home).start()
        try:
            out = scale(bench, home, args.quick, levels=args.levels)
        finally:
            bench.stop()
    json.dump(out, sys.stdout, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
