"""The operator console at size: every page's server time with 10,000 runs and 1,000,000 effects.

``python -m bench.console`` starts an embedded PostgreSQL in a temporary
directory (or uses ``--dsn``), loads 10,000 runs (10 steps each) and 1,000,000
effects (100 a run, one attempt-log row each; mostly succeeded, with failed,
unknown, pending, in-flight and cancelled ones, spread over 30 days, the newest
in the last hour), serves ``outbox serve`` on uvicorn in this process with the
state-count cache off (each overview counts afresh), and requests every page
``--repeat`` times. The figure is the ``Server-Timing`` the console reports:
from the request reaching the app to its response's headers, SQL and template
included. Prints a Markdown table (``--json`` for JSON).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg

from outbox import Outbox
from outbox.serve.app import OutboxServer
from outbox.serve.settings import Credentials, ServeSettings
from outbox.storage.admin.embedded import EmbeddedServer
from outbox.storage.engine import make_engine
from outbox.storage.migrate import migrate

RUNS = 10_000
EFFECTS_PER_RUN = 100
DATABASE = "outbox_bench_console"

# One statement per table; uuidv7(shift) (PostgreSQL 18) makes ids as the client would.
LOAD = [
    """
    INSERT INTO outbox_runs (id, shard, agent, agent_version, inputs, inputs_hash, status, state,
                             plan, current_step, step_count, budget, spent, created_at,
                             updated_at)
    SELECT id, outbox_shard_of(id), 'agent-' || (i %% 5), 'v' || (i %% 3),
           jsonb_build_object('ticket', i), md5(i::text),
           CASE WHEN i %% 50 = 0 THEN 'waiting' WHEN i %% 51 = 0 THEN 'runnable'
                WHEN i %% 97 = 0 THEN 'failed' WHEN i %% 89 = 0 THEN 'cancelled'
                ELSE 'completed' END,
           jsonb_build_object('stage', 'done', 'i', i), '["a","b","c"]'::jsonb, 'step-9',
           10, 10, 1.5,
           now() - (interval '30 days') * (1 - i::float / %(runs)s),
           now() - (interval '30 days') * (1 - i::float / %(runs)s)
    FROM (SELECT uuidv7(-(interval '30 days') * (1 - i::float / %(runs)s)) AS id, i
            FROM generate_series(1, %(runs)s) AS i) AS made
    """,
    """
    INSERT INTO outbox_steps (run_id, shard, seq, step_id, kind, result, completed_at)
    SELECT r.id, r.shard, s + 1, 'step-' || s, 'transaction', jsonb_build_object('ok', true),
           r.created_at
    FROM outbox_runs r, generate_series(0, 9) AS s
    """,
    """
    INSERT INTO outbox_effects (id, shard, run_id, step_id, step_index, kind, payload, payload_hash,
                                idempotency_key, ordering_key, status, attempt, last_error,
                                lease_owner, lease_expires_at, created_at, updated_at,
                                completed_at, available_at)
    SELECT uuidv7(t - now()), r.shard, r.id, 'step-' || (e %% 10), e,
           'kind-' || (e %% 5),
           jsonb_build_object('url', 'https://sink.example/x', 'json', jsonb_build_object('n', e)),
           md5(r.id::text || e), md5(r.id::text || e) || '-' || e,
           CASE WHEN e %% 7 = 0 THEN 'customer-' || (e %% 13) END,
           st, CASE WHEN st = 'pending' THEN 0 ELSE 1 END,
           CASE WHEN st IN ('failed', 'unknown') THEN 'HTTP 500' END,
           CASE WHEN st = 'in_flight' THEN 'bench-deliverer' END,
           CASE WHEN st = 'in_flight' THEN now() + interval '30 seconds' END,
           t, t, CASE WHEN st IN ('succeeded', 'failed', 'cancelled')
                      THEN t + interval '200 milliseconds' END, t
    FROM outbox_runs r, generate_series(0, %(per_run)s - 1) AS e,
         LATERAL (SELECT r.created_at + e * interval '1 second' AS t,
                         CASE WHEN (e + hashtext(r.id::text)) %% 1000 < 10 THEN 'failed'
                              WHEN (e + hashtext(r.id::text)) %% 1000 < 15 THEN 'unknown'
                              WHEN (e + hashtext(r.id::text)) %% 1000 < 25 THEN 'pending'
                              WHEN (e + hashtext(r.id::text)) %% 1000 < 27 THEN 'in_flight'
                              WHEN (e + hashtext(r.id::text)) %% 1000 < 30 THEN 'cancelled'
                              ELSE 'succeeded' END AS st) AS x
    """,
    """
    INSERT INTO outbox_effect_attempts (effect_id, shard, attempt, worker, started_at,
                                        finished_at, outcome, detail)
    SELECT id, shard, 1, 'bench-deliverer', created_at, created_at + interval '200 milliseconds',
           CASE status WHEN 'succeeded' THEN 'succeeded' WHEN 'failed' THEN 'failed'
                       WHEN 'unknown' THEN 'unknown' ELSE 'retry' END,
           jsonb_build_object('status', 200)
    FROM outbox_effects WHERE status <> 'pending'
    """,
    "ANALYZE",
]


def load(dsn: str, *, runs: int = RUNS) -> dict[str, float]:
    """Fill the database; return seconds per statement."""
    took = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in LOAD:
            began = time.perf_counter()
            conn.execute(statement, {"runs": runs, "per_run": EFFECTS_PER_RUN})
            took[statement.split()[2] if statement.strip() != "ANALYZE" else "analyze"] = (
                time.perf_counter() - began
            )
    return took


def pages(dsn: str) -> dict[str, str]:
    """One URL per page and filter worth measuring (ids picked from the loaded data)."""
    with psycopg.connect(dsn) as conn:

        def one(sql: str) -> str:
            row = conn.execute(sql).fetchone()
            assert row is not None
            return str(row[0])

        runs = int(one("SELECT count(*) FROM outbox_runs"))
        effects = int(one("SELECT count(*) FROM outbox_effects"))
        run = one(
            f"SELECT id FROM outbox_runs ORDER BY created_at DESC OFFSET {runs // 20} LIMIT 1"
        )
        effect = one("SELECT id FROM outbox_effects WHERE status = 'unknown' LIMIT 1")
        key = one("SELECT idempotency_key FROM outbox_effects ORDER BY id LIMIT 1")
        deep_run = one(
            "SELECT created_at::text || '~' || id FROM outbox_runs"
            f" ORDER BY created_at DESC, id DESC OFFSET {runs // 2} LIMIT 1"
        )
        deep_effect = one(
            f"SELECT id FROM outbox_effects ORDER BY id DESC OFFSET {effects // 2} LIMIT 1"
        )
    return {
        "overview (counts afresh)": "/console/",
        "runs, first page": "/console/runs",
        "runs, page 100 (keyset)": f"/console/runs?{httpx.QueryParams(cursor=deep_run)}",
        "runs, agent+status+age": "/console/runs?agent=agent-3&status=completed&newer=7d",
        "search by idempotency key": f"/console/runs?{httpx.QueryParams(q=key)}",
        "run page (10 steps, 100 effects)": f"/console/runs/{run}",
        "effects, first page": "/console/effects",
        "effects, middle (keyset)": f"/console/effects?cursor={deep_effect}",
        "effects, status=unknown": "/console/effects?status=unknown",
        "effects, status=pending&kind": "/console/effects?status=pending&kind=kind-2",
        "effects, status=cancelled": "/console/effects?status=cancelled",
        "effects, kind=kind-4": "/console/effects?kind=kind-4",
        "effect page": f"/console/effects/{effect}",
        "unknown queue + failed": "/console/unknown",
        "versions": "/console/versions",
    }


def measure(base: str, urls: dict[str, str], repeat: int) -> list[dict[str, Any]]:
    """Server time (ms) per page: p50 and max over ``repeat`` requests after two warm-ups."""
    results = []
    with httpx.Client(base_url=base, timeout=60) as client:
        for name, url in urls.items():
            times = []
            for i in range(repeat + 2):
                answer = client.get(url)
                assert answer.status_code in (200, 303), (url, answer.status_code)
                timing = answer.headers["server-timing"]
                if i >= 2:
                    times.append(float(timing.split("dur=")[1]))
            results.append(
                {
                    "page": name,
                    "p50_ms": statistics.median(times),
                    "max_ms": max(times),
                    "status": answer.status_code,
                }
            )
    return results


def serve_and_measure(dsn: str, repeat: int) -> list[dict[str, Any]]:
    """Serve the console on uvicorn in this process (count cache off) and time every page."""
    with Outbox.connect(dsn) as ob:
        serving = OutboxServer(
            ob, ServeSettings(port=0, counts_cache_seconds=0), Credentials()
        ).start()
        try:
            return measure(serving.url, pages(dsn), repeat)
        finally:
            serving.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dsn", help="an empty database to fill (default: an embedded server)")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    home = None
    server = None
    dsn = args.dsn
    try:
        if dsn is None:
            home = Path(tempfile.mkdtemp(prefix="outbox-bench-console-"))
            home.chmod(0o711)  # as root, the server runs as another user, who must enter it
            server = EmbeddedServer(home)
            server.ensure_running()
            with psycopg.connect(server.dsn("postgres"), autocommit=True) as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {DATABASE}")
                conn.execute(f"CREATE DATABASE {DATABASE}")
            dsn = server.dsn(DATABASE)
        engine = make_engine(dsn)
        migrate(engine)
        engine.dispose()
        print(f"loading {RUNS} runs and {RUNS * EFFECTS_PER_RUN} effects …", file=sys.stderr)
        loaded = load(dsn)
        print("loaded: " + ", ".join(f"{k} {v:.1f}s" for k, v in loaded.items()), file=sys.stderr)
        results = serve_and_measure(dsn, args.repeat)
    finally:
        if server is not None:
            server.stop(mode="immediate")
        if home is not None:
            shutil.rmtree(home, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(f"| page ({RUNS:,} runs, {RUNS * EFFECTS_PER_RUN:,} effects) | p50 ms | max ms |")
        print("|---|---:|---:|")
        for r in results:
            print(f"| {r['page']} | {r['p50_ms']:.1f} | {r['max_ms']:.1f} |")
    return 0 if all(r["max_ms"] < 300 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
