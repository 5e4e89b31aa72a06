"""The floor: pgbench (shipped with the embedded server) on the benchmark's own database.

``pgbench -n -c N -j N -T S -f SCRIPT`` at 1, 4 and 8 clients, with scripts
that insert one row into the same scratch table the Python "bare insert"
writes (``bench_scratch``):

- ``insert``: one ``INSERT`` statement (one round trip, one commit);
- ``insert_tx``: ``BEGIN; INSERT; END`` (the three round trips a driver's
  explicit transaction costs, as SQLAlchemy on psycopg does);
- ``insert_notify``: ``BEGIN; INSERT; NOTIFY outbox_effects; END``: what a
  writer pays when every commit carries a wake-up (PostgreSQL serialises the
  commits of notifying transactions on one global lock);
- ``insert_notify_1_in_10``: the same NOTIFY in one transaction in ten (what a
  throttled writer, one NOTIFY per window, pays under load);
- ``two_rows``: ``BEGIN; INSERT; INSERT; END``: two narrow rows in one commit;
- ``step_shape``: ``BEGIN;`` one statement that updates a state row, inserts a
  step row and inserts one pending ``outbox_effects`` row (the real table, with
  its indexes) ``; END``: what ``run.transaction`` with one intent does, in SQL,
  with the driver's three round trips.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

from bench.delivery import DATABASE, Bench, log, summary
from bench.write import wal_lsn

INSERT = "INSERT INTO bench_scratch (id, body) VALUES (gen_random_uuid(), '{\"w\": 1}');\n"
SCRIPTS: dict[str, str] = {
    "insert": INSERT,
    "insert_tx": "BEGIN;\n" + INSERT + "END;\n",
    "insert_notify": "BEGIN;\n" + INSERT + "NOTIFY outbox_effects;\nEND;\n",
    "insert_notify_1_in_10": (
        "\\set r random(1, 10)\n"
        "BEGIN;\n" + INSERT + "\\if :r = 1\nNOTIFY outbox_effects;\n\\endif\nEND;\n"
    ),
    "two_rows": "BEGIN;\n" + INSERT + INSERT + "END;\n",
    "step_shape": (
        "\\set s :client_id + 1\n"
        "BEGIN;\n"
        "WITH run AS (UPDATE bench_floor_state SET state = '{\"cursor\": 1}', step = step + 1 "
        "WHERE id = :s RETURNING id), "
        "step AS (INSERT INTO bench_floor_steps (run_id, step_id, result) "
        "SELECT id, gen_random_uuid()::text, 'null' FROM run RETURNING run_id) "
        "INSERT INTO outbox_effects (id, kind, payload, payload_hash, idempotency_key, status) "
        "SELECT gen_random_uuid(), 'bench.floor', '{}', md5('{}'), gen_random_uuid()::text, "
        "'pending' FROM step;\n"
        "END;\n"
    ),
}
SETUP = """
CREATE TABLE IF NOT EXISTS bench_floor_state (
    id INTEGER PRIMARY KEY, step BIGINT NOT NULL, state JSONB NOT NULL
) WITH (fillfactor = 80);
INSERT INTO bench_floor_state SELECT g, 0, '{}' FROM generate_series(1, 64) AS g
    ON CONFLICT DO NOTHING;
CREATE TABLE IF NOT EXISTS bench_floor_steps (
    run_id INTEGER NOT NULL, step_id TEXT NOT NULL, result JSONB,
    completed_at TIMESTAMPTZ NOT NULL DEFAULT now(), PRIMARY KEY (run_id, step_id)
);
"""
TPS = re.compile(r"^tps = ([0-9.]+)", re.MULTILINE)
PROCESSED = re.compile(r"^number of transactions actually processed: (\d+)", re.MULTILINE)
LATENCY = re.compile(r"^latency average = ([0-9.]+) ms", re.MULTILINE)


def pgbench(bench: Bench, script: Path, clients: int, seconds: float) -> dict[str, float]:
    """One pgbench run; transactions/s (without connection time) and mean latency."""
    server = bench.server
    args = [
        str(server.bin("pgbench")),
        "-n",
        "-c",
        str(clients),
        "-j",
        str(clients),
        "-T",
        str(max(1, round(seconds))),
        "-f",
        str(script),
        "-h",
        str(server.socket_dir),
        "-U",
        "postgres",
        DATABASE,
    ]
    lsn = wal_lsn(bench)
    done = subprocess.run(args, capture_output=True, text=True, timeout=seconds + 120)
    wal = wal_lsn(bench) - lsn
    if done.returncode != 0:
        raise RuntimeError(f"pgbench failed ({done.returncode}): {done.stderr[-2000:]}")
    tps = TPS.search(done.stdout)
    latency = LATENCY.search(done.stdout)
    if tps is None:
        raise RuntimeError(f"pgbench printed no tps:\n{done.stdout[-2000:]}")
    count = PROCESSED.search(done.stdout)
    return {
        "rate": float(tps[1]),
        "latency_ms": float(latency[1]) if latency else 0.0,
        "wal_bytes_per_tx": wal / int(count[1]) if count and int(count[1]) else 0.0,
    }


def floor_section(
    bench: Bench,
    workdir: Path,
    *,
    clients: tuple[int, ...],
    seconds: float,
    reps: int,
    scripts: tuple[str, ...] = tuple(SCRIPTS),
) -> dict[str, Any]:
    """Every script at every client count, ``reps`` times, order rotated between reps."""
    paths: dict[str, Path] = {}
    for name in scripts:
        paths[name] = workdir / f"pgbench-{name}.sql"
        paths[name].write_text(SCRIPTS[name])
    with bench.connect() as conn:
        conn.execute(SETUP)
    pgbench(bench, paths[scripts[0]], 2, 1)  # warm
    out: dict[str, Any] = {"seconds": seconds, "scripts": {n: SCRIPTS[n] for n in scripts}}
    for count in clients:
        got: dict[str, list[dict[str, float]]] = {name: [] for name in scripts}
        for rep in range(reps):
            order = list(scripts[rep % len(scripts) :] + scripts[: rep % len(scripts)])
            for name in order:
                with bench.connect() as conn:
                    conn.execute("TRUNCATE bench_scratch, bench_floor_steps")
                    conn.execute("DELETE FROM outbox_effects WHERE kind = 'bench.floor'")
                    conn.execute("CHECKPOINT")
                got[name].append(pgbench(bench, paths[name], count, seconds))
        result: dict[str, Any] = {}
        for name, runs in got.items():
            result[name] = {key: summary([r[key] for r in runs]) for key in runs[0]}
        for name in scripts:
            if name != "insert_tx" and "insert_tx" in got:
                ratios = [
                    r["rate"] / b["rate"] for r, b in zip(got[name], got["insert_tx"], strict=True)
                ]
                result[name]["ratio_to_insert_tx"] = summary(ratios)
        out[str(count)] = result
        log(
            f"pgbench {count} client(s): "
            + ", ".join(f"{n} {result[n]['rate']['median']:.0f}/s" for n in scripts)
        )
    with bench.connect() as conn:
        conn.execute("TRUNCATE bench_scratch, bench_floor_steps")
        conn.execute("DELETE FROM outbox_effects WHERE kind = 'bench.floor'")
    return out
