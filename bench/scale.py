"""Scale: claim latency and drain rate with 10k, 1M and 10M finished rows; and retention.

Finished rows (status ``succeeded``, ``completed_at`` 20 to 40 days ago,
run-less, kind ``bench.done``) are loaded in 1M-row transactions with SQL, the
table is vacuumed and analysed (so autovacuum does not start in the middle of a
measurement), and at each level a backlog of 2k pending effects of another kind
is drained ``reps`` times with ``outbox.storage.sql.queue.claim(EFFECT_QUEUE)`` batches of
100 and ``outbox.storage.sql.queue.complete_effects()``, each its own transaction through a
SQLAlchemy engine: every claim is timed (p50/p99), and the drain rate is the
backlog over the loop's wall time. An ``EXPLAIN (ANALYZE, BUFFERS)`` of one
claim (rolled back) shows how many pages it touches.

Retention: after the 1M level, ``outbox.storage.retention.collect_garbage`` deletes
every finished row older than a day in batches of 1000 (``outbox gc``'s
default), each batch timed (the longest transaction gc holds); claims are
measured again right after gc and after a VACUUM. The archive variant
(JSON lines written before deleting) runs on 100k rows.
"""

from __future__ import annotations

import shutil
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from bench.delivery import BACKLOG_INSERT, Bench, log, percentile, succeeded, summary
from bench.write import wal_lsn
from outbox.storage.archive import ArchiveWriter
from outbox.storage.retention import collect_garbage
from outbox.storage.sql import queue
from outbox.storage.store import make_engine

DONE_KIND = "bench.done"
SCALE_KIND = "bench.scale"
CHUNK = 1_000_000
FINISHED_INSERT = """
INSERT INTO outbox_effects
    (id, kind, payload, payload_hash, idempotency_key, status, available_at, attempt,
     attempt_started_at, created_at, updated_at, completed_at)
SELECT uuidv7(), %(kind)s, '{}'::jsonb, md5('{}'),
       %(tag)s || lpad(g::text, 10, '0'), 'succeeded', ts, 1, ts, ts, ts, ts
  FROM (SELECT g, now() - interval '40 days'
                 + (g::float8 / %(n)s) * interval '20 days' AS ts
          FROM generate_series(1, %(n)s) AS g) AS s
"""
DISK_NEEDED = 10 * 2**30


def finished_rows(bench: Bench) -> int:
    with bench.connect() as conn:
        row = conn.execute(
            "SELECT count(*) FROM outbox_effects WHERE status = 'succeeded'"
        ).fetchone()
    return int(row[0]) if row else 0


def load_finished(bench: Bench, target: int, have: int) -> dict[str, float]:
    """Add finished rows up to ``target`` (of kind DONE_KIND); vacuum and analyse."""
    began = time.perf_counter()
    with bench.connect() as conn:
        while have < target:
            n = min(CHUNK, target - have)
            conn.execute(FINISHED_INSERT, {"kind": DONE_KIND, "tag": uuid.uuid4().hex, "n": n})
            have += n
    loaded = time.perf_counter() - began
    began = time.perf_counter()
    with bench.connect() as conn:
        conn.execute("VACUUM (ANALYZE) outbox_effects")
        conn.execute("CHECKPOINT")
    return {"load_s": loaded, "vacuum_s": time.perf_counter() - began}


def table_size(bench: Bench) -> dict[str, float]:
    with bench.connect() as conn:
        row = conn.execute(
            "SELECT pg_relation_size('outbox_effects'), pg_total_relation_size('outbox_effects'), "
            "(SELECT count(*) FROM outbox_effects), "
            "pg_relation_size('outbox_effects_claimable'), "
            "(SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'outbox_effects')"
        ).fetchone()
    assert row is not None
    return {
        "heap_mb": row[0] / 2**20,
        "total_mb": row[1] / 2**20,
        "rows": row[2],
        "claimable_index_kb": row[3] / 1024,
        "dead_tuples": row[4] or 0,
    }


def explain_claim(engine: Engine) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, BUFFERS) of one claim of 100 from a 2k backlog, rolled back."""
    statement = queue.claim(queue.EFFECT_QUEUE)
    compiled = statement.compile(dialect=engine.dialect)
    params = compiled.construct_params(
        queue.claim_params({"kind": SCALE_KIND}, limit=100, owner="explain", lease_seconds=30)
    )
    with engine.connect() as conn:
        # A backlog in the same transaction, so the claim finds 100 rows; all rolled back.
        conn.exec_driver_sql(
            BACKLOG_INSERT, {"kind": SCALE_KIND, "tag": uuid.uuid4().hex, "n": 2000}
        )
        row = conn.exec_driver_sql(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + str(compiled), params
        ).fetchone()
        conn.rollback()
    assert row is not None
    plan = row[0][0]
    top = plan["Plan"]
    return {
        "execution_ms": plan["Execution Time"],
        "planning_ms": plan["Planning Time"],
        "shared_hit": top.get("Shared Hit Blocks", 0),
        "shared_read": top.get("Shared Read Blocks", 0),
        "rows": top.get("Actual Rows"),
    }


def drain_rep(bench: Bench, engine: Engine, backlog: int, batch: int) -> dict[str, Any]:
    with bench.connect() as conn:
        conn.execute(BACKLOG_INSERT, {"kind": SCALE_KIND, "tag": uuid.uuid4().hex, "n": backlog})
    claim = queue.claim(queue.EFFECT_QUEUE)
    complete = queue.complete_effects()
    params = queue.claim_params(
        {"kind": SCALE_KIND}, limit=batch, owner="bench-scale", lease_seconds=30
    )
    claims: list[float] = []
    completes: list[float] = []
    done = 0
    lsn = wal_lsn(bench)
    began = time.perf_counter()
    while True:
        t = time.perf_counter()
        with engine.begin() as conn:
            rows = conn.execute(claim, params).mappings().all()
        claims.append(time.perf_counter() - t)
        if not rows:
            break
        payload = "[" + ",".join(c.as_json() for c in succeeded(rows)) + "]"
        t = time.perf_counter()
        with engine.begin() as conn:
            conn.execute(
                complete,
                {"owner": "bench-scale", "done": payload, "ids": [row["id"] for row in rows]},
            )
        completes.append(time.perf_counter() - t)
        done += len(rows)
    wall = time.perf_counter() - began
    wal = wal_lsn(bench) - lsn
    if done != backlog:
        raise RuntimeError(f"scale drain claimed {done} of {backlog}")
    return {
        "rate": backlog / wall,
        "wal_bytes_per_effect": wal / backlog,
        "claims_ms": [1000 * c for c in claims[:-1]],  # the last one found nothing
        "empty_claim_ms": 1000 * claims[-1],
        "completes_ms": [1000 * c for c in completes],
    }


def measure_level(
    bench: Bench, engine: Engine, reps: int, backlog: int = 2000, batch: int = 100
) -> dict[str, Any]:
    drain_rep(bench, engine, 200, batch)  # warm
    got = [drain_rep(bench, engine, backlog, batch) for _ in range(reps)]
    claims = [c for g in got for c in g["claims_ms"]]
    completes = [c for g in got for c in g["completes_ms"]]
    return {
        "claims": len(claims),
        "claim_p50_ms": percentile(claims, 50),
        "claim_p99_ms": percentile(claims, 99),
        "complete_p50_ms": percentile(completes, 50),
        "empty_claim_ms": summary([g["empty_claim_ms"] for g in got]),
        "rate": summary([g["rate"] for g in got]),
        "wal_bytes_per_effect": summary([g["wal_bytes_per_effect"] for g in got]),
        "explain": explain_claim(engine),
        "table": table_size(bench),
    }


def gc_run(
    engine: Engine, older_than: timedelta, *, archive: ArchiveWriter | None = None
) -> dict[str, Any]:
    """collect_garbage with every batch (one transaction each) timed."""
    durations: list[float] = []
    last = [time.perf_counter()]

    def progress(table: str, n: int) -> None:
        now = time.perf_counter()
        durations.append(now - last[0])
        last[0] = now

    began = time.perf_counter()
    report = collect_garbage(engine, older_than, archive=archive, progress=progress)
    wall = time.perf_counter() - began
    deleted = sum(report.deleted.values())
    tenth = max(1, len(durations) // 10)
    ms = [1000 * d for d in durations]
    return {
        "deleted": report.deleted,
        "rows": deleted,
        "batches": report.batches,
        "seconds": wall,
        "rows_per_s": deleted / wall if wall else 0.0,
        "batch_p50_ms": percentile(ms, 50) if ms else 0.0,
        "batch_p99_ms": percentile(ms, 99) if ms else 0.0,
        "batch_max_ms": max(ms) if ms else 0.0,
        "first_tenth_mean_ms": sum(ms[:tenth]) / tenth if ms else 0.0,
        "last_tenth_mean_ms": sum(ms[-tenth:]) / tenth if ms else 0.0,
    }


def scale_section(
    bench: Bench, workdir: Path, levels: tuple[int, ...], reps: int, gc_level: int
) -> dict[str, Any]:
    bench.reset()
    engine = make_engine(bench.dsn)
    out: dict[str, Any] = {"levels": {}, "skipped": [], "gc_level": gc_level}
    have = 0
    try:
        for level in levels:
            if level >= 5_000_000:
                free = shutil.disk_usage(workdir).free
                if free < DISK_NEEDED:
                    note = (
                        f"{level:,} rows skipped: {free / 2**30:.1f} GB free under {workdir}, "
                        f"{DISK_NEEDED / 2**30:.0f} GB needed"
                    )
                    log(note)
                    out["skipped"].append(note)
                    continue
            if have > level:
                # Back down after retention: start again from an empty table.
                bench.reset()
                have = 0
            load = load_finished(bench, level, have)
            have = level
            result = measure_level(bench, engine, reps)
            result.update(load)
            out["levels"][str(level)] = result
            log(
                f"scale {level:,} finished rows: claim p50 {result['claim_p50_ms']:.2f} ms, "
                f"p99 {result['claim_p99_ms']:.2f} ms, drain {result['rate']['median']:.0f}/s "
                f"(loaded in {load['load_s']:.0f} s, vacuum {load['vacuum_s']:.0f} s)"
            )
            if level == gc_level:
                out["retention"] = retention(bench, engine, workdir, reps)
                have = finished_rows(bench)
    finally:
        engine.dispose()
        bench.reset()
    return out


def retention(bench: Bench, engine: Engine, workdir: Path, reps: int) -> dict[str, Any]:
    before = table_size(bench)
    gc = gc_run(engine, timedelta(days=1))
    log(
        f"gc: {gc['rows']:,} rows in {gc['seconds']:.1f} s ({gc['rows_per_s']:.0f} rows/s), "
        f"{gc['batches']} batches, longest {gc['batch_max_ms']:.0f} ms"
    )
    after_gc = measure_level(bench, engine, reps)
    began = time.perf_counter()
    with bench.connect() as conn:
        conn.execute("VACUUM (ANALYZE) outbox_effects")
    vacuum_s = time.perf_counter() - began
    after_vacuum = measure_level(bench, engine, reps)
    log(
        f"after gc: claim p50 {after_gc['claim_p50_ms']:.2f} ms; after VACUUM "
        f"({vacuum_s:.0f} s): {after_vacuum['claim_p50_ms']:.2f} ms"
    )
    # The archive variant: rows written as JSON lines before they are deleted.
    load_finished(bench, finished_rows(bench) + 100_000, finished_rows(bench))
    path = workdir / "gc-archive.jsonl"
    with ArchiveWriter.open(path) as writer:
        archived = gc_run(engine, timedelta(days=1), archive=writer)
    archived["archive_mb"] = path.stat().st_size / 2**20
    path.unlink()
    log(f"gc with archive: {archived['rows_per_s']:.0f} rows/s")
    return {
        "table_before": before,
        "gc": gc,
        "after_gc": after_gc,
        "vacuum_s": vacuum_s,
        "after_vacuum": after_vacuum,
        "archive": archived,
    }
