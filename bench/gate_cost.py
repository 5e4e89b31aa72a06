"""What approval gates cost an intent written through the SQL API: ``python -m bench.gate_cost``.

One embedded PostgreSQL (fsync on) in a temporary directory. Each round writes
``--intents`` intents with ``outbox_intend(kind, payload)``, one statement each,
all in one transaction (so the figure is the statement's own time, not the
commit's fsync), then rolls back. Four cases, rounds alternated:

- ``no gate``: ``outbox_gates`` is empty;
- ``gate on another kind``: one gate, on a kind the intents do not have;
- ``gate on the kind, not met``: one gate on the intents' kind whose condition
  (``/amount > 10000``) the payload does not meet: the intent stays ``pending``;
- ``gate on the kind, met``: the same gate and a payload that meets it: the
  intent commits ``awaiting_approval`` with its deadline.

Prints JSON: median µs per intent over ``--rounds`` rounds, per case.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import psycopg

from outbox.governance.gates import Gate
from outbox.storage.admin.embedded import EmbeddedServer
from outbox.storage.engine import make_engine
from outbox.storage.migrate import migrate

GATE = (
    "INSERT INTO outbox_gates (name, kind, conditions, timeout_seconds, on_timeout) "
    "VALUES (%(name)s, %(kind)s, %(conditions)s::jsonb, %(timeout_seconds)s, %(on_timeout)s)"
)
GATE_COLUMNS = ("name", "kind", "conditions", "timeout_seconds", "on_timeout")
CASES = {
    "no gate": (None, 500),
    "gate on another kind": ("payments.other", 500),
    "gate on the kind, not met": ("payments.send", 500),
    "gate on the kind, met": ("payments.send", 12_500),
}


def one_round(
    conn: psycopg.Connection[object], intents: int, gate: str | None, amount: int
) -> float:
    conn.execute("DELETE FROM outbox_gates")
    if gate is not None:
        when = [{"pointer": "/amount", "op": "gt", "value": 10_000}]
        row = Gate(name="large", kind=gate, when=when, timeout=3600).row()
        conn.execute(GATE, {k: row[k] for k in GATE_COLUMNS})
    conn.commit()
    payload = json.dumps({"to": "acct-7", "amount": amount})
    started = time.perf_counter()
    for _ in range(intents):
        conn.execute("SELECT outbox_intend('payments.send', %s::jsonb)", [payload])
    elapsed = time.perf_counter() - started
    status = conn.execute("SELECT DISTINCT status FROM outbox_effects").fetchall()
    assert len(status) == 1, status
    conn.rollback()
    return elapsed / intents * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--intents", type=int, default=2000)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="outbox-bench-gates-"))
    home.chmod(0o711)  # run as root, the server runs as its own user and must enter it
    server = EmbeddedServer(home)
    server.ensure_running()
    try:
        admin = server.dsn("postgres")
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute("DROP DATABASE IF EXISTS bench_gates")
            conn.execute("CREATE DATABASE bench_gates")
        dsn = server.dsn("bench_gates")
        engine = make_engine(dsn)
        migrate(engine)
        engine.dispose()
        samples: dict[str, list[float]] = {name: [] for name in CASES}
        with psycopg.connect(dsn) as conn:
            one_round(conn, 200, None, 500)  # warm the plan caches
            for _ in range(args.rounds):
                for name, (gate, amount) in CASES.items():
                    samples[name].append(one_round(conn, args.intents, gate, amount))
        print(
            json.dumps(
                {
                    "us_per_intent": {
                        n: round(statistics.median(s), 1) for n, s in samples.items()
                    },
                    "rounds": args.rounds,
                    "intents_per_round": args.intents,
                },
                indent=2,
            )
        )
    finally:
        server.stop(mode="immediate")
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
