"""`outbox roles --namespace` on a cluster: the same confinement, on every node.

The same tests as on one server (tests/integration/test_roles_namespaces.py),
against a coordinator and two workers: the role settings that confine a login
and the tables' policies reach every node, and the step writers, delegated to
the node holding a run's shard, refuse another namespace's run there.
"""

from __future__ import annotations

import uuid

import psycopg

from outbox import Outbox
from outbox.shards import SHARDS, on_shard
from outbox.storage.dsn import libpq_dsn
from tests.integration.test_roles_namespaces import (  # noqa: F401 (a fixture, the tests)
    confined_error,
    teams,
    test_a_confined_agent_drives_its_own_runs_and_reaches_no_other_namespaces,
    test_a_confined_login_cannot_write_into_another_namespaces_run,
    test_a_confined_login_reads_only_the_large_values_its_namespace_uses,
    test_a_confined_login_still_inserts_and_reopens_its_own_namespaces_effects,
    test_a_confined_operators_gc_leaves_the_large_values_every_namespace_shares,
    test_a_login_that_may_create_objects_cannot_stand_in_for_what_the_policies_run,
    test_a_mark_read_off_a_shared_value_shows_a_confined_login_nothing_more,
    test_confined_operators_and_readers_see_and_change_only_their_namespace,
    test_no_login_stores_a_text_under_another_values_sha256_or_unhides_one,
    test_the_policies_checks_tell_a_confined_login_nothing_of_another_namespace,
)


def test_a_confined_agent_is_refused_another_namespaces_run_on_every_shard(
    ob: Outbox,
    teams: dict[str, dict[str, str]],  # noqa: F811
) -> None:
    support, billing = teams["support"], teams["billing"]
    with Outbox.connect(support["agent"], namespace=support["namespace"]) as theirs_ob:
        runs = [
            theirs_ob.start_run("triage", "1", run_id=on_shard(uuid.uuid4(), shard))
            for shard in range(SHARDS)
        ]
    for run in runs:
        message = confined_error(
            billing["agent"], "SELECT * FROM outbox_commit_step(%(run)s, 'forged')", {"run": run.id}
        )
        assert "confined to namespace" in message, message
    with psycopg.connect(libpq_dsn(billing["reader"])) as conn:
        assert conn.execute("SELECT count(*) FROM outbox_steps").fetchone() == (0,)
        assert conn.execute("SELECT count(*) FROM outbox_runs").fetchone() == (0,)
    with psycopg.connect(libpq_dsn(support["reader"])) as conn:
        assert conn.execute("SELECT count(*) FROM outbox_runs").fetchone() == (SHARDS,)
