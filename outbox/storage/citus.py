"""The schema on a Citus cluster: ``outbox migrate --distribute``.

Every run-scoped table is distributed by its ``shard`` column (``outbox.shards``)
and co-located with ``outbox_runs``, so a run's rows, and its key's, live on one
node; the gates and the rate limits, read by every write or claim, are
reference tables (a copy on every node); the migrations, the deliverers' owner
registry, the webhook replay guard and the Kafka consumers' keys stay on the
coordinator. The step write (``outbox_write_step``) is delegated: the
coordinator sends the call to the node holding the run's shard, in one round
trip. Every other function is propagated to every node.

Refused, before anything changes: a node that acknowledges commits before they
are on disk (``synchronous_commit`` off or local), which loses committed
intents and reuses fencing tokens when the node is killed
(``docs/discussions/citus-notes.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from sqlalchemy import Engine

from outbox.errors import ConfigurationError, MigrationError
from outbox.shards import SHARDS
from outbox.storage.encoding import refuse_server_encoding

__all__ = [
    "COLOCATED",
    "DATABASE_RESETS",
    "DATABASE_SETTINGS",
    "DELEGATED",
    "REFERENCE",
    "Distribution",
    "apply_database_settings",
    "distribute",
    "drop_gates_views",
    "is_citus",
    "is_distributed",
    "place_gates_views",
    "propagate_functions",
]

#: Distributed by ``shard``, co-located with the first.
COLOCATED = (
    "outbox_runs",
    "outbox_steps",
    "outbox_effects",
    "outbox_effect_attempts",
    "outbox_signals",
    "outbox_budget_ledger",
    "outbox_blobs",
    "outbox_blob_refs",
    "outbox_run_keys",
    "outbox_effect_keys",
)
#: A copy on every node: read by the statements that write and claim.
REFERENCE = ("outbox_gates", "outbox_rate_limits")
#: Functions whose call goes to the node holding the shard named by an argument.
#: (The step writers: each writes one shard's rows as the tables' owner, so run on
#: the node holding it, in the caller's session there; see chain_writes.sql.)
DELEGATED = {
    "outbox_write_step": "$1",
    "outbox_complete_wait": "$1",
    "outbox_take_signal": "$1",
    "outbox_chain_fork": "$1",
}
#: Set for the database on every node, so every session of every client has them.
DATABASE_SETTINGS = (
    # the write functions read it on every node (outbox_distributed)
    "outbox.distributed = 'on'",
    "citus.enable_unsafe_triggers = 'on'",
    # A statement over many shards (the daemons' duty probe and gauges, the
    # console's counts) would open up to 16 new connections to each worker, one
    # session (a process, its caches loaded afresh) each, closed after the
    # transaction: a drain of 4,000 effects opened 48-58 sessions on the workers
    # instead of 14, and drained 10-20 % slower. Everything on the hot paths names
    # one shard; the reads over many run their shards' statements one by one, on
    # the session the coordinator keeps open to each worker.
    "citus.max_adaptive_executor_pool_size = 1",
)
#: Reset for the database on every node (an earlier ``--distribute`` set it).
#: ``force_custom_plan`` guarded against generic plans, which Citus cannot route;
#: but PostgreSQL's own choice (``auto``) never takes a generic plan Citus cannot
#: route (tested: claims prepared and run 1,280 times, steps on one session),
#: and forcing custom plans re-planned every statement and expression inside
#: PL/pgSQL: an attempt-log row's trigger took 0.8 ms instead of 0.45.
DATABASE_RESETS = ("plan_cache_mode",)
#: On each worker, a view of the node's own placement of ``outbox_gates``: the step
#: write reads the gates through it (``outbox_gates_of``) without Citus planning
#: the statement, 150 us of a worker's 1,900 a step. Not propagated: a view over
#: a shard means nothing on another node. It names the placement's columns, so a
#: migration that changes one of them finds it in the way: :func:`migrate
#: <outbox.storage.migrate.migrate>` drops the views first, and places them after
#: every run (a worker added since gets its own).
GATES_VIEW = "outbox_gates_placement"
_ON_WORKERS = "SELECT nodename, nodeport, success, result FROM run_command_on_workers(%s)"
_PLACE_GATES_VIEW = f"""DO $place$
DECLARE
    placement regclass := to_regclass((SELECT shard_name('outbox_gates'::regclass, s.shardid)
                                         FROM pg_dist_shard AS s
                                        WHERE s.logicalrelid = 'outbox_gates'::regclass));
    view text := format('%I.{GATES_VIEW}', (SELECT c.relnamespace::regnamespace::text
                                              FROM pg_class AS c
                                             WHERE c.oid = 'outbox_gates'::regclass));
BEGIN
    PERFORM set_config('citus.enable_ddl_propagation', 'off', true);
    IF placement IS NOT NULL THEN
        EXECUTE format('CREATE OR REPLACE VIEW %s AS SELECT name, kind, conditions,'
                       ' timeout_seconds, on_timeout, escalate_to FROM %s', view, placement);
        EXECUTE format('REVOKE ALL ON %s FROM PUBLIC', view);
    END IF;
END
$place$"""
_DROP_GATES_VIEW = f"""DO $drop$
BEGIN
    PERFORM set_config('citus.enable_ddl_propagation', 'off', true);
    DROP VIEW IF EXISTS {GATES_VIEW};
END
$drop$"""


@dataclass
class Distribution:
    """What :func:`distribute` did (each list empty when it was done before)."""

    distributed: list[str] = field(default_factory=list)
    reference: list[str] = field(default_factory=list)
    delegated: list[str] = field(default_factory=list)
    propagated: int = 0
    nodes: int = 0


def is_citus(conn: psycopg.Connection[Any]) -> bool:
    """Whether the database has the Citus extension."""
    return conn.execute("SELECT 1 FROM pg_extension WHERE extname = 'citus'").fetchone() is not None


def is_distributed(conn: psycopg.Connection[Any]) -> bool:
    """Whether ``outbox migrate --distribute`` distributed this database (read from Citus)."""
    return is_citus(conn) and "outbox_gates" in _distributed(conn)


def _on_every_node(conn: psycopg.Connection[Any], setting: str) -> list[tuple[str, int, bool, str]]:
    """Each node's host, port, whether it answered, and ``setting`` (or its error)."""
    rows = conn.execute(
        "SELECT n.nodename, n.nodeport, r.success, r.result"
        " FROM run_command_on_all_nodes(format('SHOW %%s', %s::text)) AS r"
        " JOIN pg_dist_node AS n USING (nodeid)",
        [setting],
    ).fetchall()
    return [(host, port, ok, result) for host, port, ok, result in rows]


def _check_nodes(conn: psycopg.Connection[Any]) -> int:
    nodes = _on_every_node(conn, "synchronous_commit")
    safe = ("on", "remote_apply", "remote_write")
    unsafe = [f"{h}:{p} ({r})" for h, p, ok, r in nodes if not ok or r not in safe]
    if unsafe:
        raise ConfigurationError(
            "synchronous_commit must be on for every node of the cluster (a node killed "
            "after acknowledging a commit it had not written would lose intents and "
            f"reuse fencing tokens): {', '.join(unsafe)}"
        )
    # The hashing functions run on the workers too (triggers, the delegated step
    # writer): each node's database must hold text as UTF-8 (migrate refuses others).
    for host, port, ok, encoding in _on_every_node(conn, "server_encoding"):
        try:
            refuse_server_encoding(encoding if ok else f"unknown ({encoding})")
        except ConfigurationError as exc:
            raise ConfigurationError(f"node {host}:{port}: {exc}") from None
    return len(nodes)


def _distributed(conn: psycopg.Connection[Any]) -> dict[str, str]:
    rows = conn.execute(
        "SELECT logicalrelid::regclass::text, partmethod FROM pg_dist_partition"
    ).fetchall()
    return {name: method for name, method in rows}


def _triggers(conn: psycopg.Connection[Any], tables: Sequence[str]) -> list[tuple[str, str, str]]:
    rows = conn.execute(
        "SELECT t.tgname, t.tgrelid::regclass::text, pg_get_triggerdef(t.oid)"
        " FROM pg_trigger t WHERE NOT t.tgisinternal AND t.tgrelid::regclass::text = ANY(%s)",
        [list(tables)],
    ).fetchall()
    return [(name, table, ddl) for name, table, ddl in rows]


def distribute(engine: Engine) -> Distribution:
    """Distribute a migrated schema over the cluster (idempotent).

    Run on the coordinator, after ``outbox migrate``; ``outbox migrate
    --distribute`` does both. Tables already distributed are left as they are.
    """
    raw = engine.raw_connection()
    try:
        conn: psycopg.Connection[Any] = raw.driver_connection  # type: ignore[assignment]
        conn.autocommit = True
        if not is_citus(conn):
            raise ConfigurationError(
                "--distribute needs a Citus coordinator (CREATE EXTENSION citus, workers added)"
            )
        done = Distribution(nodes=_check_nodes(conn))
        present = _distributed(conn)
        # Citus distributes no table that has triggers: they come off, then back on.
        pending = [t for t in COLOCATED if t not in present]
        triggers = _triggers(conn, pending)
        conn.execute("SET citus.enable_unsafe_triggers = on")
        try:
            with conn.transaction():
                for name, table, _ in triggers:
                    conn.execute(f"DROP TRIGGER {name} ON {table}")
                if "outbox_budget_ledger" in pending:
                    # a unique index names the distribution column on Citus (on one
                    # server the run id alone decides the shard)
                    conn.execute("DROP INDEX outbox_budget_spend_key")
                    conn.execute(
                        "CREATE UNIQUE INDEX outbox_budget_spend_key ON outbox_budget_ledger"
                        " (run_id, step_id, reason, shard) WHERE entry = 'spend'"
                    )
                for table in pending:
                    if table == COLOCATED[0]:
                        conn.execute(
                            "SELECT create_distributed_table(%s, 'shard', shard_count => %s)",
                            [table, SHARDS],
                        )
                    else:
                        conn.execute(
                            "SELECT create_distributed_table(%s, 'shard', colocate_with => %s)",
                            [table, COLOCATED[0]],
                        )
                    done.distributed.append(table)
                for table in REFERENCE:
                    if table not in present:
                        conn.execute("SELECT create_reference_table(%s)", [table])
                        done.reference.append(table)
                for _, _, ddl in triggers:
                    conn.execute(ddl)
        except psycopg.Error as exc:
            raise MigrationError(f"distributing the schema failed: {exc}") from exc
        done.propagated, done.delegated = propagate_functions(conn)
        place_gates_views(conn)
        apply_database_settings(conn)
        return done
    finally:
        raw.close()


def apply_database_settings(conn: psycopg.Connection[Any]) -> None:
    """Set ``DATABASE_SETTINGS`` and reset ``DATABASE_RESETS`` for the database on every node.

    Idempotent: ``outbox migrate`` runs it on a distributed database every time,
    so an upgrade brings a new setting with it. New sessions get them.
    """
    database = conn.info.dbname
    for command in (
        *(f"SET {setting}" for setting in DATABASE_SETTINGS),
        *(f"RESET {name}" for name in DATABASE_RESETS),
    ):
        conn.execute(
            "SELECT run_command_on_all_nodes(%s)", [f'ALTER DATABASE "{database}" {command}']
        )


def propagate_functions(conn: psycopg.Connection[Any]) -> tuple[int, list[str]]:
    """Propagate every function to every node; delegate the write functions (``DELEGATED``).

    Idempotent: ``outbox migrate`` runs it again after migrations on a distributed
    database, so a function a migration adds or re-creates with new arguments is
    delegated too. Returns how many were propagated and the delegated signatures.
    """
    rows = conn.execute(
        "SELECT p.oid::regprocedure::text, p.proname,"
        "       EXISTS (SELECT 1 FROM pg_dist_object d"
        "                WHERE d.classid = 'pg_proc'::regclass AND d.objid = p.oid),"
        "       p.proargtypes[0] = 'smallint'::regtype"
        "  FROM pg_proc p WHERE p.pronamespace = 'public'::regnamespace"
        "   AND p.proname LIKE 'outbox\\_%%'"
    ).fetchall()
    propagated, delegated = 0, []
    for signature, name, known, by_shard in rows:
        # (a schema from before 0036 has chain writers that do not take the shard first:
        # each is delegated once `outbox migrate` brings the one that does)
        if name in DELEGATED and by_shard:
            conn.execute(
                "SELECT create_distributed_function(%s, %s, colocate_with => %s,"
                " force_delegation => true)",
                [signature, DELEGATED[name], COLOCATED[0]],
            )
            delegated.append(signature)
        elif not known:
            conn.execute("SELECT create_distributed_function(%s)", [signature])
            propagated += 1
    return propagated, delegated


def place_gates_views(conn: psycopg.Connection[Any]) -> None:
    """Give every worker its view of its own placement of the gates (``GATES_VIEW``).

    Idempotent. A worker without one (added since, or a placement not there yet)
    reads the gates through Citus: the same rows, planned per call.
    """
    _on_workers(conn, _PLACE_GATES_VIEW, "placing the gates' views on the workers")


def drop_gates_views(conn: psycopg.Connection[Any]) -> None:
    """Drop the workers' views of the gates (before migrations that may change the table)."""
    _on_workers(conn, _DROP_GATES_VIEW, "dropping the gates' views on the workers")


def _on_workers(conn: psycopg.Connection[Any], command: str, what: str) -> None:
    failed = [
        f"{host}:{port} ({result})"
        for host, port, ok, result in conn.execute(_ON_WORKERS, [command]).fetchall()
        if not ok
    ]
    if failed:
        raise MigrationError(
            f"{what} failed: {', '.join(failed)}; a worker without its view reads the"
            " gates through Citus: run `outbox migrate` again when every worker answers"
        )
