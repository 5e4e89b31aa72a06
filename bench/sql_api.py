"""The SQL API's write cost and its NOTIFY throttle, measured: ``python -m bench.sql_api``.

One embedded PostgreSQL in a temporary directory, then:

1. pgbench (shipped with the server) at 1 and 8 clients, each script one
   transaction (``BEGIN; ...; END``):

   - ``step_statement``: a step written by hand: one statement that updates
     the run, inserts the step and inserts one intent (the rows
     ``outbox_write_step`` must write, none of its checks), no NOTIFY;
   - ``sql_step``: ``outbox_intend(..., run_id, step_id)`` then
     ``outbox_commit_step(...)``, the SQL API's throttled wake-up (3 ms window);
   - ``sql_step_one_call``: the same in one call (``outbox_commit_step(...,
     intents => ...)``);
   - ``sql_step_notify_every_commit``: ``sql_step`` with a window of 0;
   - ``sql_step_no_notify``: ``sql_step`` with a window of an hour;
   - ``insert_intent``: the caller's row plus one intent row inserted by hand
     (``INSERT``), no NOTIFY (the floor of plain outbox use);
   - ``insert_intent_notify``: the same with a ``NOTIFY`` in every transaction;
   - ``sql_intend``: the caller's row plus ``outbox_intend(kind, payload)``,
     and the same with a window of 0 (``sql_intend_notify_every_commit``) and
     of an hour (``sql_intend_no_notify``).

2. The Python client at 1 and 8 writer threads: ``run.transaction`` with one
   intent (its own one-statement step) against the same step written through
   the SQL API (``outbox_commit_step(..., intents => ...)`` on the same engine).

Figures are medians over ``--reps`` repetitions (order rotated), in
transactions per second, with ratios to ``step_statement`` and
``insert_intent``. ``--durability off`` turns fsync off (the test suite's
setting), which isolates CPU and lock costs from the disk.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import text

from outbox import Outbox, StepTransaction
from outbox.storage.admin.embedded import EmbeddedServer
from outbox.storage.engine import make_engine
from outbox.storage.migrate import migrate

DATABASE = "outbox_bench_sql_api"
NO_DURABILITY = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}
PAYLOAD = '{"to": "ap@example.com", "subject": "October", "n": 1}'
RUN = "('00000000-0000-0000-0000-' || lpad((:client_id + 1)::text, 12, '0'))::uuid"
STEP = "'s' || :s"
SCRIPTS: dict[str, str] = {
    "step_statement": (
        "WITH run AS (UPDATE outbox_runs SET state = coalesce(NULL, state), current_step = {step},"
        " step_count = step_count + 1"
        " WHERE id = {run} AND shard = outbox_shard_of({run})"
        " AND status IN ('runnable', 'running', 'waiting') RETURNING id, shard, step_count),"
        " step AS (INSERT INTO outbox_steps (run_id, shard, seq, step_id, kind, result)"
        " SELECT id, shard, step_count, {step}, 'transaction', '{{\"ok\": true}}' FROM run"
        " ON CONFLICT DO NOTHING RETURNING run_id, shard)"
        " INSERT INTO outbox_effects (id, shard, run_id, step_id, step_index, kind, payload,"
        " payload_hash, idempotency_key, status, available_at)"
        " SELECT gen_random_uuid(), shard, run_id, {step}, 0, 'bench.sql', '{payload}',"
        " md5('{payload}'), gen_random_uuid()::text, 'pending', now() FROM step"
        " ON CONFLICT DO NOTHING;\n"
    ),
    "sql_step": (
        "SELECT outbox_intend('bench.sql', '{payload}', run_id => {run}, step_id => {step});\n"
        "SELECT outbox_commit_step({run}, {step}, result => '{{\"ok\": true}}');\n"
    ),
    "sql_step_one_call": (
        "SELECT outbox_commit_step({run}, {step}, result => '{{\"ok\": true}}',"
        ' intents => \'[{{"kind": "bench.sql", "payload": {payload}}}]\');\n'
    ),
    "insert_intent": (
        "INSERT INTO bench_orders (id, body) VALUES (gen_random_uuid(), '{{\"w\": 1}}');\n"
        "INSERT INTO outbox_effects (id, shard, kind, payload, payload_hash, idempotency_key,"
        " status) SELECT id, outbox_shard_of(id), 'bench.sql', '{payload}', md5('{payload}'),"
        " gen_random_uuid()::text, 'pending' FROM gen_random_uuid() AS id;\n"
    ),
    "sql_intend": (
        "INSERT INTO bench_orders (id, body) VALUES (gen_random_uuid(), '{{\"w\": 1}}');\n"
        "SELECT outbox_intend('bench.sql', '{payload}');\n"
    ),
}
SCRIPTS["sql_step_notify_every_commit"] = SCRIPTS["sql_step"]
SCRIPTS["sql_step_no_notify"] = SCRIPTS["sql_step"]
SCRIPTS["sql_intend_notify_every_commit"] = SCRIPTS["sql_intend"]
SCRIPTS["sql_intend_no_notify"] = SCRIPTS["sql_intend"]
SCRIPTS["insert_intent_notify"] = SCRIPTS["insert_intent"] + "NOTIFY outbox_effects;\n"
#: Session settings per script (PGOPTIONS).
OPTIONS = {
    "sql_step_notify_every_commit": "-c outbox.notify_window_ms=0",
    "sql_step_no_notify": "-c outbox.notify_window_ms=3600000",
    "sql_intend_notify_every_commit": "-c outbox.notify_window_ms=0",
    "sql_intend_no_notify": "-c outbox.notify_window_ms=3600000",
}
SETUP = """
CREATE TABLE IF NOT EXISTS bench_orders (id uuid PRIMARY KEY, body jsonb NOT NULL);
SELECT outbox_start_run('bench', '1', run_id => ('00000000-0000-0000-0000-'
                        || lpad(g::text, 12, '0'))::uuid)
  FROM generate_series(1, 64) AS g;
"""
TPS = re.compile(r"^tps = ([0-9.]+)", re.MULTILINE)


def log(message: str) -> None:
    """Progress on stderr."""
    print(f"[bench.sql_api] {message}", file=sys.stderr, flush=True)


def script_text(name: str) -> str:
    """One transaction of ``name`` as a pgbench script."""
    body = SCRIPTS[name].format(run=RUN, step=STEP, payload=PAYLOAD)
    return "\\set s random(1, 9000000000000000000)\nBEGIN;\n" + body + "END;\n"


def reset(dsn: str) -> None:
    """Empty what the scripts write, so every measurement starts alike."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE bench_orders, outbox_steps, outbox_budget_ledger")
        conn.execute("TRUNCATE outbox_effects CASCADE")
        conn.execute("UPDATE outbox_runs SET state = '{}', current_step = NULL")
        conn.execute("VACUUM ANALYZE outbox_runs")
        conn.execute("CHECKPOINT")


def server_cpu(server: EmbeddedServer) -> float:
    """CPU seconds the server used so far: the postmaster, its live children, and the
    children it reaped (their time accumulates in its cutime/cstime)."""
    postmaster = int((server.pgdata / "postmaster.pid").read_text().split()[0])
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid, ppid = int(stat.parent.name), int(fields[1])
        if pid == postmaster:
            total += sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
        elif ppid == postmaster:
            total += int(fields[11]) + int(fields[12])
    return total / tick


def children_cpu() -> float:
    """CPU seconds of this process's reaped children (pgbench)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


PROCESSED = re.compile(r"^number of transactions actually processed: (\d+)", re.MULTILINE)


def pgbench(
    server: EmbeddedServer, script: Path, clients: int, seconds: int, options: str
) -> dict[str, float]:
    """One pgbench run: transactions per second, and CPU microseconds per transaction."""
    args = [str(server.bin("pgbench")), "-n", "-c", str(clients), "-j", str(clients)]
    args += ["-T", str(seconds), "-f", str(script), "-h", str(server.socket_dir)]
    args += ["-U", "postgres", DATABASE]
    env = {"PATH": "/usr/bin:/bin", "PGOPTIONS": options}
    cpu = server_cpu(server), children_cpu()
    done = subprocess.run(args, capture_output=True, text=True, timeout=seconds + 120, env=env)
    found, processed = TPS.search(done.stdout), PROCESSED.search(done.stdout)
    if done.returncode != 0 or found is None or processed is None:
        raise RuntimeError(f"pgbench {script.name} failed: {done.stderr[-2000:]}")
    count = max(1, int(processed[1]))
    return {
        "rate": float(found[1]),
        "server_cpu_us": 1e6 * (server_cpu(server) - cpu[0]) / count,
        "client_cpu_us": 1e6 * (children_cpu() - cpu[1]) / count,
    }


def python_rate(
    server: EmbeddedServer, dsn: str, writers: int, seconds: float, sql_api: bool
) -> dict[str, float]:
    """Steps per second of ``writers`` threads, each driving its own run, and CPU per step."""
    ob = Outbox.connect(dsn, pool_size=max(writers, 1))
    stop = threading.Event()
    counts = [0] * writers
    errors: list[BaseException] = []
    statement = text(
        "SELECT outbox_commit_step(:run_id, :step_id, result => 'null',"
        " intents => CAST(:intents AS jsonb))"
    )
    runs = [ob.start_run("bench-python", "1") for _ in range(writers)]
    barrier = threading.Barrier(writers + 1)

    def step(tx: StepTransaction, w: int, i: int) -> None:
        tx.intend("bench.sql", {"w": w, "i": i})

    def loop(w: int) -> None:
        run = runs[w]
        i = 0
        barrier.wait()
        try:
            while not stop.is_set():
                if sql_api:
                    intents = json.dumps([{"kind": "bench.sql", "payload": {"w": w, "i": i}}])
                    with ob.engine.begin() as conn:
                        conn.execute(
                            statement, {"run_id": run.id, "step_id": f"s{i}", "intents": intents}
                        )
                else:
                    run.transaction(f"s{i}", functools.partial(step, w=w, i=i))
                i += 1
        except BaseException as exc:  # reported below
            errors.append(exc)
        counts[w] = i

    threads = [threading.Thread(target=loop, args=(w,)) for w in range(writers)]
    try:
        for thread in threads:
            thread.start()
        cpu = server_cpu(server), time.process_time()
        barrier.wait()
        started = time.monotonic()
        time.sleep(seconds)
        stop.set()
        for thread in threads:
            thread.join(60)
        wall = time.monotonic() - started
        used = server_cpu(server) - cpu[0], time.process_time() - cpu[1]
    finally:
        ob.close()
    if errors:
        raise RuntimeError(f"a writer failed: {errors[0]!r}") from errors[0]
    total = max(1, sum(counts))
    return {
        "rate": total / wall,
        "server_cpu_us": 1e6 * used[0] / total,
        "client_cpu_us": 1e6 * used[1] / total,
    }


def rotate(names: Sequence[str], rep: int) -> list[str]:
    """The names in another order each repetition, so drift favours none."""
    shift = rep % len(names)
    return list(names[shift:]) + list(names[:shift])


def measure(
    names: Sequence[str], reps: int, one: Callable[[str], dict[str, float]], label: str
) -> dict[str, dict[str, float]]:
    """Median of each figure of each name over ``reps`` rotated repetitions."""
    got: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for rep in range(reps):
        for name in rotate(names, rep):
            got[name].append(one(name))
            last = got[name][-1]
            log(
                f"{label} {name}: {last['rate']:.0f}/s, server {last['server_cpu_us']:.0f} us,"
                f" client {last['client_cpu_us']:.0f} us per transaction"
            )
    return {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for name, runs in got.items()
    }


def load_average() -> float:
    """The machine's one-minute load average (other processes disturb the figures)."""
    return os.getloadavg()[0]


def main(argv: Sequence[str] | None = None) -> int:
    """Run both parts and print (and optionally write) the figures."""
    parser = argparse.ArgumentParser(prog="python -m bench.sql_api", description=__doc__)
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--durability", choices=["on", "off"], default="on")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--scripts", nargs="+", choices=list(SCRIPTS), default=list(SCRIPTS))
    parser.add_argument("--no-python", action="store_true", help="pgbench only")
    args = parser.parse_args(argv)

    home = Path(tempfile.mkdtemp(prefix="outbox-bench-sql-api-"))
    home.chmod(0o711)  # run as root, the server runs as its own user and must enter it
    server = EmbeddedServer(home, settings=NO_DURABILITY if args.durability == "off" else {})
    results: dict[str, Any] = {"seconds": args.seconds, "reps": args.reps}
    results["durability"] = args.durability
    results["load_at_start"] = load_average()
    try:
        server.ensure_running()
        with psycopg.connect(server.dsn("postgres"), autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
            conn.execute(f"CREATE DATABASE {DATABASE}")
        dsn = server.dsn(DATABASE)
        engine = make_engine(dsn)
        migrate(engine)
        engine.dispose()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(SETUP)
        paths = {}
        for name in SCRIPTS:
            paths[name] = home / f"{name}.sql"
            paths[name].write_text(script_text(name))
        for clients in args.clients:

            def one(name: str, clients: int = clients) -> dict[str, float]:
                reset(dsn)
                return pgbench(server, paths[name], clients, args.seconds, OPTIONS.get(name, ""))

            one("sql_step")  # warm: caches, plans, the functions' compiled bodies
            rates = measure(args.scripts, args.reps, one, f"pgbench -c {clients}")
            for base in ("step_statement", "insert_intent", "sql_step"):
                for figures in rates.values():
                    if base in rates:
                        figures[f"to_{base}"] = figures["rate"] / rates[base]["rate"]
            results[f"pgbench_{clients}"] = rates
            results[f"load_after_pgbench_{clients}"] = load_average()
        for writers in [] if args.no_python else args.clients:

            def client(name: str, writers: int = writers) -> dict[str, float]:
                reset(dsn)
                sql_api = name == "python_via_sql_api"
                return python_rate(server, dsn, writers, args.seconds, sql_api)

            names = ["python_client", "python_via_sql_api"]
            rates = measure(names, args.reps, client, f"{writers} writers")
            rates["python_via_sql_api"]["to_python_client"] = (
                rates["python_via_sql_api"]["rate"] / rates["python_client"]["rate"]
            )
            results[f"python_{writers}"] = rates
        results["load_at_end"] = load_average()
    finally:
        server.stop(mode="immediate")
        shutil.rmtree(home, ignore_errors=True)
    report = json.dumps(results, indent=2)
    print(report)
    if args.json is not None:
        args.json.write_text(report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
