"""The step write reads the gates on a worker through a view of the worker's own placement.

Read through Citus, the gates cost a worker about 150 us a step: Citus plans the
statement on every call. Each worker has a view of its own placement of the
reference table (``outbox_gates_placement``, placed by ``outbox migrate
--distribute`` and again after migrations); ``outbox_gates_of`` reads it when it
is there and the session may, and reads through Citus otherwise. Either way a
gate holds the effects it matches.
"""

from __future__ import annotations

from uuid import UUID

import psycopg
from sqlalchemy import create_engine

from outbox import EffectStatus, Outbox
from outbox.governance.gates import Gate
from outbox.shards import shard_of
from outbox.storage.citus import GATES_VIEW, distribute, drop_gates_views, place_gates_views
from outbox.storage.dsn import psycopg_url
from outbox.storage.migrate import migrate, shipped
from tests.citus_support import CitusCluster, CitusDatabase, node_port_of


def _placement(dsn: str) -> str:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT shard_name('outbox_gates'::regclass, shardid) FROM pg_dist_shard"
            " WHERE logicalrelid = 'outbox_gates'::regclass"
        ).fetchone()
    assert row is not None
    return str(row[0])


def _views(dsn: str) -> dict[str, str | None]:
    """Each node's view of the gates (its definition), by node; None where there is none."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT nodeport::text, success, result FROM run_command_on_all_nodes("
            f"$$SELECT pg_get_viewdef(to_regclass('{GATES_VIEW}'))$$)"
            " JOIN pg_dist_node USING (nodeid) ORDER BY nodeport"
        ).fetchall()
    assert all(ok for _, ok, _ in rows), rows
    return {port: result or None for port, _, result in rows}  # NULL comes back as ''


def _worker_of(cluster: CitusCluster, db: CitusDatabase, run_id: UUID) -> str:
    """The DSN of the worker holding ``run_id``'s shard, in ``db``."""
    with psycopg.connect(db.dsn) as conn:
        port = node_port_of(conn, "outbox_runs", shard_of(run_id))
    return next(w for w in cluster.workers if w.port == port).dsn(db.name)


def test_each_worker_has_a_view_of_its_own_placement_and_the_coordinator_none(
    dsn: str, citus_cluster: CitusCluster, citus_module_db: CitusDatabase
) -> None:
    placement = _placement(dsn)
    views = _views(dsn)
    # the coordinator reads through Citus
    assert views.pop(str(citus_cluster.coordinator.port)) is None
    assert len(views) == 2
    for port, definition in views.items():
        assert definition is not None and placement in definition, (port, definition)
    with psycopg.connect(citus_cluster.workers[0].dsn(citus_module_db.name)) as conn:
        grants = conn.execute(
            "SELECT count(*) FROM information_schema.role_table_grants"
            " WHERE table_name = %s AND grantee = 'PUBLIC'",
            [GATES_VIEW],
        ).fetchone()
    assert grants == (0,)


def test_a_step_reads_the_gates_through_the_view_and_a_gate_holds(
    ob: Outbox, dsn: str, citus_cluster: CitusCluster, citus_module_db: CitusDatabase
) -> None:
    """Shown by a view that hides every gate, on the run's worker: while it is there the
    gated intent is not held (the view was read, not the table); placed again, it is."""
    gate = Gate(name="view-held", kind="view.pay", when=[{"pointer": "/n", "op": "ge", "value": 5}])
    ob.apply_gates([gate])
    run = ob.start_run("view", "1")
    with psycopg.connect(_worker_of(citus_cluster, citus_module_db, run.id)) as conn:
        conn.execute("SET citus.enable_ddl_propagation = off")
        conn.execute(
            f"CREATE OR REPLACE VIEW {GATES_VIEW} AS SELECT name, kind, conditions,"
            f" timeout_seconds, on_timeout, escalate_to FROM {_placement(dsn)} WHERE false"
        )
    try:
        hidden = run.transaction("hidden", lambda tx: str(tx.intend("view.pay", {"n": 7}).id))
        assert ob.effect(hidden).status == EffectStatus.PENDING
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            place_gates_views(conn)
    held = run.transaction("held", lambda tx: str(tx.intend("view.pay", {"n": 8}).id))
    assert ob.effect(held).status == EffectStatus.AWAITING_APPROVAL
    ob.remove_gates([gate.name])


def test_without_the_views_the_gates_are_read_through_citus_and_still_hold(
    ob: Outbox, dsn: str
) -> None:
    gate = Gate(
        name="no-view", kind="view.refund", when=[{"pointer": "/n", "op": "ge", "value": 0}]
    )
    ob.apply_gates([gate])
    with psycopg.connect(dsn, autocommit=True) as conn:
        drop_gates_views(conn)
        assert set(_views(dsn).values()) == {None}
        try:
            run = ob.start_run("view", "1")
            run.transaction("refund", lambda tx: tx.intend("view.refund", {"n": 1}))
            (effect,) = ob.run(run.id).effects()
            assert effect.status == EffectStatus.AWAITING_APPROVAL
        finally:
            place_gates_views(conn)
    assert sum(v is not None for v in _views(dsn).values()) == 2
    ob.remove_gates([gate.name])


def test_migrations_on_a_distributed_database_take_the_views_off_and_place_them_again(
    citus_cluster: CitusCluster, citus_db: CitusDatabase
) -> None:
    """A migration may change a column of the gates, which the views name: they are
    dropped first and placed again after (an upgrade from before them gets them too)."""

    def view_ids() -> list[int | None]:
        ids = []
        for worker in citus_cluster.workers:
            with psycopg.connect(worker.dsn(citus_db.name)) as conn:
                row = conn.execute(f"SELECT to_regclass('{GATES_VIEW}')::oid").fetchone()
            ids.append(None if row is None else row[0])
        return ids

    engine = create_engine(psycopg_url(citus_db.dsn))
    try:
        migrate(engine, target=shipped()[-2].version)
        distribute(engine)
        before = view_ids()
        assert None not in before
        applied = migrate(engine)
        assert [m.version for m in applied] == [shipped()[-1].version]
        after = view_ids()
        assert None not in after
        assert not set(before) & set(after), "the views were not dropped and placed again"
    finally:
        engine.dispose()


def test_a_login_that_may_not_read_the_view_reads_the_gates_through_citus(
    ob: Outbox, citus_cluster: CitusCluster, citus_module_db: CitusDatabase
) -> None:
    """The view is its owner's alone (no grant to PUBLIC): a login with the table's
    SELECT but not the view's gets the same gates, read through Citus."""
    gate = Gate(name="reader", kind="view.read", when=[{"pointer": "/n", "op": "ge", "value": 0}])
    ob.apply_gates([gate])
    with psycopg.connect(citus_module_db.dsn, autocommit=True) as conn:
        conn.execute("DROP ROLE IF EXISTS gates_reader")
        conn.execute("CREATE ROLE gates_reader LOGIN")
        conn.execute("GRANT SELECT ON outbox_gates TO gates_reader")
    try:
        worker = citus_cluster.workers[0].dsn(citus_module_db.name)
        with psycopg.connect(worker) as conn:
            conn.execute("SET ROLE gates_reader")
            may = conn.execute(f"SELECT has_table_privilege('{GATES_VIEW}', 'SELECT')")
            assert may.fetchone() == (False,)
            row = conn.execute("SELECT outbox_gates_of(ARRAY['view.read'])").fetchone()
        assert row is not None and [g["name"] for g in row[0]] == ["reader"]
    finally:
        ob.remove_gates([gate.name])
        with psycopg.connect(citus_module_db.dsn, autocommit=True) as conn:
            conn.execute("REVOKE SELECT ON outbox_gates FROM gates_reader")
            conn.execute("DROP ROLE gates_reader")


def test_migrate_with_nothing_pending_places_a_missing_view(dsn: str) -> None:
    """As after adding a worker: a plain ``outbox migrate`` gives it its view."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        drop_gates_views(conn)
    engine = create_engine(psycopg_url(dsn))
    try:
        assert migrate(engine) == []
    finally:
        engine.dispose()
    assert sum(v is not None for v in _views(dsn).values()) == 2
