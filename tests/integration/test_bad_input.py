"""Bad input gets a typed error naming the field and value; nothing already committed is lost."""

from __future__ import annotations

import math
import uuid

import pytest

from outbox import (
    Outbox,
    OutboxError,
    PayloadError,
    RunNotFound,
    Settings,
    StepTransaction,
    ValidationError,
)


@pytest.fixture
def run_with_history(ob: Outbox):  # type: ignore[no-untyped-def]
    run = ob.start_run("invoice-reconciler", "2.3.1", {"month": "2026-10"})
    run.transaction(
        "first",
        lambda tx: (
            (tx.set_state({"cursor": 1}), tx.intend("email.send", {"n": 1}))[1].idempotency_key
        ),
    )
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
def test_bad_step_ids(ob: Outbox, run_with_history, step_id: object) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValidationError) as info:
        run_with_history.transaction(step_id, lambda tx: None)
    assert info.value.field == "step_id"
    with pytest.raises(ValidationError):
        run_with_history.call(step_id, lambda: 1)
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
def test_bad_payloads(ob: Outbox, run_with_history, payload: object, reason: str) -> None:  # type: ignore[no-untyped-def]
    def step(tx: StepTransaction) -> None:
        tx.intend("email.send", payload)

    with pytest.raises(PayloadError, match=reason) as info:
        run_with_history.transaction("second", step)
    assert info.value.field == "payload"
    _assert_history_intact(ob, run_with_history.id)


def test_bad_result_state_and_plan(ob: Outbox, run_with_history) -> None:  # type: ignore[no-untyped-def]
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


def test_default_size_limit_is_one_mebibyte(ob: Outbox) -> None:
    run = ob.start_run("a", "1")
    with pytest.raises(PayloadError, match="over the limit of 1048576 bytes"):
        run.transaction("s", lambda tx: tx.intend("email.send", {"body": "x" * (1024 * 1024)}))


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
