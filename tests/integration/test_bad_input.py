"""Bad input gets a typed error naming the field and value; nothing already committed is lost."""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from outbox import (
    DatabaseError,
    Outbox,
    OutboxError,
    PayloadError,
    Run,
    RunNotFound,
    Settings,
    StepTransaction,
    ValidationError,
)


@pytest.fixture
def run_with_history(ob: Outbox) -> Run:
    run = ob.start_run("invoice-reconciler", "2.3.1", {"month": "2026-10"})

    def first(tx: StepTransaction) -> str:
        tx.set_state({"cursor": 1})
        return tx.intend("email.send", {"n": 1}).idempotency_key

    run.transaction("first", first)
    return run


def _assert_history_intact(ob: Outbox, run_id: uuid.UUID) -> None:
    fresh = ob.run(run_id)
    assert fresh.completed_steps == ["first"]
    assert fresh.state == {"cursor": 1}
    assert len(fresh.effects()) == 1


def test_unknown_run_id(ob: Outbox) -> None:
    missing = uuid.uuid4()
    with pytest.raises(RunNotFound, match=str(missing)):
        ob.run(missing)
    with pytest.raises(ValidationError, match="run_id='not-a-uuid'"):
        ob.run("not-a-uuid")


@pytest.mark.parametrize("step_id", ["", "   ", "x" * 201, 7, None])
def test_bad_step_ids(ob: Outbox, run_with_history: Run, step_id: object) -> None:
    with pytest.raises(ValidationError) as info:
        run_with_history.transaction(step_id, lambda tx: None)  # type: ignore[arg-type]
    assert info.value.field == "step_id"
    with pytest.raises(ValidationError):
        run_with_history.call(step_id, lambda: 1)  # type: ignore[arg-type]
    _assert_history_intact(ob, run_with_history.id)


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        ({"when": object()}, "not JSON-serialisable"),
        ({"x": math.nan}, "not valid JSON"),
        ({"x": math.inf}, "not valid JSON"),
        ({"s": "\x00"}, "NUL"),
    ],
)
def test_bad_payloads(ob: Outbox, run_with_history: Run, payload: object, reason: str) -> None:
    def step(tx: StepTransaction) -> None:
        tx.intend("email.send", payload)

    with pytest.raises(PayloadError, match=reason) as info:
        run_with_history.transaction("second", step)
    assert info.value.field == "payload"
    _assert_history_intact(ob, run_with_history.id)


def test_bad_result_state_and_plan(ob: Outbox, run_with_history: Run) -> None:
    with pytest.raises(PayloadError) as info:
        run_with_history.transaction("second", lambda tx: {"x": math.nan})
    assert info.value.field == "result"
    with pytest.raises(PayloadError) as info:
        run_with_history.transaction("second", lambda tx: tx.set_state({1, 2}))
    assert info.value.field == "state"
    with pytest.raises(PayloadError) as info:
        run_with_history.call("second", lambda: object())
    assert info.value.field == "result"
    _assert_history_intact(ob, run_with_history.id)


def test_payload_size_limit_is_configurable(dsn: str) -> None:
    small = Outbox.connect(settings=Settings(dsn=dsn, max_payload_bytes=100))
    try:
        run = small.start_run("a", "1")
        with pytest.raises(PayloadError, match="over the limit of 100 bytes"):
            run.transaction("s", lambda tx: tx.intend("email.send", {"body": "x" * 200}))
        run.transaction("s", lambda tx: tx.intend("email.send", {"body": "x" * 50}) and None)
    finally:
        small.close()


def test_default_size_limit_is_64_mebibytes(ob: Outbox) -> None:
    run = ob.start_run("a", "1")
    limit = 64 * 1024 * 1024
    with pytest.raises(PayloadError, match=f"over the limit of {limit} bytes"):
        run.transaction("s", lambda tx: tx.intend("email.send", {"body": "x" * limit}))


@pytest.mark.parametrize("version", [231, 2.3, None, ["2"], ""])
def test_agent_version_must_be_a_string(ob: Outbox, version: object) -> None:
    with pytest.raises(ValidationError) as info:
        ob.start_run("invoice-reconciler", version, {})  # type: ignore[arg-type]
    assert info.value.field == "version"
    assert ob.runs() == []


def test_bad_inputs_and_budget(ob: Outbox) -> None:
    with pytest.raises(PayloadError, match="inputs="):
        ob.start_run("a", "1", {"x": math.nan})
    with pytest.raises(ValidationError, match="budget"):
        ob.start_run("a", "1", budget=-1)
    with pytest.raises(ValidationError, match="agent"):
        ob.start_run("", "1")


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"max_attempts": 0}, "max_attempts"),
        ({"delay_seconds": -1}, "delay_seconds"),
        ({"key": ""}, "key"),
    ],
)
def test_bad_intent_options(ob: Outbox, options: dict[str, object], field: str) -> None:
    run = ob.start_run("a", "1")
    with pytest.raises(ValidationError) as info:
        run.transaction("s", lambda tx: tx.intend("email.send", {}, **options))  # type: ignore[arg-type]
    assert info.value.field == field


def test_bad_effect_kind(ob: Outbox) -> None:
    run = ob.start_run("a", "1")
    with pytest.raises(ValidationError) as info:
        run.transaction("s", lambda tx: tx.intend("email send!", {}))
    assert info.value.field == "kind"


def test_every_error_is_an_outbox_error(ob: Outbox) -> None:
    with pytest.raises(OutboxError):
        ob.run(uuid.uuid4())


# -- hardening (issue 11): every bad value is a typed error naming the field ---------------


def _nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


def _stored_payloads(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [r[0] for r in conn.execute("SELECT payload::text FROM outbox_effects")]


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"url": "https://api.example.com", "headers": {"X-Auth-Token": "tok-123"}}, "headers"),
        ({"url": "https://api.example.com", "headers": {"Api-Key": "tok-123"}}, "headers"),
        ({"url": "https://alice:tok-123@api.example.com/charge"}, "url"),
        ({"url": "https://api.example.com/charge?access_token=tok-123"}, "url"),
    ],
)
def test_secrets_in_payloads_are_refused_at_intend(
    ob: Outbox, dsn: str, run_with_history: Run, payload: dict[str, object], field: str
) -> None:
    # M1: these were stored in plain text in outbox_effects.
    with pytest.raises(ValidationError) as info:
        run_with_history.transaction("second", lambda tx: tx.intend("http.request", payload))
    assert info.value.field == f"payload.{field}"
    assert "credentials" in info.value.reason and "env" in info.value.reason
    assert "tok-123" not in str(info.value)
    with pytest.raises(ValidationError), ob.transaction() as tx:
        tx.intend("http.request", payload)
    assert not any("tok-123" in p for p in _stored_payloads(dsn))
    _assert_history_intact(ob, run_with_history.id)


@pytest.mark.parametrize(
    "header", ["Transfer-Encoding", "Content-Length", "Connection", "Host", "TE", "Upgrade"]
)
def test_framing_headers_are_refused_at_intend(
    ob: Outbox, run_with_history: Run, header: str
) -> None:
    # M5: a payload's Transfer-Encoding broke the request's framing at the sink.
    payload = {"url": "https://api.example.com", "headers": {header: "chunked"}}
    with pytest.raises(ValidationError, match="hop-by-hop or framing") as info:
        run_with_history.transaction("second", lambda tx: tx.intend("http.request", payload))
    assert info.value.field == "payload.headers"
    assert info.value.value == header
    _assert_history_intact(ob, run_with_history.id)


@pytest.mark.parametrize(
    ("options", "payload", "field"),
    [
        ({"key": "order-1\r\nX-Forged: 1"}, {}, "key"),
        ({"ordering_key": "tenant\n2026-01-01 INFO forged"}, {}, "ordering_key"),
        ({}, {"headers": {"X-Note": "a\r\nX-Injected: 1"}}, "payload.headers.X-Note"),
        ({}, {"headers": {"X-Bad\nName": "v"}}, "payload.headers"),
    ],
)
def test_control_characters_in_keys_and_headers_are_refused_at_intend(
    ob: Outbox, run_with_history: Run, options: dict[str, Any], payload: object, field: str
) -> None:
    # L4: these were accepted and failed only "after the request was sent".
    with pytest.raises(ValidationError) as info:
        run_with_history.transaction(
            "second", lambda tx: tx.intend("http.request", payload, **options)
        )
    assert info.value.field == field
    assert "\n" not in str(info.value)
    _assert_history_intact(ob, run_with_history.id)


def test_a_literal_backslash_u0000_is_stored(ob: Outbox) -> None:
    # L5: the six characters \u0000 in a string were refused as a NUL.
    run = ob.start_run("a", "1")
    run.transaction("s", lambda tx: tx.intend("email.send", {"path": "C:\\u0000"}) and None)
    assert ob.effects()[0].payload == {"path": "C:\\u0000"}


@pytest.mark.parametrize(
    ("compensate", "field"),
    [
        (("undo", {"x": math.nan}), "compensate"),
        (("undo", {"x": math.inf}), "compensate"),
        (("undo it!", {}), "compensate"),
        (("undo", {"headers": {"Authorization": "Bearer t"}}), "compensate.payload.headers"),
        (("x",), "compensate"),
    ],
)
def test_compensations_are_validated_like_intents(
    ob: Outbox, run_with_history: Run, compensate: tuple[object, ...], field: str
) -> None:
    # M7: NaN was stored as null and the kind was not checked; L2: ("x",) raised IndexError.
    with pytest.raises(ValidationError) as info:
        run_with_history.transaction(
            "second",
            lambda tx: tx.intend("email.send", {}, compensate=compensate),  # type: ignore[arg-type]
        )
    assert info.value.field == field
    _assert_history_intact(ob, run_with_history.id)


def test_a_step_has_a_cap_on_its_number_of_intents(dsn: str) -> None:
    # L10: 100,000 intents in one step were accepted (past 1 GB PostgreSQL failed opaquely).
    small = Outbox.connect(settings=Settings(dsn=dsn, max_step_intents=3))
    try:
        run = small.start_run("a", "1")

        def many(tx: StepTransaction) -> None:
            for n in range(4):
                tx.intend("email.send", {"n": n})

        with pytest.raises(ValidationError, match="max_step_intents") as info:
            run.transaction("s", many)
        assert info.value.field == "intents"
        assert small.effects() == []
        run.transaction(
            "s", lambda tx: [tx.intend("email.send", {"n": n}) for n in range(3)] and None
        )
        assert len(small.effects()) == 3
    finally:
        small.close()


def test_a_step_has_a_cap_on_its_total_bytes(dsn: str) -> None:
    small = Outbox.connect(settings=Settings(dsn=dsn, max_step_bytes=2500))
    try:
        run = small.start_run("a", "1")

        def big(tx: StepTransaction) -> None:
            for n in range(3):
                tx.intend("email.send", {"n": n, "body": "x" * 1000})

        with pytest.raises(PayloadError, match="max_step_bytes") as info:
            run.transaction("s", big)
        assert info.value.field == "intents"
        assert small.effects() == []
        with pytest.raises(PayloadError, match="max_step_bytes"), small.transaction() as tx:
            big(tx)  # type: ignore[arg-type]
    finally:
        small.close()


def test_the_default_step_caps_refuse_a_runaway_step(ob: Outbox) -> None:
    assert ob.settings.max_step_intents == 10_000
    assert ob.settings.max_step_bytes == 64 * 1024 * 1024
    run = ob.start_run("a", "1")
    with pytest.raises(PayloadError, match="max_step_bytes"):
        run.transaction(
            "s",
            lambda tx: [tx.intend("email.send", {"n": n, "b": "x" * 1_000_000}) for n in range(70)],
        )
    assert ob.effects() == []


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        ({"s": "\ud800"}, "lone surrogate"),
        (_nested(5000), "nested too deeply"),
        ({"n": 10**4999}, "integer too long"),
    ],
    ids=["surrogate", "deep", "long-int"],
)
def test_unstorable_payloads_inputs_and_signals_are_typed(
    ob: Outbox, run_with_history: Run, payload: object, reason: str
) -> None:
    with pytest.raises(PayloadError, match=reason) as info:
        run_with_history.transaction("second", lambda tx: tx.intend("email.send", payload))
    assert info.value.field == "payload"
    with pytest.raises(PayloadError, match=reason) as info:
        ob.start_run("a", "1", payload)
    assert info.value.field == "inputs"
    with pytest.raises(PayloadError, match=reason) as info:
        ob.signal(run_with_history.id, "approval", payload)
    assert info.value.field == "payload"
    _assert_history_intact(ob, run_with_history.id)


_INTEND_CASES = [
    ({"cost": math.inf}, "cost"),
    ({"cost": 10**5000}, "cost"),
    ({"cost": True}, "cost"),
    ({"delay_seconds": math.inf}, "delay_seconds"),
    ({"delay_seconds": 1e300}, "delay_seconds"),
    ({"schema_version": 2**40}, "schema_version"),
    ({"schema_version": True}, "schema_version"),
    ({"max_attempts": True}, "max_attempts"),
    ({"key": "k\x00"}, "key"),
    ({"key": "k\ud800"}, "key"),
    ({"ordering_key": "o\x00"}, "ordering_key"),
]


@pytest.mark.parametrize(
    ("options", "field"), _INTEND_CASES, ids=[f"{f}-{i}" for i, (_, f) in enumerate(_INTEND_CASES)]
)
def test_bad_intent_numbers_and_keys_are_typed(
    ob: Outbox, run_with_history: Run, options: dict[str, object], field: str
) -> None:
    # L2: a pydantic error, a bare ValueError or a raw DatabaseError before.
    with pytest.raises(ValidationError) as info:
        run_with_history.transaction("second", lambda tx: tx.intend("email.send", {}, **options))  # type: ignore[arg-type]
    assert info.value.field == field
    assert not isinstance(info.value, DatabaseError)
    _assert_history_intact(ob, run_with_history.id)


def test_bad_identifiers_are_typed_not_database_errors(ob: Outbox, run_with_history: Run) -> None:
    # L2: a NUL reached PostgreSQL and came back as a DatabaseError.
    cases: list[tuple[str, Callable[[], object]]] = [
        ("agent", lambda: ob.start_run("a\x00", "1")),
        ("version", lambda: ob.start_run("a", "1\x00")),
        ("step_id", lambda: run_with_history.transaction("s\x00", lambda tx: None)),
        ("step_id", lambda: run_with_history.call("s\x00", lambda: 1)),
        ("name", lambda: ob.signal(run_with_history.id, "go\x00")),
        ("dedup_key", lambda: ob.signal(run_with_history.id, "go", dedup_key="d\x00")),
        ("request_id", lambda: ob.signal(run_with_history.id, "go", request_id="r\x00")),
        ("name", lambda: run_with_history.wait_signal("w", name="go\x00", timeout=0)),
        ("reason", lambda: ob.cancel(run_with_history.id, "because\x00")),
        ("reason", lambda: ob.cancel(run_with_history.id, "because\ud800")),
        ("reason", lambda: run_with_history.transaction("s", lambda tx: tx.spend(1, "r\x00"))),
        ("agent", lambda: ob.worker("a\x00", "1", lambda run: None)),
    ]
    for field, call in cases:
        with pytest.raises(ValidationError) as info:
            call()
        assert info.value.field == field, field
    _assert_history_intact(ob, run_with_history.id)


@pytest.mark.parametrize("duration", [math.inf, 1e300, math.nan, -1, 10**400, "5"])
def test_bad_sleep_durations_are_typed(ob: Outbox, run_with_history: Run, duration: object) -> None:
    with pytest.raises(ValidationError) as info:
        run_with_history.sleep("nap", duration)  # type: ignore[arg-type]
    assert info.value.field == "duration"
    with pytest.raises(ValidationError) as info:
        run_with_history.wait_signal("w", name="go", timeout=duration)  # type: ignore[arg-type]
    assert info.value.field == "timeout"
    _assert_history_intact(ob, run_with_history.id)


@pytest.mark.parametrize("run_id", ["not-a-uuid", "", 42, "0192-short"])
def test_a_chosen_run_id_must_be_a_uuid(ob: Outbox, run_id: object) -> None:
    """docs/reference/client.md: ``start_run(run_id=...)`` takes a UUID or its text."""
    with pytest.raises(ValidationError) as info:
        ob.start_run("a", "1", run_id=run_id)  # type: ignore[arg-type]
    assert info.value.field == "run_id"
    assert ob.runs() == []
    chosen = uuid.uuid4()
    assert ob.start_run("a", "1", run_id=str(chosen)).id == chosen


def test_a_duplicate_run_id_is_a_validation_error(ob: Outbox) -> None:
    run_id = uuid.uuid4()
    ob.start_run("a", "1", {"first": True}, run_id=run_id)
    with pytest.raises(ValidationError, match="names a run started with another") as info:
        ob.start_run("a", "1", {"second": True}, run_id=run_id)
    assert info.value.field == "run_id"
    assert ob.run(run_id).inputs == {"first": True}


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda ob: ob.runs(limit="x"), "limit"),
        (lambda ob: ob.runs(limit=-1), "limit"),
        (lambda ob: ob.runs(limit=True), "limit"),
        (lambda ob: ob.effects(limit=-1), "limit"),
        (lambda ob: ob.effects(limit=2.5), "limit"),
        (lambda ob: ob.runs(status="bogus"), "status"),
        (lambda ob: ob.runs(agent="a\x00"), "agent"),
        (lambda ob: ob.effects(kind="k\udcff"), "kind"),
        (lambda ob: ob.start_run("a", "1", budget=True), "budget"),
        (lambda ob: ob.start_run("a", "1", budget=math.inf), "budget"),
        (lambda ob: ob.start_run("a", "1", budget=10**5000), "budget"),
        (lambda ob: ob.worker("a", "1", lambda run: None, lease_seconds=math.nan), "lease_seconds"),
        (lambda ob: ob.worker("a", "1", lambda run: None, lease_seconds=math.inf), "lease_seconds"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_client_arguments_are_typed(
    ob: Outbox, call: Callable[[Outbox], object], field: str
) -> None:
    with pytest.raises(ValidationError) as info:
        call(ob)
    assert info.value.field == field
    assert ob.runs() == []


@pytest.mark.parametrize(
    "amount", [math.inf, 10**5000, True, "3", 1e300], ids=["inf", "long", "bool", "str", "huge"]
)
def test_bad_spend_amounts_are_typed(ob: Outbox, amount: object) -> None:
    run = ob.start_run("a", "1", budget=10)
    with pytest.raises(ValidationError) as info:
        run.transaction("s", lambda tx: tx.spend(amount, "model call"))  # type: ignore[arg-type]
    assert info.value.field == "amount"
