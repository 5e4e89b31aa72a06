"""The SQL API (migration 0007): the contract other languages call inside their own transaction.

Every call here is plain SQL on a psycopg connection, as a TypeScript or Go
service would send it; the Python client then reads what was written.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from outbox import (
    BudgetExceeded,
    IdempotencyConflict,
    Outbox,
    PayloadError,
    RunNotFound,
    RunStateError,
    RunTerminal,
    StepAlreadyRecorded,
    ValidationError,
    derive_key,
)
from outbox.governance import chain
from outbox.payloads import content_hash, jsonb_text
from outbox.shards import key_shard
from outbox.storage.engine import translate_errors
from outbox.storage.notify import wait_for_notify
from tests.sql_api_support import EMAIL, count, intend, sqlstate_of, start_run


@pytest.fixture
def db(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn) as conn:
        yield conn


# -- G1 through SQL ------------------------------------------------------------------


def test_a_step_commits_with_the_callers_row_or_not_at_all(db: Any, ob: Outbox) -> None:
    db.execute("CREATE TABLE orders (id integer PRIMARY KEY, total numeric NOT NULL)")
    db.commit()
    run_id = start_run(db)

    def write_step() -> list[Any]:
        db.execute("INSERT INTO orders VALUES (1, 99.5)")
        rows = [
            intend(db, "email.send", {**EMAIL, "n": i}, run_id=run_id, step_id="place")
            for i in range(3)
        ]
        db.execute(
            "SELECT outbox_commit_step(%s, 'place', result => %s, state => %s)",
            [run_id, json.dumps({"order": 1}), json.dumps({"cursor": 1})],
        )
        return rows

    write_step()
    db.rollback()
    assert count(db, "orders") == count(db, "outbox_effects") == count(db, "outbox_steps") == 0
    assert ob.run(run_id).state == {}

    rows = write_step()
    db.commit()
    assert count(db, "orders") == 1
    run = ob.run(run_id)
    assert run.completed_steps == ["place"]
    assert run.step("place").result == {"order": 1}  # type: ignore[union-attr]
    assert run.state == {"cursor": 1}
    effects = run.effects()
    assert [e.idempotency_key for e in effects] == [
        derive_key(run_id, "place", i) for i in range(3)
    ]
    assert [e.id for e in effects] == [row[0] for row in rows]
    assert all(row[2] for row in rows), "created"
    assert [e.payload for e in effects] == [{**EMAIL, "n": i} for i in range(3)]
    assert [e.payload_hash for e in effects] == [
        content_hash(jsonb_text({**EMAIL, "n": i})) for i in range(3)
    ]


def test_intents_of_a_step_never_commit_without_the_step(db: Any) -> None:
    run_id = start_run(db)
    intend(db, "email.send", EMAIL, run_id=run_id, step_id="forgot")
    assert sqlstate_of(db.commit) == "OB008"
    assert count(db, "outbox_effects") == 0
    # a lone intend outside a transaction block is one transaction: refused too
    db.rollback()
    db.autocommit = True
    assert sqlstate_of(lambda: intend(db, "email.send", EMAIL, run_id=run_id, step_id="s")) == (
        "OB008"
    )
    assert count(db, "outbox_effects") == 0


def test_nothing_is_intended_for_a_step_after_its_commit_in_the_same_transaction(db: Any) -> None:
    run_id = start_run(db)
    db.execute("SELECT outbox_commit_step(%s, 's')", [run_id])
    code = sqlstate_of(lambda: intend(db, "email.send", EMAIL, run_id=run_id, step_id="s"))
    assert code == "OB001"


def test_a_recorded_step_is_refused_and_its_result_can_be_read(db: Any) -> None:
    run_id = start_run(db)
    intend(db, "email.send", EMAIL, run_id=run_id, step_id="s")
    db.execute("SELECT outbox_commit_step(%s, 's', result => '{\"v\": 1}')", [run_id])
    db.commit()
    assert sqlstate_of(lambda: intend(db, "email.send", EMAIL, run_id=run_id, step_id="s")) == (
        "OB006"
    )
    db.rollback()
    assert sqlstate_of(lambda: db.execute("SELECT outbox_commit_step(%s, 's')", [run_id])) == (
        "OB006"
    )
    db.rollback()
    row = db.execute(
        "SELECT step_kind, status, result FROM outbox_step(%s, 's')", [run_id]
    ).fetchone()
    assert row == ("transaction", "completed", {"v": 1})
    assert db.execute("SELECT * FROM outbox_step(%s, 'other')", [run_id]).fetchall() == []


def test_two_transactions_racing_on_one_step_make_one_set_of_rows(dsn: str) -> None:
    with psycopg.connect(dsn) as a, psycopg.connect(dsn) as b:
        run_id = start_run(a)
        intend(a, "email.send", EMAIL, run_id=run_id, step_id="s")
        a.execute("SELECT outbox_commit_step(%s, 's', result => '\"a\"')", [run_id])
        outcome: list[str] = []

        def racer() -> None:
            try:
                intend(b, "email.send", {"other": "payload"}, run_id=run_id, step_id="s")
                b.execute("SELECT outbox_commit_step(%s, 's', result => '\"b\"')", [run_id])
                b.commit()
                outcome.append("committed")
            except psycopg.Error as exc:
                outcome.append(str(exc.sqlstate))
                b.rollback()

        thread = threading.Thread(target=racer)
        thread.start()
        thread.join(0.5)
        assert thread.is_alive(), "b waits for a's key"
        a.commit()
        thread.join(10)
        assert outcome == ["OB006"]
        assert count(a, "outbox_effects") == 1
        row = a.execute("SELECT result FROM outbox_step(%s, 's')", [run_id]).fetchone()
        assert row == ("a",)


# -- keys and conflicts -------------------------------------------------------------


def test_a_callers_key_returns_the_same_intent_or_is_a_conflict(db: Any, ob: Outbox) -> None:
    db.autocommit = True
    first = intend(db, "email.send", EMAIL, key="order-1-confirmation")
    again = intend(db, "email.send", EMAIL, key="order-1-confirmation")
    assert first[2] is True and again[2] is False and again[0] == first[0]
    for changed in (
        lambda: intend(db, "email.send", {**EMAIL, "subject": "x"}, key="order-1-confirmation"),
        lambda: intend(db, "sms.send", EMAIL, key="order-1-confirmation"),
    ):
        assert sqlstate_of(changed) == "OB003"
    run_id = start_run(db)
    db.autocommit = False
    code = sqlstate_of(
        lambda: intend(
            db, "email.send", EMAIL, key="order-1-confirmation", run_id=run_id, step_id="s"
        )
    )
    assert code == "OB003", "another owner (a run) may not take the key"
    db.rollback()

    # a key the Python client wrote is recognised by the SQL API, and the reverse
    with ob.transaction() as tx:
        tx.intend("email.send", {"b": [1, 2.5, "é"], "a": None}, key="from-python")
    db.autocommit = True
    row = intend(db, "email.send", {"a": None, "b": [1, 2.5, "é"]}, key="from-python")
    assert row[2] is False
    with ob.transaction() as tx:
        effect = tx.intend("email.send", EMAIL, key="order-1-confirmation")
    assert effect.id == first[0]


def test_a_python_replay_of_a_sql_step_reuses_its_derived_keys(db: Any, ob: Outbox) -> None:
    run_id = start_run(db)
    intend(db, "email.send", EMAIL, run_id=run_id, step_id="s")
    db.execute("SELECT outbox_commit_step(%s, 's', result => '7')", [run_id])
    db.commit()
    run = ob.run(run_id)
    assert run.transaction("s", lambda tx: tx.intend("email.send", EMAIL)) == 7
    assert len(run.effects()) == 1


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(
            st.uuids(), st.text().filter(lambda s: "\x00" not in s), st.integers(0, 2**31 - 1)
        ),
        min_size=1,
        max_size=20,
    )
)
def test_keys_derived_in_sql_equal_pythons(
    dsn: str, triples: list[tuple[uuid.UUID, str, int]]
) -> None:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT outbox_derive_key(r, s, i) FROM unnest(%s::uuid[], %s::text[], %s::int[])"
            " WITH ORDINALITY AS t(r, s, i, n) ORDER BY n",
            [[t[0] for t in triples], [t[1] for t in triples], [t[2] for t in triples]],
        ).fetchall()
    assert [r[0] for r in rows] == [derive_key(*t) for t in triples]


#: Text the hashing functions take: anything but NUL, with backslashes, escapes
#: that decode() would read (\\x41, \\101) and characters of 2 to 4 UTF-8 bytes.
TEXT = st.lists(
    st.text(st.characters(blacklist_characters="\x00", blacklist_categories=["Cs"]), max_size=4)
    | st.sampled_from(["\\", "\\x41", "\\101", "\\\\"]),
    max_size=6,
).map("".join)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(st.tuples(TEXT, TEXT, st.uuids(), st.datetimes(timezones=st.just(UTC))), min_size=1)
)
def test_hashing_in_sql_equals_pythons(
    dsn: str, rows: list[tuple[str, str, uuid.UUID, datetime]]
) -> None:
    # The SQL hashing helpers take text as UTF-8 through outbox_utf8, not convert_to
    # (so they are inlined): the same bytes, so keys, shards and chain links match
    # what Python computes (and what `outbox audit verify` recomputes).
    texts, others, ids, times = (list(c) for c in zip(*rows, strict=True))
    with psycopg.connect(dsn) as conn:
        got = conn.execute(
            "SELECT outbox_utf8(a) = convert_to(a, 'UTF8'), outbox_key_shard(a, b),"
            "       outbox_effect_genesis(i, NULL, a, b, a), to_jsonb(a)::text,"
            "       outbox_result_hash(to_jsonb(b)),"
            "       encode(sha256(convert_to(to_jsonb(b)::text, 'UTF8')), 'hex'),"
            "       outbox_attempt_link('\\x01'::bytea, i, 1, a, t, t, b, to_jsonb(a),"
            "                           'succeeded', outbox_result_hash(to_jsonb(b)))"
            "  FROM unnest(%s::text[], %s::text[], %s::uuid[], %s::timestamptz[])"
            "       WITH ORDINALITY AS x(a, b, i, t, n) ORDER BY n",
            [texts, others, ids, times],
        ).fetchall()
    for (same, shard, genesis, detail, result_hash, expected_hash, link), a, b, i, t in zip(
        got, texts, others, ids, times, strict=True
    ):
        assert same
        assert shard == key_shard(a, b)
        effect = {"id": str(i), "run_id": None, "kind": a, "idempotency_key": b, "payload_hash": a}
        assert genesis == chain.effect_genesis(effect)
        assert result_hash == expected_hash
        attempt = {
            "effect_id": str(i),
            "attempt": 1,
            "worker": a,
            "started_us": chain.us(t),
            "finished_us": chain.us(t),
            "outcome": b,
            "detail_text": detail,
            "effect_status": "succeeded",
            "result_hash": result_hash,
        }
        assert link == chain.attempt_hash(b"\x01", attempt)


@pytest.mark.parametrize(
    "call",
    [
        "outbox_attempt_link(h, i, 1, t, now(), now(), t, NULL, t, t)",
        "outbox_effect_genesis(i, i, t, t, t)",
        "outbox_step_link(h, i, t, t, t, t, t, t, now(), t)",
        "outbox_run_genesis(i, t, t)",
        "outbox_result_hash(to_jsonb(t))",
        "outbox_derive_key(i, t, 1)",
        "outbox_key_shard(t, t)",
    ],
)
def test_hashing_helpers_are_inlined(dsn: str, call: str) -> None:
    # Not inlined, each call runs through the SQL-function executor: 15 us for an
    # attempt's link (every effect delivered), 2 us inlined. A body that calls a
    # STABLE function (convert_to, extract from a timestamptz) is not inlined.
    with psycopg.connect(dsn) as conn:
        plan = conn.execute(
            f"EXPLAIN (VERBOSE) SELECT {call}"
            " FROM (VALUES ('\\x01'::bytea, gen_random_uuid(), 'x')) AS v(h, i, t)"
        ).fetchall()
    output = " ".join(line for (line,) in plan if "Output:" in line)
    assert "sha256" in output and "outbox_" not in output, output


def test_a_step_calls_no_helper_as_a_function_of_its_own(dsn: str, ob: Outbox) -> None:
    # The step statement's helpers are inlined into its one plan: the key's
    # derivation (its argument was too costly to substitute while the step index's
    # reader was pulled up into it) and the values' screen (IMMUTABLE over STABLE
    # limits was never inlined). pg_stat_xact_user_functions counts the calls the
    # transaction made of functions that were not.
    run = ob.start_run("inline", "1")
    with psycopg.connect(dsn) as conn:
        conn.execute("SET LOCAL track_functions = 'all'")
        conn.execute(
            "SELECT outbox_commit_step(%s, 's', '{\"ok\": 1}', %s::jsonb)",
            [run.id, json.dumps([{"kind": "k.inline", "payload": {"n": 1}}])],
        )
        called = {
            name for (name,) in conn.execute("SELECT funcname FROM pg_stat_xact_user_functions")
        }
    assert "outbox_write_step" in called, called
    assert not called & {"outbox_derive_key", "outbox_values_screened"}, called


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    keys = st.text().filter(lambda s: "\x00" not in s)
    return st.lists(children, max_size=4) | st.dictionaries(keys, children, max_size=4)


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**30), 10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text().filter(lambda s: "\x00" not in s),
    _containers,
    max_leaves=12,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(JSON)
def test_pythons_jsonb_text_is_postgresqls(dsn: str, value: Any) -> None:
    # A payload's hash is the sha256 of its jsonb's text, computed by the write function;
    # the client renders the same text to answer tx.intend before its step commits.
    python = jsonb_text(value)
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT %s::jsonb::text", [json.dumps(value)]).fetchone()
    assert row is not None and row[0] == python


# -- errors seen from Python ---------------------------------------------------------


def test_each_sqlstate_becomes_the_python_clients_error(ob: Outbox, db: Any) -> None:
    run_id = start_run(db, budget=1)
    db.autocommit = True
    intend(db, "email.send", EMAIL, key="taken")
    cases: list[tuple[str, dict[str, Any], type[Exception]]] = [
        ("SELECT outbox_intend('bad kind', '{}')", {}, ValidationError),
        ("SELECT outbox_intend('k', :p)", {"p": "[" * 101 + "]" * 101}, PayloadError),
        ("SELECT outbox_intend('k', '{}', key => 'taken')", {}, IdempotencyConflict),
        ("SELECT outbox_signal(:r, 'go')", {"r": uuid.uuid4()}, RunNotFound),
        (
            "SELECT outbox_spend(:r, 's', 5, 'llm'), outbox_commit_step(:r, 's')",
            {"r": run_id},
            BudgetExceeded,
        ),
    ]
    for statement, params, error in cases:
        with (
            pytest.raises(error) as caught,
            translate_errors("calling the SQL API"),
            ob.engine.begin() as conn,
        ):
            conn.execute(text(statement), params)
        assert isinstance(caught.value.__cause__, Exception)
    assert caught.value.requested == 5.0 and caught.value.remaining == 1.0  # type: ignore[attr-defined]
    # A broken intent rule keeps its code: the Python client and the HTTP API report the same.
    with (
        pytest.raises(ValidationError) as broken,
        translate_errors("calling the SQL API"),
        ob.engine.begin() as conn,
    ):
        conn.execute(text('SELECT outbox_intend(\'k\', \'{"headers": {"Cookie": "a"}}\')'))
    assert (broken.value.field, broken.value.rule) == ("payload.headers", "credential-header")

    with ob.engine.begin() as conn:
        conn.execute(text("SELECT outbox_commit_step(:r, 'done')"), {"r": run_id})
    with (
        pytest.raises(StepAlreadyRecorded) as recorded,
        translate_errors("replaying"),
        ob.engine.begin() as conn,
    ):
        conn.execute(text("SELECT outbox_commit_step(:r, 'done')"), {"r": run_id})
    assert recorded.value.step_id == "done" and recorded.value.run_id == run_id
    with (
        pytest.raises(RunStateError, match="outbox_commit_step was not called"),
        translate_errors("committing"),
        ob.engine.begin() as conn,
    ):
        conn.execute(
            text("SELECT outbox_intend('k', '{}', run_id => :r, step_id => 'open')"),
            {"r": run_id},
        )
    db.execute("SELECT outbox_finish_run(%s, 'completed')", [run_id])
    with (
        pytest.raises(RunTerminal) as ended,
        translate_errors("signalling"),
        ob.engine.begin() as conn,
    ):
        conn.execute(text("SELECT outbox_signal(:r, 'go')"), {"r": run_id})
    assert ended.value.status == "completed"


# -- runs, budgets, signals, reading -------------------------------------------------


def test_start_run_is_repeatable_with_the_same_arguments(db: Any, ob: Outbox) -> None:
    run_id = uuid.uuid4()
    assert start_run(db, run_id=run_id, budget=10) == run_id
    assert start_run(db, run_id=run_id, budget=10) == run_id
    assert sqlstate_of(lambda: start_run(db, run_id=run_id, inputs='{"order": 2}')) == "OB001"
    db.rollback()
    run = ob.run(run_id)
    assert (run.agent, run.version, run.inputs) == ("shop", "1", {"order": 1})
    assert run.record.inputs_hash == content_hash(jsonb_text({"order": 1}))
    assert run.record.budget == 10
    assert sqlstate_of(lambda: start_run(db, agent="")) == "OB001"
    db.rollback()
    assert sqlstate_of(lambda: start_run(db, budget="NaN")) == "OB001"


def test_costs_and_debits_reach_the_budget_and_its_ledger(db: Any, ob: Outbox) -> None:
    run_id = start_run(db, budget=10)
    db.execute("SELECT outbox_spend(%s, 's', 1.5, 'model call')", [run_id])
    assert (
        sqlstate_of(lambda: db.execute("SELECT outbox_spend(%s, 's', 1, 'model call')", [run_id]))
        == "OB001"
    )
    db.rollback()
    db.execute("SELECT outbox_spend(%s, 's', 1.5, 'model call')", [run_id])
    made = intend(db, "charge.create", {"amount": 3}, run_id=run_id, step_id="s", cost=3)
    db.execute("SELECT outbox_commit_step(%s, 's')", [run_id])
    db.commit()
    record = ob.run(run_id).record
    assert (record.spent, record.reserved) == (Decimal("1.5"), Decimal(3))
    ledger = db.execute(
        "SELECT entry, reason, amount, effect_id FROM outbox_budget_ledger ORDER BY id"
    ).fetchall()
    assert ledger == [("spend", "model call", 1.5, None), ("reserve", "charge.create", 3, made[0])]
    run_two = start_run(db, budget=1)
    intend(db, "charge.create", {"amount": 3}, run_id=run_two, step_id="s", cost=3)
    assert sqlstate_of(lambda: db.execute("SELECT outbox_commit_step(%s, 's')", [run_two])) == (
        "OB007"
    )


def test_a_signal_reaches_the_python_run_once(db: Any, ob: Outbox) -> None:
    run_id = start_run(db)
    db.autocommit = True
    first = db.execute(
        "SELECT * FROM outbox_signal(%s, 'approve', '{\"by\": \"ops\"}', dedup_key => 'd1')",
        [run_id],
    ).fetchone()
    again = db.execute(
        "SELECT * FROM outbox_signal(%s, 'approve', '{\"by\": \"ops\"}', dedup_key => 'd1')",
        [run_id],
    ).fetchone()
    assert first[1:] == (False, False) and again == (None, True, False)
    assert ob.run(run_id).wait_signal("approval", name="approve", timeout=5) == {"by": "ops"}


def test_a_signal_wakes_a_waiting_run(db: Any, ob: Outbox) -> None:
    run_id = start_run(db)
    db.autocommit = True
    db.execute(
        "UPDATE outbox_runs SET status = 'waiting', wait_signal = 'approve' WHERE id = %s",
        [run_id],
    )
    row = db.execute("SELECT * FROM outbox_signal(%s, 'approve')", [run_id]).fetchone()
    assert row[1:] == (False, True)
    assert ob.run(run_id).status == "runnable"


def test_finish_run_ends_a_live_run_once(db: Any, ob: Outbox) -> None:
    run_id = start_run(db)
    db.autocommit = True
    db.execute("SELECT outbox_finish_run(%s, 'failed', error => '{\"why\": \"x\"}')", [run_id])
    assert ob.run(run_id).record.error == {"why": "x"}
    assert sqlstate_of(
        lambda: db.execute("SELECT outbox_finish_run(%s, 'completed')", [run_id])
    ) == ("OB005")
    assert (
        sqlstate_of(lambda: db.execute("SELECT outbox_finish_run(%s, 'completed')", [uuid.uuid4()]))
        == "OB004"
    )


def test_an_effects_outcome_is_read_by_id_or_key(db: Any, ob: Outbox) -> None:
    db.autocommit = True
    made = intend(db, "email.send", EMAIL, key="k1")
    row = db.execute(
        "SELECT id, kind, status, idempotency_key, attempt FROM outbox_effect_status(%s)", [made[0]]
    ).fetchone()
    assert row == (made[0], "email.send", "pending", "k1", 0)
    by_key = db.execute("SELECT id FROM outbox_effect_by_key('k1')").fetchone()
    assert by_key == (made[0],)
    assert db.execute("SELECT * FROM outbox_effect_status(%s)", [uuid.uuid4()]).fetchall() == []
    assert ob.effect(made[0]).idempotency_key == "k1"


# -- wake-ups -------------------------------------------------------------------------


def test_intents_wake_deliverers_at_most_once_per_window(dsn: str, db: Any) -> None:
    db.autocommit = True
    db.execute("SET outbox.notify_window_ms = 60000")
    woke: list[bool] = []

    def listen() -> None:
        woke.append(wait_for_notify(dsn, "outbox_effects", 3.0))

    def intend_while_listening() -> bool:
        thread = threading.Thread(target=listen)
        thread.start()
        threading.Event().wait(0.5)  # the listener is subscribed
        intend(db, "email.send", EMAIL)
        thread.join()
        return woke.pop()

    assert intend_while_listening() is True, "the first intent wakes the deliverers"
    assert intend_while_listening() is False, "within the window: no second NOTIFY"
    db.execute("SET outbox.notify_window_ms = 0")
    assert intend_while_listening() is True
    assert intend_while_listening() is True, "a window of 0 notifies every commit"
