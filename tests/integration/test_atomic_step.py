"""G1: a step's checkpoint, its intents and the caller's own rows commit together or not at all."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from psycopg import pq
from sqlalchemy import Column, Integer, MetaData, Table, Text, func, select

from outbox import Outbox, StepTransaction

caller_metadata = MetaData()
invoices = Table(
    "invoices_matched",
    caller_metadata,
    Column("id", Integer, primary_key=True),
    Column("invoice", Text, nullable=False),
)


class Boom(Exception):
    pass


@pytest.fixture
def caller_table(ob: Outbox) -> Table:
    caller_metadata.create_all(ob.engine)
    return invoices


def _count(ob: Outbox, table: Table) -> int:
    with ob.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(table)).scalar_one())


def test_everything_of_a_step_commits_together(ob: Outbox, caller_table: Table) -> None:
    run = ob.start_run("invoice-reconciler", "2.3.1", {"month": "2026-10"})

    def match(tx: StepTransaction) -> dict[str, str]:
        tx.connection.execute(caller_table.insert().values(invoice="INV-1"))
        tx.set_state({"cursor": 7, "matched": 41})
        tx.set_plan(["match", "send-summary", "close-month"])
        email = tx.intend("email.send", {"to": "ap@example.com", "subject": "October"})
        return {"email_key": email.idempotency_key}

    result = run.transaction("send-summary", match)

    resumed = Outbox.connect(str(ob.engine.url.render_as_string(hide_password=False)))
    try:
        again = resumed.run(run.id)
        assert again.state == {"cursor": 7, "matched": 41}
        assert again.plan == ["match", "send-summary", "close-month"]
        assert again.current_step == "send-summary"
        assert again.completed_steps == ["send-summary"]
        effects = again.effects()
        assert [e.idempotency_key for e in effects] == [result["email_key"]]
        assert effects[0].payload == {"to": "ap@example.com", "subject": "October"}
        assert _count(ob, caller_table) == 1
    finally:
        resumed.close()


def test_a_step_that_raises_writes_nothing(ob: Outbox, caller_table: Table) -> None:
    run = ob.start_run("invoice-reconciler", "2.3.1", {"month": "2026-10"})
    run.transaction("first", lambda tx: tx.set_state({"cursor": 1}))

    def fails_after_writing(tx: StepTransaction) -> None:
        tx.connection.execute(caller_table.insert().values(invoice="INV-2"))
        tx.set_state({"cursor": 99})
        tx.set_plan(["never"])
        tx.intend("email.send", {"to": "ap@example.com"})
        tx.intend("http.request", {"url": "https://example.com"}, key="caller-key-1")
        raise Boom("model call timed out")

    with pytest.raises(Boom):
        run.transaction("second", fails_after_writing)

    fresh = ob.run(run.id)
    assert fresh.completed_steps == ["first"]
    assert fresh.state == {"cursor": 1}, "the earlier checkpoint is intact"
    assert fresh.plan == []
    assert fresh.current_step == "first"
    assert fresh.effects() == []
    assert _count(ob, caller_table) == 0


def test_the_step_can_be_retried_after_it_raised(ob: Outbox) -> None:
    run = ob.start_run("invoice-reconciler", "2.3.1")
    calls = []

    def flaky(tx: StepTransaction) -> str:
        calls.append(1)
        tx.intend("email.send", {"n": 1})
        if len(calls) == 1:
            raise Boom
        return "ok"

    with pytest.raises(Boom):
        run.transaction("notify", flaky)
    assert run.transaction("notify", flaky) == "ok"
    effects = ob.run(run.id).effects()
    assert len(effects) == 1
    assert effects[0].step_index == 0


def test_a_step_joins_the_callers_open_transaction(ob: Outbox, caller_table: Table) -> None:
    run = ob.start_run("invoice-reconciler", "2.3.1")
    with ob.engine.connect() as conn:
        trans = conn.begin()
        conn.execute(caller_table.insert().values(invoice="INV-9"))
        run.transaction(
            "inside", lambda tx: tx.intend("email.send", {"n": 9}) and "x", connection=conn
        )
        trans.rollback()
    assert _count(ob, caller_table) == 0
    assert ob.run(run.id).completed_steps == []
    assert ob.effects(run_id=run.id) == []


def test_plain_outbox_transaction_commits_intents_with_caller_rows(
    ob: Outbox, caller_table: Table
) -> None:
    with pytest.raises(Boom), ob.transaction() as tx:
        tx.connection.execute(caller_table.insert().values(invoice="INV-3"))
        tx.intend("email.send", {"to": "a@example.com"}, key="order-3-confirmation")
        raise Boom
    assert ob.effects() == [] and _count(ob, caller_table) == 0

    with ob.transaction() as tx:
        tx.connection.execute(caller_table.insert().values(invoice="INV-3"))
        tx.intend("email.send", {"to": "a@example.com"}, key="order-3-confirmation")
    (effect,) = ob.effects()
    assert effect.run_id is None and effect.idempotency_key == "order-3-confirmation"
    assert _count(ob, caller_table) == 1


def _messages_sent(dsn: str, tmp_path: Path, step: Callable[[StepTransaction], object]) -> str:
    """What the client sent while one step ran, read from libpq's own trace."""
    ob = Outbox.connect(dsn, pool_size=1)
    trace = tmp_path / "libpq.trace"
    try:
        run = ob.start_run("tracer", "1")  # the pool's one connection exists now
        raw = ob.engine.raw_connection()
        pgconn = raw.driver_connection.pgconn  # type: ignore[union-attr]
        with trace.open("w") as out:
            pgconn.trace(out.fileno())
            pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
            raw.close()  # back to the pool: the step checks it out again
            run.transaction("traced", step)
            pgconn.untrace()
    finally:
        ob.close()
    # "F" lines are the client's (frontend) messages.
    return "\n".join(line for line in trace.read_text().splitlines() if line.startswith("F"))


def test_a_step_without_rows_of_its_own_is_one_statement_and_one_round_trip(
    dsn: str, tmp_path: Path, ob: Outbox, caller_table: Table
) -> None:
    sent = _messages_sent(dsn, tmp_path, lambda tx: tx.intend("email.send", {"to": "a@x.org"}))
    # No BEGIN and no COMMIT round trip: the checkpoint's statement commits by itself.
    assert "outbox_write_step" in sent
    assert "BEGIN" not in sent and "COMMIT" not in sent, sent

    def with_rows(tx: StepTransaction) -> None:
        tx.connection.execute(caller_table.insert().values(invoice="INV-9"))
        tx.intend("email.send", {"to": "b@x.org"})

    sent = _messages_sent(dsn, tmp_path, with_rows)
    # The caller's row and the checkpoint share one transaction.
    assert "BEGIN" in sent and "COMMIT" in sent, sent
    assert _count(ob, caller_table) == 1
