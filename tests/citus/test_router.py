"""The router-query checker on a toy schema shaped like ours (runs, steps, effects by ``shard``)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import psycopg
import pytest

from tests.citus_router import check_routing
from tests.citus_support import CitusCluster, CitusDatabase, node_port_of

RUN = UUID(int=1)

# Runs, steps and effects co-located by a logical shard column; gates a reference table;
# step() the write function delegated to the worker holding the shard, wrapper() the
# same call made from a function on the coordinator.
SCHEMA = [
    """CREATE TABLE runs (shard smallint NOT NULL, id uuid NOT NULL, key text NOT NULL,
        next_seq int NOT NULL DEFAULT 0, updated_at timestamptz,
        PRIMARY KEY (shard, id), UNIQUE (shard, key))""",
    """CREATE TABLE steps (shard smallint NOT NULL, run_id uuid NOT NULL, seq int NOT NULL,
        name text NOT NULL, PRIMARY KEY (shard, run_id, seq))""",
    """CREATE TABLE effects (shard smallint NOT NULL, id bigint NOT NULL, run_id uuid NOT NULL,
        seq int NOT NULL, status text NOT NULL DEFAULT 'pending', owner text,
        attempt int NOT NULL DEFAULT 0, lease_until timestamptz, PRIMARY KEY (shard, id))""",
    "CREATE TABLE gates (name text PRIMARY KEY, open boolean NOT NULL)",
    "SELECT create_distributed_table('runs', 'shard', shard_count := 8)",
    "SELECT create_distributed_table('steps', 'shard', colocate_with := 'runs')",
    "SELECT create_distributed_table('effects', 'shard', colocate_with := 'runs')",
    "SELECT create_reference_table('gates')",
    """CREATE FUNCTION step(p_shard smallint, p_run uuid, p_name text) RETURNS int
        LANGUAGE plpgsql AS $$
        DECLARE v_seq int;
        BEGIN
            UPDATE runs SET next_seq = next_seq + 1 WHERE shard = p_shard AND id = p_run
                RETURNING next_seq INTO v_seq;
            INSERT INTO steps VALUES (p_shard, p_run, v_seq, p_name);
            INSERT INTO effects (shard, id, run_id, seq) VALUES (p_shard, v_seq, p_run, v_seq);
            RETURN v_seq;
        END $$""",
    """SELECT create_distributed_function('step(smallint, uuid, text)', '$1',
        colocate_with := 'runs', force_delegation := true)""",
    """CREATE FUNCTION wrapper(p_shard smallint, p_run uuid, p_name text) RETURNS int
        LANGUAGE plpgsql AS $$ BEGIN RETURN step(p_shard, p_run, p_name); END $$""",
    "INSERT INTO gates VALUES ('smtp', true)",
    "INSERT INTO runs (shard, id, key) VALUES (1, '00000000-0000-0000-0000-000000000001', 'r1')",
    "INSERT INTO runs (shard, id, key) VALUES (2, '00000000-0000-0000-0000-000000000001', 'r1')",
    "SELECT step(1::smallint, '00000000-0000-0000-0000-000000000001', 'first')",
]

CLAIM = """
WITH picked AS (
    SELECT id FROM effects WHERE shard = %(shard)s AND status = 'pending'
    ORDER BY id LIMIT %(n)s FOR UPDATE SKIP LOCKED),
claimed AS (
    UPDATE effects SET status = 'claimed', owner = %(owner)s, attempt = attempt + 1,
           lease_until = now() + interval '30 seconds'
     WHERE shard = %(shard)s AND id = ANY ((SELECT array_agg(id) FROM picked)::bigint[])
    RETURNING id, attempt),
flag AS (SELECT EXISTS (SELECT 1 FROM effects WHERE shard = %(shard)s AND status = 'held') AS m)
SELECT claimed.*, flag.m FROM flag LEFT JOIN claimed ON true
"""


@pytest.fixture(scope="module")
def coordinator(citus_module_db: CitusDatabase) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(citus_module_db.dsn, autocommit=True) as conn:
        for statement in SCHEMA:
            conn.execute(statement)
        yield conn


@pytest.fixture(scope="module")
def worker_of_shard_1(coordinator: psycopg.Connection[Any]) -> str:
    return f"127.0.0.1:{node_port_of(coordinator, 'runs', 1)}"


@pytest.mark.parametrize(
    ("statement", "params", "kind"),
    [
        ("SELECT * FROM effects WHERE shard = %s AND status = 'pending'", [1], "fast-path router"),
        (
            "SELECT * FROM effects e JOIN steps s USING (shard, run_id, seq) WHERE e.shard = %s",
            [1],
            "router",
        ),
        (CLAIM, {"shard": 1, "n": 5, "owner": "o1"}, "router"),
        (
            "INSERT INTO runs (shard, id, key, updated_at) VALUES (%s, %s, 'r1', now())"
            " ON CONFLICT (shard, key) DO UPDATE SET updated_at = EXCLUDED.updated_at",
            [1, UUID(int=9)],
            "router",
        ),
        ("SELECT step(%s::smallint, %s, 'second')", [1, RUN], "delegated function"),
    ],
    ids=["fast-path select", "co-located join", "claim", "upsert", "delegated call"],
)
def test_single_shard_statements_are_recognised(
    coordinator: psycopg.Connection[Any],
    worker_of_shard_1: str,
    statement: str,
    params: Any,
    kind: str,
) -> None:
    routing = check_routing(coordinator, statement, params)
    assert routing.single_shard, routing.explain()
    assert routing.kind == kind, routing.explain()
    assert routing.nodes == {worker_of_shard_1}, routing.explain()


def test_a_reference_table_read_is_one_local_task(coordinator: psycopg.Connection[Any]) -> None:
    routing = check_routing(coordinator, "SELECT open FROM gates WHERE name = %s", ["smtp"])
    assert routing.single_shard and routing.nodes == {"local"}, routing.explain()


@pytest.mark.parametrize(
    ("statement", "params", "tasks"),
    [
        ("SELECT * FROM effects WHERE status = 'pending'", None, 8),
        ("SELECT * FROM effects WHERE shard = ANY(%s::smallint[])", [[1, 2]], 2),
        # the step's three statements, each routed from the coordinator
        ("SELECT wrapper(%s::smallint, %s, 'w')", [1, RUN], 3),
        # a CTE feeding an INSERT ... SELECT: the rows travel through the coordinator
        (
            "WITH r AS (UPDATE runs SET next_seq = next_seq + 1 WHERE shard = %s AND key = 'r1'"
            " RETURNING shard, id, next_seq)"
            " INSERT INTO steps SELECT shard, id, next_seq, 'cte' FROM r",
            [1],
            2,
        ),
    ],
    ids=["all shards", "two shards", "wrapper on the coordinator", "cte insert-select"],
)
def test_statements_of_several_tasks_are_not_single_shard(
    coordinator: psycopg.Connection[Any], statement: str, params: Any, tasks: int
) -> None:
    routing = check_routing(coordinator, statement, params)
    assert routing.error is None, routing.explain()
    assert not routing.single_shard and routing.kind == "multi-task", routing.explain()
    assert len(routing.commands) == tasks, routing.explain()


@pytest.mark.parametrize(
    ("statement", "params", "refusal"),
    [
        ("SELECT id FROM effects WHERE status = 'pending' FOR UPDATE SKIP LOCKED", None, "FOR"),
        (
            "UPDATE effects SET lease_until = CASE WHEN status = 'claimed' THEN now() END"
            " WHERE shard = %s AND id = 1",
            [1],
            "CASE or COALESCE",
        ),
        (
            "UPDATE effects SET status = 'x' WHERE shard = %s AND id = 1"
            " RETURNING pg_notify('outbox', id::text)",
            [1],
            "RETURNING",
        ),
    ],
    ids=["for update on all shards", "now() in CASE", "pg_notify in RETURNING"],
)
def test_refused_statements_are_reported_not_raised(
    coordinator: psycopg.Connection[Any], statement: str, params: Any, refusal: str
) -> None:
    routing = check_routing(coordinator, statement, params)
    assert routing.kind == "error" and not routing.single_shard, routing.explain()
    assert routing.sqlstate == "0A000" and routing.error is not None
    assert refusal in routing.error


def test_a_statement_on_the_coordinator_alone_is_not_single_shard(
    coordinator: psycopg.Connection[Any],
) -> None:
    routing = check_routing(coordinator, "SELECT pg_notify('outbox', %s)", ["1"])
    assert routing.kind == "coordinator only" and not routing.single_shard, routing.explain()


def test_the_checked_statement_is_rolled_back_unless_asked_to_commit(
    coordinator: psycopg.Connection[Any],
) -> None:
    def steps() -> int:
        row = coordinator.execute("SELECT count(*) FROM steps WHERE shard = 2").fetchone()
        assert row is not None
        return int(row[0])

    before = steps()
    call = "SELECT step(%s::smallint, %s, 'kept')"
    assert check_routing(coordinator, call, [2, RUN]).delegated
    assert steps() == before
    # Outside a transaction block the call is delegated too, and commits.
    routing = check_routing(coordinator, call, [2, RUN], rollback=False)
    assert routing.delegated and routing.single_shard, routing.explain()
    assert steps() == before + 1
    row = coordinator.execute("SHOW citus.log_remote_commands").fetchone()
    assert row == ("off",)  # the checker's settings do not outlive it


def test_the_checker_needs_an_autocommit_connection(citus_module_db: CitusDatabase) -> None:
    with psycopg.connect(citus_module_db.dsn) as conn, pytest.raises(ValueError, match="auto"):
        check_routing(conn, "SELECT 1")


def test_the_node_named_is_the_one_holding_the_shard(
    citus_cluster: CitusCluster, coordinator: psycopg.Connection[Any]
) -> None:
    seen = set()
    for shard in range(8):
        routing = check_routing(
            coordinator,
            "UPDATE runs SET updated_at = %s WHERE shard = %s AND key = 'r1'",
            [datetime.now(UTC), shard],
        )
        assert routing.single_shard, routing.explain()
        port = node_port_of(coordinator, "runs", shard)
        assert routing.nodes == {f"127.0.0.1:{port}"}, routing.explain()
        seen.add(port)
    assert seen == {worker.port for worker in citus_cluster.workers}
