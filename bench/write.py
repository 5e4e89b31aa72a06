"""The write path: steps versus a bare insert, the pgbench floor, and DBOS.

- ``write``: threads of one process, each with its own run, calling
  ``run.transaction`` with one ``tx.intend``, next to a one-row insert
  transaction through the same driver (SQLAlchemy on psycopg) into a scratch
  table; wake-up variants: the default throttle (``step``), a NOTIFY in every
  commit (``notify_window_ms=0``) and none while measuring (a window of an hour).
  Every variant is measured next to the others in each repetition, order rotated.
- ``pgbench``: the same work in SQL (:data:`SCRIPTS`), the floor of the schema.
- ``dbos``: DBOS Transact no-op two-step workflows (:mod:`bench.dbos_steps`, a
  subprocess; its system database on the same server).
"""

from __future__ import annotations

import functools
import re
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import Column, Engine, MetaData, Table, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.dialects.postgresql import UUID as PG_UUID

from bench.harness import DATABASE, Bench, Meter, log, run_python, summarize, summary
from outbox import Outbox, Settings, StepTransaction
from outbox.shards import shard_of
from outbox.storage.engine import make_engine

WRITE_KIND = "bench.write"
scratch = Table(
    "bench_scratch",
    MetaData(),
    Column("id", PG_UUID(as_uuid=True), primary_key=True),
    Column("body", JSONB, nullable=False),
)
#: Variant -> notify_window_ms: the default throttle, a NOTIFY in every commit, none (an hour).
DEFAULT_WINDOW = Settings.model_fields["notify_window_ms"].default
VARIANTS = {"step": DEFAULT_WINDOW, "step_notify_every_commit": 0.0, "step_no_notify": 3_600_000.0}
Work = Callable[[int], object]
WRITERS = (1, 4, 8)


def run_writers(
    bench: Bench, writers: int, seconds: float, make: Callable[[int], Work]
) -> dict[str, float]:
    """``writers`` threads calling their work(i) for ``seconds``; rate and costs per call."""
    works = [make(w) for w in range(writers)]
    barrier, stop = threading.Barrier(writers + 1), threading.Event()
    counts, errors = [0] * writers, []

    def loop(w: int) -> None:
        barrier.wait()
        try:
            while not stop.is_set():
                works[w](counts[w])
                counts[w] += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(w,), daemon=True) for w in range(writers)]
    for thread in threads:
        thread.start()
    xid, lsn = bench.next_xid(), bench.wal_lsn()
    with Meter().measure() as meter:
        barrier.wait()
        time.sleep(seconds)
        stop.set()
        for thread in threads:
            thread.join(60)
    if errors:
        raise RuntimeError(f"a writer failed: {errors[0]!r}") from errors[0]
    total = max(1, sum(counts))
    return {
        "rate": total / meter.wall,
        "write_xids_per_tx": (bench.next_xid() - xid) / total,
        "wal_bytes_per_tx": (bench.wal_lsn() - lsn) / total,
        "client_cpu_us_per_tx": 1e6 * meter.client_cpu / total,
        "server_cpu_us_per_tx": 1e6 * meter.server_cpu / total,
    }


def bare_insert(engine: Engine) -> Callable[[int], Work]:
    def make(w: int) -> Work:
        def work(i: int) -> None:
            with engine.begin() as conn:
                conn.execute(scratch.insert(), {"id": uuid.uuid4(), "body": {"w": w, "i": i}})

        return work

    return make


#: The hand-written floor of a step's database work: the caller's row and one intent row.
PAIR = (
    "INSERT INTO outbox_effects (id, shard, kind, payload, payload_hash, idempotency_key,"
    " status) VALUES (:id, :shard, 'bench.write', CAST(:payload AS jsonb), :hash, :key,"
    " 'pending')"
)


def insert_pair(engine: Engine) -> Callable[[int], Work]:
    """The caller's row and one intent row inserted by hand, one transaction (no run, no step)."""

    def make(w: int) -> Work:
        def work(i: int) -> None:
            with engine.begin() as conn:
                conn.execute(scratch.insert(), {"id": uuid.uuid4(), "body": {"w": w, "i": i}})
                key = uuid.uuid4().hex
                effect = uuid.uuid4()
                conn.execute(
                    text(PAIR),
                    {
                        "id": effect,
                        "shard": shard_of(effect),
                        "payload": f'{{"i": {i}, "w": {w}}}',
                        "hash": key,
                        "key": key,
                    },
                )

        return work

    return make


def steps(ob: Outbox) -> Callable[[int], Work]:
    def make(w: int) -> Work:
        run = ob.start_run(agent="bench-write", version="1")

        def work(i: int) -> None:
            def step(tx: StepTransaction) -> None:
                tx.intend(WRITE_KIND, {"w": w, "i": i})

            run.transaction(f"s{i}", step)

        return work

    return make


def write(bench: Bench, workdir: Path, quick: bool) -> dict[str, Any]:
    seconds, reps = (2.0, 2) if quick else (4.0, 3)
    engine = make_engine(bench.dsn)
    outboxes = {
        name: Outbox.connect(bench.dsn, notify_window_ms=ms) for name, ms in VARIANTS.items()
    }
    makers = {
        "bare_insert": functools.partial(bare_insert, engine),
        "insert_pair": functools.partial(insert_pair, engine),
    }
    makers.update({name: functools.partial(steps, ob) for name, ob in outboxes.items()})
    names = list(makers)
    out: dict[str, Any] = {"seconds": seconds}
    try:
        # Warm as many connections as the most writers will use (their backends'
        # caches, compiled functions, prepared statements): the pools hand out the
        # last one returned, so a connection first used at 8 writers would
        # otherwise warm up inside that measurement.
        for make in makers.values():
            run_writers(bench, max(WRITERS), 0.5, make())
        for count in WRITERS:
            got: dict[str, list[dict[str, float]]] = {name: [] for name in names}
            for rep in range(reps):
                for name in names[rep % len(names) :] + names[: rep % len(names)]:
                    bench.reset(runs=True)
                    got[name].append(run_writers(bench, count, seconds, makers[name]()))
                log(
                    f"write {count} writer(s): "
                    + ", ".join(f"{n} {got[n][-1]['rate']:.0f}/s" for n in names)
                )
            result = {name: summarize(r) for name, r in got.items()}
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


# -- pgbench --------------------------------------------------------------------------

INSERT = "INSERT INTO bench_scratch (id, body) VALUES (gen_random_uuid(), '{\"w\": 1}');\n"
#: ``insert_tx`` has the round trips of a driver's explicit transaction; ``step_shape``
#: does what ``run.transaction`` with one intent does (a state row updated, a step
#: row and a pending ``outbox_effects`` row inserted, one statement), in SQL.
SCRIPTS: dict[str, str] = {
    "insert": INSERT,
    "insert_tx": "BEGIN;\n" + INSERT + "END;\n",
    "insert_notify": "BEGIN;\n" + INSERT + "NOTIFY outbox_effects;\nEND;\n",
    "insert_notify_1_in_10": (
        "\\set r random(1, 10)\nBEGIN;\n"
        + INSERT
        + "\\if :r = 1\nNOTIFY outbox_effects;\n\\endif\nEND;\n"
    ),
    "two_rows": "BEGIN;\n" + INSERT + INSERT + "END;\n",
    "step_shape": (
        "\\set s :client_id + 1\nBEGIN;\n"
        "WITH run AS (UPDATE bench_floor_state SET state = '{\"cursor\": 1}', step = step + 1 "
        "WHERE id = :s RETURNING id), "
        "step AS (INSERT INTO bench_floor_steps (run_id, step_id, result) "
        "SELECT id, gen_random_uuid()::text, 'null' FROM run RETURNING run_id) "
        "INSERT INTO outbox_effects (id, shard, kind, payload, payload_hash, idempotency_key, "
        "status) SELECT id, outbox_shard_of(id), 'bench.floor', '{}', md5('{}'), "
        "gen_random_uuid()::text, 'pending' FROM (SELECT gen_random_uuid() AS id FROM step) AS s;"
        "\nEND;\n"
    ),
}
FLOOR_TABLES = """
CREATE TABLE IF NOT EXISTS bench_floor_state (
    id INTEGER PRIMARY KEY, step BIGINT NOT NULL, state JSONB NOT NULL) WITH (fillfactor = 80);
INSERT INTO bench_floor_state SELECT g, 0, '{}' FROM generate_series(1, 64) AS g
    ON CONFLICT DO NOTHING;
CREATE TABLE IF NOT EXISTS bench_floor_steps (
    run_id INTEGER NOT NULL, step_id TEXT NOT NULL, result JSONB,
    completed_at TIMESTAMPTZ NOT NULL DEFAULT now(), PRIMARY KEY (run_id, step_id));
"""
FLOOR_RESET = (
    "TRUNCATE bench_scratch, bench_floor_steps; "
    "DELETE FROM outbox_effects WHERE kind = 'bench.floor'"
)


def _pgbench_value(pattern: str, text: str) -> float:
    found = re.search(pattern, text, re.MULTILINE)
    if found is None:
        raise RuntimeError(f"pgbench printed no {pattern!r}:\n{text[-2000:]}")
    return float(found[1])


def pgbench_once(bench: Bench, script: Path, clients: int, seconds: float) -> dict[str, float]:
    """One ``pgbench -n -c N -j N -T S -f SCRIPT``: tx/s, mean latency, WAL per transaction."""
    server = bench.server
    args = [str(server.bin("pgbench")), "-n", "-c", str(clients), "-j", str(clients)]
    args += ["-T", str(max(1, round(seconds))), "-f", str(script)]
    args += ["-h", str(server.socket_dir), "-U", "postgres", DATABASE]
    lsn = bench.wal_lsn()
    done = subprocess.run(args, capture_output=True, text=True, timeout=seconds + 120)
    wal = bench.wal_lsn() - lsn
    if done.returncode != 0:
        raise RuntimeError(f"pgbench failed ({done.returncode}): {done.stderr[-2000:]}")
    count = _pgbench_value(r"^number of transactions actually processed: (\d+)", done.stdout)
    return {
        "rate": _pgbench_value(r"^tps = ([0-9.]+)", done.stdout),
        "latency_ms": _pgbench_value(r"^latency average = ([0-9.]+) ms", done.stdout),
        "wal_bytes_per_tx": wal / max(1.0, count),
    }


def pgbench(bench: Bench, workdir: Path, quick: bool) -> dict[str, Any]:
    """Every script at 1/4/8 clients, repeated, order rotated; ratios to ``insert_tx``."""
    seconds, reps = (2.0, 1) if quick else (4.0, 3)
    names = [n for n in SCRIPTS if not (quick and n == "insert_notify_1_in_10")]
    paths = {name: workdir / f"pgbench-{name}.sql" for name in names}
    for name, path in paths.items():
        path.write_text(SCRIPTS[name])
    with bench.connect() as conn:
        conn.execute(FLOOR_TABLES)
    pgbench_once(bench, paths["insert"], 2, 1)  # warm
    out: dict[str, Any] = {"seconds": seconds, "scripts": {n: SCRIPTS[n] for n in names}}
    for clients in (1, 4, 8):
        got: dict[str, list[dict[str, float]]] = {name: [] for name in names}
        for rep in range(reps):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                with bench.connect() as conn:
                    conn.execute(FLOOR_RESET)
                    conn.execute("CHECKPOINT")
                got[name].append(pgbench_once(bench, paths[name], clients, seconds))
        result = {name: summarize(runs) for name, runs in got.items()}
        for name in names:
            ratios = [
                r["rate"] / b["rate"] for r, b in zip(got[name], got["insert_tx"], strict=True)
            ]
            result[name]["ratio_to_insert_tx"] = summary(ratios)
        out[str(clients)] = result
        log(
            f"pgbench {clients} client(s): "
            + ", ".join(f"{n} {result[n]['rate']['median']:.0f}/s" for n in names)
        )
    with bench.connect() as conn:
        conn.execute(FLOOR_RESET)
    return out


# -- DBOS -----------------------------------------------------------------------------


def dbos(bench: Bench, workdir: Path, quick: bool) -> dict[str, Any]:
    seconds, reps = (2.0, 2) if quick else (4.0, 3)
    url = bench.create_database("dbos_bench")
    args = ["-m", "bench.dbos_steps", url, "--threads", "1,8", "--seconds", str(seconds)]
    got = run_python([*args, "--reps", str(reps)], timeout=600 + 2 * reps * seconds)
    out: dict[str, Any] = {"seconds": seconds}
    for threads, runs in got.items():
        out[threads] = summarize(runs)
        log(f"DBOS {threads} thread(s): {out[threads]['steps_per_s']['median']:.0f} steps/s")
    return out
