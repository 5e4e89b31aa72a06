"""The client's connections keep their prepared statements from call to call.

psycopg forgets every statement it prepared on a connection at a ROLLBACK (an
object it names may have been dropped and made again): a read that ended with
one made every statement of that connection be planned afresh on every call.
Reads commit instead (``engine.begin()``).
"""

from __future__ import annotations

from sqlalchemy import text

from outbox import Outbox


def test_reads_leave_the_connections_prepared_statements_in_place(dsn: str) -> None:
    with Outbox.connect(dsn, pool_size=1) as ob:  # one connection: every call shares it
        run = ob.start_run("plans", "1")
        for n in range(12):
            run.transaction(f"s{n}", lambda tx: None)
            assert ob.run(run.id).completed_steps[-1] == f"s{n}"
            ob.effects(run_id=run.id)
        with ob.engine.connect() as conn:
            prepared = conn.execute(
                text("SELECT statement, generic_plans FROM pg_prepared_statements")
            ).all()
    # the run's read (``ob.run``), prepared after a few calls and planned once since
    run_reads = [plans for statement, plans in prepared if "FROM outbox_runs" in statement]
    assert run_reads and max(run_reads) > 0, prepared
