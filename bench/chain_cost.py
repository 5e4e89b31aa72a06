"""The cost of governance on the hot paths: hash chains and gates, measured side by side.

``python -m bench.chain_cost`` starts an embedded PostgreSQL (durable settings:
fsync on) in a temporary directory and measures, alternating A and B rounds on
the same server:

- completion: ``complete_effects()`` of batches of 100 claimed effects, with the
  attempt-log chain trigger (``outbox_attempts_chain``) and with it dropped: the
  statement's server time per batch (from the client, one statement per
  transaction) and WAL bytes per effect;
- steps: a one-intent step through the client (``Run.transaction``), with the
  step chain computed in ``commit_step`` and with that computation replaced by
  a no-op: steps/s and WAL bytes per step; and with one gate on the intent's
  kind (whose condition does not match) against none.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import ColumnElement, Engine

from outbox import EmbeddedServer, Outbox
from outbox.gates import Gate
from outbox.storage import schema
from outbox.storage.engine import make_engine
from outbox.storage.migrate import migrate
from outbox.storage.sql import effects as effect_sql
from outbox.storage.sql import queue
from outbox.storage.sql import steps as step_sql

SEED = """
INSERT INTO outbox_effects (id, kind, payload, payload_hash, idempotency_key, status)
SELECT gen_random_uuid(), 'bench.chain', '{"n": 1}'::jsonb, md5('x'),
       %(tag)s || g::text, 'pending'
  FROM generate_series(1, %(n)s) AS g
"""


def wal(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint"
        ).fetchone()
    assert row is not None
    return int(row[0])


def complete_round(engine: Engine, dsn: str, batches: int) -> dict[str, float]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SEED, {"tag": uuid.uuid4().hex, "n": batches * 100})
        conn.execute("VACUUM ANALYZE outbox_effects")
    times: list[float] = []
    wal_bytes = 0
    for _ in range(batches):
        with engine.begin() as conn:
            claimed = conn.execute(
                queue.claim(queue.EFFECT_QUEUE),
                queue.claim_params({"kind": "bench.chain"}, limit=100, owner="b", lease_seconds=60),
            ).all()
        done = json.dumps(
            [
                {
                    "id": str(r.id),
                    "attempt": r.attempt,
                    "status": "succeeded",
                    "outcome": "succeeded",
                    "result": {"ok": True},
                    "error": None,
                    "delay": 0,
                    "detail": None,
                    "started_at": None,
                }
                for r in claimed
            ]
        )
        before = wal(dsn)
        started = time.perf_counter()
        with engine.begin() as conn:
            conn.execute(
                effect_sql.complete_effects(),
                {"owner": "b", "done": done, "ids": [r.id for r in claimed]},
            )
        times.append(time.perf_counter() - started)
        wal_bytes += wal(dsn) - before
    return {
        "complete_ms_per_100": statistics.median(times) * 1000,
        "wal_bytes_per_effect": wal_bytes / (batches * 100),
    }


@contextmanager
def unchained_steps() -> Iterator[None]:
    """``commit_step`` without the step-chain computation (the B side of the comparison)."""
    original = step_sql.next_step_head

    def head_unchanged(
        step_id: Any, kind: Any, result: Any, error: Any, state: Any = None, plan: Any = None
    ) -> ColumnElement[Any]:
        return schema.runs.c.step_head

    step_sql.next_step_head = head_unchanged
    step_sql.commit_step.cache_clear()
    try:
        yield
    finally:
        step_sql.next_step_head = original
        step_sql.commit_step.cache_clear()


def step_round(ob: Outbox, dsn: str, steps: int) -> dict[str, float]:
    run = ob.start_run("bench", "1")
    before = wal(dsn)
    started = time.perf_counter()
    for i in range(steps):

        def step(tx: Any, i: int = i) -> None:
            tx.intend("bench.step", {"i": i})

        run.transaction(f"s{i}", step)
    elapsed = time.perf_counter() - started
    return {"steps_per_s": steps / elapsed, "wal_bytes_per_step": (wal(dsn) - before) / steps}


def alternate(
    rounds: int, sides: dict[str, Callable[[], dict[str, float]]]
) -> dict[str, dict[str, float]]:
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for _ in range(rounds):
        for name, measure in sides.items():
            samples[name].append(measure())
    return {
        name: {key: statistics.median(s[key] for s in found) for key in found[0]}
        for name, found in samples.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="outbox-bench-chain-"))
    home.chmod(0o711)  # run as root, the server runs as its own user and must enter it
    server = EmbeddedServer(home)
    server.ensure_running()
    try:
        admin = server.dsn("postgres")
        dsns = {}
        for name in ("chained", "unchained"):
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f"DROP DATABASE IF EXISTS bench_{name}")
                conn.execute(f"CREATE DATABASE bench_{name}")
            dsns[name] = server.dsn(f"bench_{name}")
            engine = make_engine(dsns[name])
            migrate(engine)
            engine.dispose()
        with psycopg.connect(dsns["unchained"], autocommit=True) as conn:
            conn.execute("DROP TRIGGER outbox_attempts_chain ON outbox_effect_attempts")
        engines = {name: make_engine(dsn) for name, dsn in dsns.items()}

        def completing(name: str) -> Callable[[], dict[str, float]]:
            return lambda: complete_round(engines[name], dsns[name], args.batches)

        completion = alternate(args.rounds, {name: completing(name) for name in dsns})
        ob = Outbox.connect(dsns["chained"])

        def unchained() -> dict[str, float]:
            with unchained_steps():
                return step_round(ob, dsns["chained"], args.steps)

        steps = alternate(
            args.rounds,
            {
                "chained": lambda: step_round(ob, dsns["chained"], args.steps),
                "unchained": unchained,
            },
        )
        gate = Gate(name="g", kind="bench.step", when=[{"pointer": "/i", "op": "lt", "value": -1}])

        def gated() -> dict[str, float]:
            ob.apply_gates([gate])
            return step_round(ob, dsns["chained"], args.steps)

        def ungated() -> dict[str, float]:
            ob.remove_gates(["g"])
            return step_round(ob, dsns["chained"], args.steps)

        gates = alternate(args.rounds, {"no gate": ungated, "one gate on the kind": gated})
        ob.close()
        for engine in engines.values():
            engine.dispose()
        print(json.dumps({"completion": completion, "steps": steps, "gates": gates}, indent=2))
    finally:
        server.stop(mode="immediate")
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
