"""The SQL API refuses what the Python client refuses: bad arguments, payload rules, size caps.

The payload and identifier cases are Python's own table (``tests/intent_rule_cases.py``),
run here against ``outbox_payload_violation`` and ``outbox_intend``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from outbox.governance.intent_rules import REASONS, find_violation
from tests.intent_rule_cases import IDENTIFIER_CASES, PAYLOAD_CASES
from tests.sql_api_support import EMAIL, count, intend, start_run


@pytest.fixture
def db(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn) as conn:
        yield conn


# -- arguments ----------------------------------------------------------------------

REFUSED = [
    ("kind", {"kind": "email send"}, "OB001"),
    ("kind", {"kind": "x" * 201}, "OB001"),
    ("kind", {"kind": None}, "OB001"),
    ("key", {"key": "a\r\nb"}, "OB001"),
    ("key", {"key": "k" * 501}, "OB001"),
    ("key", {"key": ""}, "OB001"),
    ("ordering_key", {"ordering_key": "tab\there"}, "OB001"),
    ("max_attempts", {"max_attempts": 0}, "OB001"),
    ("max_attempts", {"max_attempts": 1001}, "OB001"),
    ("delay_seconds", {"delay_seconds": -1}, "OB001"),
    ("delay_seconds", {"delay_seconds": float("inf")}, "OB001"),
    ("delay_seconds", {"delay_seconds": 1e300}, "OB001"),
    ("schema_version", {"schema_version": 0}, "OB001"),
    ("cost", {"cost": "NaN"}, "OB001"),
    ("cost", {"cost": "Infinity"}, "OB001"),
    ("cost", {"cost": -1}, "OB001"),
    ("cost", {"cost": "1e20"}, "OB001"),
    ("compensate", {"compensate": json.dumps({"kind": "x"})}, "OB001"),
    ("compensate", {"compensate": json.dumps({"kind": "a b", "payload": 1})}, "OB001"),
    ("payload", {"payload": json.dumps({"__outbox_blob__": {"sha256": "0" * 64}})}, "OB002"),
    ("payload", {"payload": "[" * 101 + "]" * 101}, "OB002"),
    ("payload", {"payload": "1" + "0" * 4300}, "OB002"),
    ("payload", {"payload": "1" + "0" * 400 + ".5"}, "OB002"),
    ("payload", {"payload": None}, "OB001"),
    (
        "payload.headers",
        {"payload": json.dumps({"headers": {"Transfer-Encoding": "chunked"}})},
        "OB001",
    ),
    ("payload.headers", {"payload": json.dumps({"headers": {"content-length": "3"}})}, "OB001"),
    (
        "payload.headers",
        {"payload": json.dumps({"headers": {"Authorization": "Bearer x"}})},
        "OB001",
    ),
    ("payload.headers", {"payload": json.dumps({"headers": {"X-Auth-Token": "x"}})}, "OB001"),
    (
        "payload.headers.X-Note",
        {"payload": json.dumps({"headers": {"X-Note": "a\r\nInjected: 1"}})},
        "OB001",
    ),
    ("payload.url", {"payload": json.dumps({"url": "https://u:p@example.com/"})}, "OB001"),
    (
        "payload.url",
        {"payload": json.dumps({"url": "https://example.com/?access_token=x"})},
        "OB001",
    ),
    (
        "compensate.payload.headers",
        {"compensate": json.dumps({"kind": "x", "payload": {"headers": {"Cookie": "s=1"}}})},
        "OB001",
    ),
    ("step_index", {"step_index": 0}, "OB001"),
]


@pytest.mark.parametrize(("field", "args", "code"), REFUSED, ids=[r[0] for r in REFUSED])
def test_bad_intents_are_refused_naming_the_field(
    db: Any, field: str, args: dict[str, Any], code: str
) -> None:
    call = {"kind": "email.send", "payload": json.dumps(EMAIL), **args}
    named = ", ".join(f"{k} => %({k})s" for k in call)
    with pytest.raises(psycopg.Error) as caught:
        db.execute(f"SELECT outbox_intend({named})", call)
    assert caught.value.sqlstate == code
    assert caught.value.diag.column_name == field
    assert json.loads(caught.value.diag.message_detail or "{}")["field"] == field
    db.rollback()
    assert count(db, "outbox_effects") == 0


# Every client reads back the number that was written (issue 27, item 7): a fraction
# a double holds exactly (what Python writes: shortest round-trip digits) is kept;
# one it does not hold would be read, compared and sent as another number.
READABLE = [
    "0.30000000000000004",
    "1796207686.943141",
    "2.50",
    "1e-320",
    "-0.0001",
    "12345678901234567890",
]
UNREADABLE = ["0.100000000000000000000000000001", "1e-400", "3.14159265358979323846"]


@pytest.mark.parametrize("number", READABLE)
def test_numbers_read_back_as_written_are_stored(db: Any, number: str) -> None:
    db.autocommit = True
    row = db.execute("SELECT * FROM outbox_intend('a.b', %s::jsonb)", [f'{{"n": {number}}}'])
    effect_id = row.fetchone()[0]
    stored = db.execute("SELECT payload FROM outbox_effects WHERE id = %s", [effect_id]).fetchone()
    assert stored is not None and stored[0] == json.loads(f'{{"n": {number}}}')


@pytest.mark.parametrize("number", UNREADABLE)
def test_a_number_a_reader_would_change_is_refused(db: Any, number: str) -> None:
    with pytest.raises(psycopg.Error) as caught:
        db.execute("SELECT outbox_intend('a.b', %s::jsonb)", [f'{{"n": {number}}}'])
    assert (caught.value.sqlstate, caught.value.diag.column_name) == ("OB002", "payload")
    db.rollback()
    assert count(db, "outbox_effects") == 0


def test_a_payload_over_max_payload_bytes_is_refused(db: Any) -> None:
    # 64 MiB by default (Settings.max_payload_bytes); a session may lower it
    db.execute("SET outbox.max_payload_bytes = 1000")
    with pytest.raises(psycopg.Error) as caught:
        intend(db, "a.b", {"a": "x" * 1000})
    assert (caught.value.sqlstate, caught.value.diag.column_name) == ("OB002", "payload")


def test_http_payloads_that_follow_the_rules_are_accepted(db: Any) -> None:
    db.autocommit = True
    row = intend(
        db,
        "http.request",
        {
            "url": "https://example.com/orders?page=2&lang=en#top",
            "headers": {"Content-Type": "application/json", "X-Request-Id": "r1"},
            "json": {"user": "me", "token_count": 3},
            "credential": "orders-api",
        },
    )
    assert row[2] is True


def test_a_step_and_a_transaction_have_size_caps(db: Any) -> None:
    run_id = start_run(db)
    db.execute("SET outbox.max_step_intents = 2")
    db.execute("SET outbox.max_step_bytes = 100")
    for i in range(2):
        intend(db, "a.b", i, run_id=run_id, step_id="s")
    with pytest.raises(psycopg.Error) as caught:
        intend(db, "a.b", 3, run_id=run_id, step_id="s")
    assert (caught.value.sqlstate, caught.value.diag.column_name) == ("OB001", "intents")
    db.rollback()  # (which also undid the SETs)
    db.execute("SET outbox.max_step_bytes = 100")
    intend(db, "a.b", "x" * 60)
    with pytest.raises(psycopg.Error) as caught:
        intend(db, "a.b", "y" * 60)
    assert (caught.value.sqlstate, caught.value.diag.column_name) == ("OB002", "intents")
    assert "at most 100 bytes" in str(caught.value)


# -- the shared rule cases (tests/intent_rule_cases.py) ---------------------------------


def _storable(value: Any) -> bool:
    # NUL and lone surrogates cannot reach PostgreSQL at all: the driver or jsonb refuses them
    text_ = json.dumps(value)
    return "\\u0000" not in text_ and not any(0xD800 <= ord(c) <= 0xDFFF for c in str(value))


@pytest.mark.parametrize(
    ("payload", "refusal"),
    [c for c in PAYLOAD_CASES if _storable(c[0])],
    ids=[str(i) for i, c in enumerate(PAYLOAD_CASES) if _storable(c[0])],
)
def test_payload_rules_agree_with_python(
    db: Any, payload: Any, refusal: tuple[str, str] | None
) -> None:
    found = find_violation(payload, "payload")
    assert ((found.code, found.field) if found else None) == refusal  # the table is Python's
    row = db.execute(
        "SELECT outbox_payload_violation(%s::jsonb, 'payload')", [json.dumps(payload)]
    ).fetchone()
    assert row is not None
    got = None if row[0] is None else (row[0]["rule"], row[0]["field"])
    assert got == refusal
    if refusal is not None:
        with pytest.raises(psycopg.Error) as caught:
            intend(db, "http.request", payload)
        assert caught.value.sqlstate == "OB001"
        detail = json.loads(caught.value.diag.message_detail or "{}")
        assert (detail["rule"], detail["field"]) == refusal
        assert detail["reason"] == REASONS[refusal[0]]
        db.rollback()


@pytest.mark.parametrize(
    ("value", "code"),
    [c for c in IDENTIFIER_CASES if _storable(c[0])],
    ids=[repr(c[0]) for c in IDENTIFIER_CASES if _storable(c[0])],
)
def test_identifier_rules_agree_with_python(db: Any, value: str, code: str | None) -> None:
    db.autocommit = True
    for field in ("key", "ordering_key"):
        if code is None:
            intend(db, "k", {}, **{field: value + field})
            continue
        with pytest.raises(psycopg.Error) as caught:
            intend(db, "k", {}, **{field: value})
        detail = json.loads(caught.value.diag.message_detail or "{}")
        assert (detail["rule"], detail["field"]) == (code, field)
