"""A step on a worker writes the worker's own placements by name, not through Citus.

Citus 14.0.1 deparses, parses and plans each statement on a distributed table
again on every call from PL/pgSQL (its kept plans leak, so the step plans per
call): about 150 us a statement on a worker. ``outbox_shard_placements`` names
the worker's own placement of a shard; the step's four statements (the run's lock
and update, the step's and its effects' inserts) go to it as statements prepared
once a session (``outbox_prepare_placements``), which PostgreSQL alone plans and
keeps. Where there is no such placement (the coordinator, a worker without the
shard) the step goes through the distributed tables, as before.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any
from uuid import UUID

import psycopg
import pytest
from click.testing import CliRunner
from psycopg.types.json import Jsonb

from outbox import Outbox, StepTransaction
from outbox.cli import cli as cli_main
from outbox.shards import shard_of
from tests.citus_support import CitusCluster, CitusDatabase, node_port_of

TABLES = ("outbox_runs", "outbox_steps", "outbox_effects")


def _nodes(cluster: CitusCluster, db: CitusDatabase, run_id: UUID) -> tuple[str, str, str]:
    """The DSNs of the coordinator, the worker holding run_id's shard, and the other worker."""
    with psycopg.connect(db.dsn) as conn:
        port = node_port_of(conn, "outbox_runs", shard_of(run_id))
    holder = next(w for w in cluster.workers if w.port == port)
    other = next(w for w in cluster.workers if w.port != port)
    return db.dsn, holder.dsn(db.name), other.dsn(db.name)


def _placement(dsn: str, table: str, shard: int) -> str | None:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT (outbox_shard_placements(%s::smallint, ARRAY[%s::regclass]))[1]::text",
            [shard, table],
        ).fetchone()
    assert row is not None
    return None if row[0] is None else str(row[0])


def test_only_the_worker_holding_a_shard_names_its_placement(
    ob: Outbox, citus_cluster: CitusCluster, citus_module_db: CitusDatabase
) -> None:
    run = ob.start_run("placements", "1")
    shard = shard_of(run.id)
    coordinator, holder, other = _nodes(citus_cluster, citus_module_db, run.id)
    with psycopg.connect(coordinator) as conn:
        names = {
            table: conn.execute(
                "SELECT shard_name(%s::regclass,"
                " get_shard_id_for_distribution_column(%s, %s::smallint))",
                [table, table, shard],
            ).fetchone()
            for table in TABLES
        }
    for table in TABLES:
        assert _placement(holder, table, shard) == names[table][0]  # type: ignore[index]
        assert _placement(other, table, shard) is None
        # the coordinator writes through Citus: a transaction there may have reached
        # the placement through other connections
        assert _placement(coordinator, table, shard) is None


def test_a_step_on_its_worker_leaves_citus_none_of_its_statements(
    ob: Outbox, citus_cluster: CitusCluster, citus_module_db: CitusDatabase
) -> None:
    """citus.log_local_commands reports each statement Citus runs on a local shard:
    a step with an intent, called on the worker holding its run, reports none of its
    tables (a read of the steps right after, through Citus, is reported)."""
    run = ob.start_run("placements", "1")
    _, holder, _ = _nodes(citus_cluster, citus_module_db, run.id)
    logged: list[str] = []
    with psycopg.connect(holder, autocommit=True) as conn:
        conn.add_notice_handler(lambda diag: logged.append(diag.message_primary or ""))
        conn.execute("SET citus.log_local_commands = on")
        conn.execute("SET client_min_messages = log")
        with conn.transaction():
            row = conn.execute(
                "SELECT step_seq, effect_ids FROM outbox_commit_step(%s, 'on-worker',"
                ' intents => \'[{"kind": "placement.send", "payload": {"n": 1}}]\')',
                [run.id],
            ).fetchone()
        step_logs = list(logged)
        conn.execute(
            "SELECT count(*) FROM outbox_steps WHERE run_id = %s AND shard = %s",
            [run.id, shard_of(run.id)],
        )
    assert row is not None and row[0] == 1 and len(row[1]) == 1
    assert not [m for m in step_logs if any(t in m for t in TABLES)], step_logs
    assert any("outbox_steps_" in m for m in logged[len(step_logs) :]), logged

    (effect,) = ob.run(run.id).effects()
    assert effect.id == row[1][0] and effect.kind == "placement.send"


def test_effects_written_by_name_keep_their_order_and_their_steps_chain(
    ob: Outbox, citus_module_db: CitusDatabase
) -> None:
    """A placement has no default for the effects' seq (Citus draws the identity on
    the worker): the step draws it from the same sequence. Steps of 2 intents (by
    name) around one of 40 (one ``INSERT ... SELECT`` through Citus) keep their
    order, and the run's chain verifies."""
    run = ob.start_run("placements", "1")
    sizes = [2, 40, 2]

    def intents(tx: StepTransaction, n: int) -> None:
        for i in range(sizes[n]):
            tx.intend("placement.order", {"n": n, "i": i})

    for n in range(len(sizes)):
        run.transaction(f"s{n}", functools.partial(intents, n=n))
    with psycopg.connect(citus_module_db.dsn) as conn:
        rows = conn.execute(
            "SELECT step_id, step_index, seq FROM outbox_effects"
            " WHERE run_id = %s AND shard = %s ORDER BY seq",
            [run.id, shard_of(run.id)],
        ).fetchall()
    assert [(s, i) for s, i, _ in rows] == [
        (f"s{n}", i) for n, size in enumerate(sizes) for i in range(size)
    ]
    assert ob.verify_run(run.id) == []


_PREPARED = "SELECT name FROM pg_prepared_statements WHERE name LIKE 'outbox.%%' ORDER BY name"


def _step_on(conn: psycopg.Connection[Any], run_id: UUID, step_id: str) -> None:
    conn.execute(
        "SELECT outbox_commit_step(%s, %s,"
        ' intents => \'[{"kind": "placement.send", "payload": {"n": 1}}]\')',
        [run_id, step_id],
    )


def test_a_worker_session_prepares_its_placements_statements_once_and_again_when_dropped(
    ob: Outbox, citus_cluster: CitusCluster, citus_module_db: CitusDatabase
) -> None:
    """The four statements of a step on a placement are prepared in the worker's
    session at its first step and kept; a DEALLOCATE ALL (psycopg sends one after a
    rollback) or a DISCARD ALL drops them, and the next step prepares them again
    instead of failing on a name that points at nothing."""
    run = ob.start_run("placements", "1")
    shard = shard_of(run.id)
    _, holder, _ = _nodes(citus_cluster, citus_module_db, run.id)
    names = {
        f"outbox.{what}:{_placement(holder, table, shard)}"
        for what, table in [
            ("lock", "outbox_runs"),
            ("move", "outbox_runs"),
            ("step", "outbox_steps"),
            ("effect", "outbox_effects"),
        ]
    }
    with psycopg.connect(holder, autocommit=True) as conn:
        for n, reset in enumerate([None, None, "DEALLOCATE ALL", "ROLLBACK", "DISCARD ALL"]):
            if reset == "ROLLBACK":  # prepared by a step whose transaction rolled back
                conn.execute("DEALLOCATE ALL")
                with pytest.raises(psycopg.errors.RaiseException), conn.transaction():
                    _step_on(conn, run.id, f"rolled-back-{n}")
                    conn.execute("DO $$BEGIN RAISE EXCEPTION 'undone'; END$$")
            elif reset is not None:
                conn.execute(reset)
                assert conn.execute(_PREPARED).fetchall() == []
            _step_on(conn, run.id, f"s{n}")
            assert {name for (name,) in conn.execute(_PREPARED)} == names
    with psycopg.connect(citus_module_db.dsn) as conn:
        steps = conn.execute(
            "SELECT step_id FROM outbox_steps WHERE run_id = %s AND shard = %s ORDER BY seq",
            [run.id, shard],
        ).fetchall()
    assert [s for (s,) in steps] == [f"s{n}" for n in range(5)]
    assert len(ob.run(run.id).effects()) == 5
    assert ob.verify_run(run.id) == []


def test_a_statement_prepared_under_a_steps_name_by_the_session_is_replaced_not_run(
    ob: Outbox, citus_cluster: CitusCluster, citus_module_db: CitusDatabase
) -> None:
    """The step runs as the tables' owner. A session on a worker that prepared its
    own statement under one of the step's names (here one that answers the step's
    insert with a sequence number and writes nothing) does not get it run: the step
    replaces it with its own, and the step is recorded."""
    run = ob.start_run("placements", "1")
    shard = shard_of(run.id)
    _, holder, _ = _nodes(citus_cluster, citus_module_db, run.id)
    name = f"outbox.step:{_placement(holder, 'outbox_steps', shard)}"
    with psycopg.connect(holder, autocommit=True) as conn:
        _step_on(conn, run.id, "first")
        conn.execute(f'DEALLOCATE "{name}"')
        conn.execute(f'PREPARE "{name}"({", ".join(["text"] * 9)}) AS SELECT 2::bigint')
        _step_on(conn, run.id, "forged")
        row = conn.execute(
            "SELECT statement FROM pg_prepared_statements WHERE name = %s", [name]
        ).fetchone()
    assert row is not None and "INSERT INTO" in row[0]
    with psycopg.connect(citus_module_db.dsn) as conn:
        steps = conn.execute(
            "SELECT step_id FROM outbox_steps WHERE run_id = %s AND shard = %s ORDER BY seq",
            [run.id, shard],
        ).fetchall()
    assert [s for (s,) in steps] == ["first", "forged"]
    assert ob.verify_run(run.id) == []


def test_a_worker_session_keeps_writing_steps_after_a_migration_adds_a_column(
    ob: Outbox, citus_cluster: CitusCluster, citus_module_db: CitusDatabase
) -> None:
    """The coordinator keeps its sessions on a worker open for long, across an
    ``outbox migrate``. A prepared statement must keep its result's columns: a
    run's lock that returned ``r.*`` failed every step of such a session after a
    column was added to the runs ("cached plan must not change result type").
    And a step on a run that is not there is refused, as through Citus."""
    run = ob.start_run("placements", "1")
    shard = shard_of(run.id)
    _, holder, _ = _nodes(citus_cluster, citus_module_db, run.id)
    with psycopg.connect(holder, autocommit=True) as conn:
        _step_on(conn, run.id, "before")
        with psycopg.connect(citus_module_db.dsn, autocommit=True) as coordinator:
            for table in TABLES:
                coordinator.execute(f"ALTER TABLE {table} ADD COLUMN placement_extra integer")
        try:
            _step_on(conn, run.id, "after")
        finally:
            with psycopg.connect(citus_module_db.dsn, autocommit=True) as coordinator:
                for table in TABLES:
                    coordinator.execute(f"ALTER TABLE {table} DROP COLUMN placement_extra")
        _step_on(conn, run.id, "after-drop")
        missing = conn.execute(
            "SELECT outbox_on_shard(gen_random_uuid(), %s::smallint)", [shard]
        ).fetchone()
        assert missing is not None
        with pytest.raises(psycopg.Error, match="run"):
            _step_on(conn, missing[0], "nowhere")
    with psycopg.connect(citus_module_db.dsn) as conn:
        steps = conn.execute(
            "SELECT step_id FROM outbox_steps WHERE run_id = %s AND shard = %s ORDER BY seq",
            [run.id, shard],
        ).fetchall()
    assert [s for (s,) in steps] == ["before", "after", "after-drop"]
    assert ob.verify_run(run.id) == []


def test_one_worker_session_writes_the_steps_of_runs_on_several_of_its_shards(
    ob: Outbox, citus_cluster: CitusCluster, citus_module_db: CitusDatabase
) -> None:
    """The coordinator's session on a worker writes the steps of every run whose
    shard the worker holds, several in one transaction when the caller's is one.
    Each shard's placement has a row type of its own; the step reads the run's row
    as the table's type, whichever placement it came from (read as the placement's,
    the second shard's in a transaction was refused: "type of parameter ... does
    not match that when preparing the plan")."""
    first = ob.start_run("placements", "1")
    _, holder, _ = _nodes(citus_cluster, citus_module_db, first.id)
    runs = [first]
    while len(runs) < 2:
        run = ob.start_run("placements", "1")
        if (
            shard_of(run.id) != shard_of(first.id)
            and _nodes(citus_cluster, citus_module_db, run.id)[1] == holder
        ):
            runs.append(run)
    with psycopg.connect(holder, autocommit=True) as conn:
        for n in range(0, 4, 2):  # both runs' steps in one transaction, twice
            with conn.transaction():
                _step_on(conn, runs[0].id, f"s{n}")
                _step_on(conn, runs[1].id, f"s{n + 1}")
    with psycopg.connect(citus_module_db.dsn) as conn:
        for i, run in enumerate(runs):
            steps = conn.execute(
                "SELECT step_id FROM outbox_steps WHERE run_id = %s AND shard = %s ORDER BY seq",
                [run.id, shard_of(run.id)],
            ).fetchall()
            assert [s for (s,) in steps] == [f"s{n}" for n in range(4) if n % 2 == i]
            assert ob.verify_run(run.id) == []


def test_values_written_through_the_prepared_statements_read_back_unchanged(
    ob: Outbox, citus_cluster: CitusCluster, citus_module_db: CitusDatabase
) -> None:
    """The prepared statements take their values as literals: quotes, backslashes,
    non-ASCII text, numbers past a double's precision, an effect's delay and
    ordering key come back exactly as written from the worker holding the run, and
    the run's chain (the effects' derived keys in it) verifies."""
    run = ob.start_run("placements", "1")
    _, holder, _ = _nodes(citus_cluster, citus_module_db, run.id)
    tricky = {
        "quote": 'it\'s "quoted" \\ back\\slash $$ dollar $1',
        "unicode": "Zoë — 日本語 ✓",
        "big": 12345678901234567890123456789,
        "exact": 0.1000000000000000055511151231257827,
        "nested": [{"a": None, "b": [True, False]}],
    }
    intents = [
        {
            "kind": "placement.tricky",
            "payload": tricky,
            "ordering_key": "o\\k",
            "delay_seconds": 3600,
            "priority": 7,
        }
    ]
    with psycopg.connect(holder, autocommit=True) as conn:
        row = conn.execute(
            "SELECT effect_ids FROM outbox_commit_step(%s, %s, result => %s::jsonb,"
            " state => %s::jsonb, plan => %s::jsonb, intents => %s::jsonb)",
            [run.id, "tricky's step", Jsonb(tricky), Jsonb(tricky), Jsonb([tricky]),
             Jsonb(intents)],
        ).fetchone()  # fmt: skip
    assert row is not None
    with psycopg.connect(citus_module_db.dsn) as conn:
        step = conn.execute(
            "SELECT result, state, plan FROM outbox_steps WHERE run_id = %s AND shard = %s",
            [run.id, shard_of(run.id)],
        ).fetchone()
        effect = conn.execute(
            "SELECT payload, ordering_key, priority,"
            " available_at - created_at > interval '59 minutes'"
            " FROM outbox_effects WHERE id = %s AND shard = %s",
            [row[0][0], shard_of(run.id)],
        ).fetchone()
    assert step == (tricky, tricky, [tricky])
    assert effect is not None
    assert effect == (tricky, "o\\k", 7, True)
    assert ob.verify_run(run.id) == []


def _one(tx: StepTransaction, n: int) -> None:
    tx.intend("moved.send", {"n": n})


def test_a_shard_moved_under_a_writer_loses_no_step_and_its_old_copy_is_not_written(
    citus_cluster: CitusCluster, citus_db: CitusDatabase
) -> None:
    """A move blocks the writes of the shards' group (Citus's metadata lock, which the
    step holds too) and switches placements: steps written meanwhile all land, in
    order, on the new worker. The old copy stays on its worker until Citus cleans it
    up; a step called there afterwards finds it is no longer the placement and goes
    through Citus, to the new one."""
    result = CliRunner().invoke(
        cli_main, ["migrate", "--distribute", "--json"], env={"OUTBOX_DSN": citus_db.dsn}
    )
    assert result.exit_code == 0, result.output
    ob = Outbox.connect(citus_db.dsn)
    try:
        run = ob.start_run("moved", "1")
        shard = shard_of(run.id)
        _, source, target = _nodes(citus_cluster, citus_db, run.id)
        source_port = next(w.port for w in citus_cluster.workers if w.dsn(citus_db.name) == source)
        target_port = next(w.port for w in citus_cluster.workers if w.dsn(citus_db.name) == target)
        written: list[int] = []
        failed: list[BaseException] = []
        stop = threading.Event()

        def write() -> None:
            n = 0
            while not stop.is_set():
                try:
                    run.transaction(f"s{n}", functools.partial(_one, n=n))
                except BaseException as exc:
                    failed.append(exc)
                    return
                written.append(n)
                n += 1

        writer = threading.Thread(target=write)
        writer.start()
        try:
            time.sleep(0.5)
            with psycopg.connect(citus_db.dsn, autocommit=True) as conn:
                conn.execute(
                    "SELECT citus_move_shard_placement("
                    " get_shard_id_for_distribution_column('outbox_runs', %s::smallint),"
                    " '127.0.0.1', %s, '127.0.0.1', %s, shard_transfer_mode => 'block_writes')",
                    [shard, source_port, target_port],
                )
            before = len(written)
            time.sleep(0.5)
        finally:
            stop.set()
            writer.join(30)
        assert not failed, failed
        assert len(written) > before > 0
        with psycopg.connect(citus_db.dsn) as conn:
            assert node_port_of(conn, "outbox_runs", shard) == target_port
            steps = conn.execute(
                "SELECT step_id FROM outbox_steps WHERE run_id = %s AND shard = %s ORDER BY seq",
                [run.id, shard],
            ).fetchall()
        assert [s for (s,) in steps] == [f"s{n}" for n in written]
        assert len(ob.run(run.id).effects()) == len(written)
        assert ob.verify_run(run.id) == []

        # the old copy is still on the source worker (dropped later), but not the placement
        with psycopg.connect(source) as conn:
            old = conn.execute(
                "SELECT to_regclass(shard_name('outbox_runs'::regclass,"
                " get_shard_id_for_distribution_column('outbox_runs', %s::smallint)))",
                [shard],
            ).fetchone()
            placed = conn.execute(
                "SELECT outbox_shard_placements(%s::smallint, ARRAY['outbox_runs'::regclass])",
                [shard],
            ).fetchone()
            conn.execute(
                "SELECT outbox_commit_step(%s, 'after-move',"
                ' intents => \'[{"kind": "moved.send", "payload": {}}]\')',
                [run.id],
            )
            conn.commit()
        assert old is not None and old[0] is not None, "Citus dropped the old copy at once"
        assert placed == (None,)
        with psycopg.connect(citus_db.dsn) as conn:
            last = conn.execute(
                "SELECT step_id FROM outbox_steps WHERE run_id = %s AND shard = %s"
                " ORDER BY seq DESC LIMIT 1",
                [run.id, shard],
            ).fetchone()
        assert last == ("after-move",)
    finally:
        ob.close()


def test_a_step_the_coordinator_writes_goes_through_the_tables_by_the_same_statements(
    ob: Outbox, citus_module_db: CitusDatabase
) -> None:
    """Where the step runs on the coordinator (Citus did not delegate it), it holds no
    placement: the run's lock and update and the step's insert go through the
    distributed tables, by the texts the workers prepare (outbox_placement_statement),
    and nothing is prepared there. The step joins the chain; the same step again and
    a missing run are refused as on a worker."""
    run = ob.start_run("placements", "1")
    apart = (
        "SELECT step_seq, effect_ids FROM outbox_write_step_apart(%s::smallint, %s, %s,"
        " NULL, '{\"at\": 1}', NULL, %s, 'transaction', NULL, NULL, NULL, NULL, 0, '[]', '[]')"
    )
    intents = Jsonb([{"kind": "placement.send", "payload": {"n": 1}}])
    with psycopg.connect(citus_module_db.dsn) as conn:
        row = conn.execute(apart, [shard_of(run.id), run.id, "by-coordinator", intents]).fetchone()
        assert conn.execute(_PREPARED).fetchall() == []
    assert row is not None and row[0] == 1 and len(row[1]) == 1
    assert ob.run(run.id).record.state == {"at": 1}
    (effect,) = ob.run(run.id).effects()
    assert effect.id == row[1][0]
    assert ob.verify_run(run.id) == []
    missing = UUID(int=run.id.int ^ (1 << 64))
    assert shard_of(missing) == shard_of(run.id)
    for run_id, refused in [(run.id, "already recorded"), (missing, "no such run")]:
        with psycopg.connect(citus_module_db.dsn) as conn, pytest.raises(psycopg.Error) as error:
            conn.execute(apart, [shard_of(run_id), run_id, "by-coordinator", intents])
        assert refused in str(error.value)
