"""The test cluster itself: real Citus nodes, fresh databases, a worker killed and restarted."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import psycopg
import pytest

from tests import citus_support
from tests.citus_support import (
    CITUS_DIR_ENV,
    CitusCluster,
    CitusDatabase,
    CitusUnavailable,
    find_citus_dir,
    node_port_of,
)


def _port(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT inet_server_port()").fetchone()
    assert row is not None
    return int(row[0])


def test_every_node_runs_citus_and_the_workers_hold_the_shards(
    citus_cluster: CitusCluster, citus_db: CitusDatabase
) -> None:
    ports = [node.port for node in citus_cluster.nodes]
    assert [_port(citus_db.coordinator), *(_port(w) for w in citus_db.workers)] == ports
    for dsn in (citus_db.coordinator, *citus_db.workers):
        with psycopg.connect(dsn) as conn:
            version = conn.execute("SELECT citus_version()").fetchone()
        assert version is not None and version[0].startswith("Citus 14."), dsn
    with psycopg.connect(citus_db.dsn, autocommit=True) as conn:
        nodes = conn.execute(
            "SELECT nodeport, groupid FROM pg_dist_node WHERE isactive ORDER BY groupid"
        ).fetchall()
        assert nodes == [(port, group) for group, port in enumerate(ports)]
        conn.execute("CREATE TABLE spread (shard smallint NOT NULL, n int NOT NULL)")
        conn.execute("SELECT create_distributed_table('spread', 'shard', shard_count := 8)")
        per_node: dict[int, int] = dict(
            conn.execute("SELECT nodeport, count(*) FROM citus_shards GROUP BY 1").fetchall()
        )
    assert per_node == {citus_cluster.workers[0].port: 4, citus_cluster.workers[1].port: 4}


def test_the_servers_never_run_as_root(citus_cluster: CitusCluster) -> None:
    expected = pwd.getpwnam("embedded_postgres").pw_uid if os.geteuid() == 0 else os.geteuid()
    for node in citus_cluster.nodes:
        pid = node.pid()
        assert pid is not None, node.name
        status = Path(f"/proc/{pid}/status").read_text()
        uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
        assert uid == expected, (node.name, uid)
        assert uid != 0, node.name


def test_each_database_is_its_own_and_is_dropped_everywhere(citus_cluster: CitusCluster) -> None:
    first = citus_cluster.create_database()
    second = citus_cluster.create_database()
    try:
        with psycopg.connect(first.dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE only_here (shard smallint NOT NULL)")
            conn.execute("SELECT create_distributed_table('only_here', 'shard')")
        with psycopg.connect(second.dsn) as conn:
            assert conn.execute("SELECT to_regclass('only_here')").fetchone() == (None,)
            active = conn.execute("SELECT count(*) FROM citus_get_active_worker_nodes()")
            assert active.fetchone() == (2,)
    finally:
        citus_cluster.drop_database(first)
        citus_cluster.drop_database(second)
    for node in citus_cluster.nodes:
        with psycopg.connect(node.dsn()) as conn:
            left = conn.execute(
                "SELECT datname FROM pg_database WHERE datname IN (%s, %s)",
                [first.name, second.name],
            ).fetchall()
        assert left == [], node.name


def test_a_killed_worker_stops_only_its_shards_and_keeps_what_was_committed(
    citus_cluster: CitusCluster, citus_db: CitusDatabase
) -> None:
    worker, other = citus_cluster.workers
    with psycopg.connect(citus_db.dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE marks (shard smallint NOT NULL, n int NOT NULL)")
        conn.execute("SELECT create_distributed_table('marks', 'shard', shard_count := 8)")
        ports = {s: node_port_of(conn, "marks", s) for s in range(8)}
        mine = next(s for s, port in ports.items() if port == worker.port)
        theirs = next(s for s, port in ports.items() if port == other.port)
        conn.execute("INSERT INTO marks VALUES (%s, 1), (%s, 1)", [mine, theirs])
        in_flight = psycopg.connect(citus_db.dsn)
        in_flight.execute("INSERT INTO marks VALUES (%s, 2)", [mine])  # not committed

        worker.kill9()
        with pytest.raises(psycopg.OperationalError, match=str(worker.port)):
            conn.execute("SELECT count(*) FROM marks WHERE shard = %s", [mine])
        conn.execute("INSERT INTO marks VALUES (%s, 2)", [theirs])  # the other worker serves
        with pytest.raises(psycopg.Error):
            in_flight.commit()
        in_flight.close()

        worker.restart_after_kill()
        rows = conn.execute("SELECT shard, n FROM marks ORDER BY shard, n").fetchall()
    assert sorted(rows) == sorted([(mine, 1), (theirs, 1), (theirs, 2)])


def test_the_citus_files_are_found_from_the_environment_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CITUS_DIR_ENV, str(tmp_path))
    with pytest.raises(CitusUnavailable, match=f"{CITUS_DIR_ENV}=.*no install.sh"):
        find_citus_dir()
    (tmp_path / "install.sh").write_text("#!/bin/sh\n")
    assert find_citus_dir() == tmp_path


def test_without_the_variable_the_files_are_looked_for_beside_the_parents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(CITUS_DIR_ENV, raising=False)
    monkeypatch.setattr(citus_support, "DEV_MACHINE_DIR", tmp_path / "elsewhere")
    clone = tmp_path / "wt" / "branch"
    clone.mkdir(parents=True)
    with pytest.raises(CitusUnavailable, match=f"set {CITUS_DIR_ENV}.*elsewhere"):
        find_citus_dir(clone)
    shared = tmp_path / "shared" / "citus"
    shared.mkdir(parents=True)
    (shared / "install.sh").write_text("#!/bin/sh\n")
    assert find_citus_dir(clone) == shared
