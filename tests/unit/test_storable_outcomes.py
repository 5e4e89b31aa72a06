"""Whatever a deliverer returns is made storable before it reaches SQL (issue 11, C1).

No I/O here: the real PostgreSQL side (what it refuses, the batch that must
not wedge) is in tests/integration/test_poison_outcomes.py and
tests/chaos/test_poison_outcomes.py.
"""

from __future__ import annotations

import asyncio
import json
import math
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deliverers.python_call import PythonCallConfig, PythonCallDeliverer
from outbox.delivery import Deliverer, Delivery, Failed, Outcome, Retry, RetryableError, Succeeded
from outbox.delivery.attempt import MAX_DELAY_SECONDS, RESULT_LIMIT, decide, perform_attempt
from outbox.delivery.recording import is_transient, substitute
from outbox.delivery.storable import (
    MAX_DEPTH,
    MAX_DETAIL_BYTES,
    MAX_ERROR_BYTES,
    storable_json,
    storable_text,
)
from outbox.errors import DatabaseError, ValidationError
from outbox.models import AttemptOutcome, EffectStatus
from outbox.retry import RetryPolicy
from outbox.storage.async_store import ClaimedEffect, Completion

POLICY = RetryPolicy()


def claimed(kind: str = "python.call", payload: Any = None) -> ClaimedEffect:
    now = datetime.now(UTC)
    return ClaimedEffect(
        id=uuid.uuid4(),
        run_id=uuid.uuid4(),
        kind=kind,
        payload=payload,
        idempotency_key="k" * 64,
        attempt=1,
        max_attempts=None,
        schema_version=1,
        ordering_key=None,
        created_at=now,
        attempt_started_at=now,
        lease_owner="me",
    )


def attempt(deliverer: Deliverer, payload: Any = None) -> Completion:
    completion, _ = asyncio.run(
        perform_attempt(
            deliverer,
            claimed(deliverer.kind, payload),
            policy=POLICY,
            default_max_attempts=10,
            schema_retry_seconds=1.0,
        )
    )
    return completion


def what_postgresql_receives(completion: Completion) -> dict[str, Any]:
    """Parse the row as the statement's JSON parameter carries it, and check what jsonb refuses."""
    text = completion.as_json()
    assert "\\u0000" not in text, "jsonb refuses \\u0000 and text columns refuse NUL"
    text.encode("utf-8")  # a lone surrogate cannot be sent at all
    row = json.loads(text)  # strict JSON: no NaN or Infinity (json.loads would accept them,
    assert "NaN" not in text and "Infinity" not in text  # so look at the text too)
    return dict(row)


def python_call(function: str) -> PythonCallDeliverer:
    return PythonCallDeliverer("python.fn", PythonCallConfig(function=function))


# -- python.call: error messages with NUL, results with NaN -------------------------------


def test_a_python_call_error_message_with_a_nul_is_recorded_escaped() -> None:
    completion = attempt(python_call("tests.fixtures_callables:raises_nul"))
    row = what_postgresql_receives(completion)
    assert row["status"] == "pending" and row["outcome"] == "retry"
    assert row["error"] == "ValueError: bad\\x00news from \\udcff the sink"
    assert row["detail"]["error"] == row["error"]


def test_a_permanent_error_with_a_nul_is_a_failure_recorded_escaped() -> None:
    completion = attempt(python_call("tests.fixtures_callables:rejects_nul"))
    row = what_postgresql_receives(completion)
    assert (row["status"], row["error"]) == ("failed", "account\\x00closed")


def test_retry_after_infinity_is_refused_where_it_is_made() -> None:
    with pytest.raises(ValidationError, match=r"Retry\.after=inf: must be a finite"):
        Retry("busy", after=math.inf)
    with pytest.raises(ValidationError, match=r"Retry\.after=nan"):
        Retry("busy", after=math.nan)
    with pytest.raises(ValidationError, match=r"Retry\.after=-1"):
        Retry("busy", after=-1)
    with pytest.raises(ValidationError, match=r"retry_after=inf"):
        RetryableError("busy", retry_after=math.inf)
    with pytest.raises(ValidationError, match=r"retry_after=10000"):
        RetryableError("busy", retry_after=10**400)
    assert Retry("busy", after=2).after == 2.0
    assert RetryableError("busy", retry_after=None).retry_after is None


def test_a_deliverer_raising_retryable_error_with_an_infinite_delay_is_retried_normally() -> None:
    """The refusal surfaces as the attempt's reason; the batch's statement never sees inf."""
    completion = attempt(python_call("tests.fixtures_callables:retry_forever"))
    row = what_postgresql_receives(completion)
    assert row["status"] == "pending"
    assert "retry_after=inf: must be a finite number of seconds" in row["error"]
    assert 0 <= row["delay"] <= POLICY.base_seconds  # the first backoff's ceiling


def test_a_deliverer_returning_retry_after_infinity_is_retried_normally() -> None:
    class Infinite(Deliverer):
        def deliver(self, delivery: Delivery) -> Outcome:
            return Retry("later", after=math.inf)

    row = what_postgresql_receives(attempt(Infinite("inf.kind")))
    assert row["status"] == "pending" and "Retry.after=inf" in row["error"]


def test_a_result_with_nan_and_nul_is_stored_with_both_escaped() -> None:
    completion = attempt(python_call("tests.fixtures_callables:odd_result"))
    row = what_postgresql_receives(completion)
    assert row["status"] == "succeeded"
    assert row["result"] == {
        "ratio": "nan",
        "big": "inf",
        "text": "a\\x00b",
        "raw": "\\xff\\xfe",
        "nested": {"1": ["x\\x00"]},
    }


def test_a_failure_whose_detail_holds_anything_is_storable() -> None:
    class Odd(Deliverer):
        def deliver(self, delivery: Delivery) -> Outcome:
            return Failed("HTTP 400\x00", detail={"body": "\x00" * 5, "n": math.inf, 1: object()})

    row = what_postgresql_receives(attempt(Odd("odd.kind")))
    assert row["error"] == "HTTP 400\\x00"
    assert row["detail"]["body"] == "\\x00" * 5 and row["detail"]["n"] == "inf"
    assert row["detail"]["1"].startswith("<object object")


def test_an_exception_whose_str_raises_is_still_recorded() -> None:
    class Broken(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    class Raises(Deliverer):
        def deliver(self, delivery: Delivery) -> Outcome:
            raise Broken

    row = what_postgresql_receives(attempt(Raises("raises.kind")))
    assert row["status"] == "pending" and row["error"] == "Broken: <unprintable Broken>"


def test_sizes_are_capped() -> None:
    class Huge(Deliverer):
        def deliver(self, delivery: Delivery) -> Outcome:
            if delivery.payload == "ok":
                return Succeeded({"blob": "x" * (2 * RESULT_LIMIT)})
            return Failed("e" * 100_000, detail={"body": "y" * 100_000})

    ok = what_postgresql_receives(attempt(Huge("huge.kind"), "ok"))
    assert "over the limit" in ok["result"]["unrecordable"]
    assert len(json.dumps(ok["result"])) < RESULT_LIMIT
    failed = attempt(Huge("huge.kind"), "fail")
    row = what_postgresql_receives(failed)
    assert len(row["error"].encode()) <= MAX_ERROR_BYTES and "cut to" in row["error"]
    assert failed.detail_json is not None and len(failed.detail_json.encode()) <= MAX_DETAIL_BYTES


# -- decide: delays stay within what PostgreSQL's interval arithmetic takes -------------


def test_a_huge_finite_delay_is_bounded() -> None:
    decision = decide(Retry("later", after=1e300), attempt=1, max_attempts=5, policy=POLICY)
    assert decision.delay == MAX_DELAY_SECONDS
    wide = RetryPolicy(base_seconds=1e300, cap_seconds=math.inf)
    assert decide(Retry("x"), attempt=50, max_attempts=99, policy=wide).delay <= MAX_DELAY_SECONDS


# -- storable_text / storable_json --------------------------------------------------------


def test_storable_text_escapes_and_cuts_on_a_character_boundary() -> None:
    assert storable_text("plain") == "plain"
    assert storable_text("a\x00b") == "a\\x00b"
    assert storable_text("\ud800") == "\\ud800"
    assert storable_text(b"\x00\xff") == "\\x00\\xff"
    cut = storable_text("é" * 5000, max_bytes=101)
    assert len(cut.encode()) <= 101 and cut.startswith("é") and "10000 bytes, cut to 101" in cut


def test_storable_json_keeps_well_formed_values_as_they_are() -> None:
    value = {"a": [1, 2.5, None, True], "b": "ünï", "c": {"d": "\\u0000 as text"}}
    assert json.loads(storable_json(value, max_bytes=10_000) or "") == value


def test_storable_json_cuts_deep_nesting_and_cycles() -> None:
    deep: Any = "bottom"
    for _ in range(5000):
        deep = [deep]
    text = storable_json(deep, max_bytes=1_000_000) or ""
    assert f"nested deeper than {MAX_DEPTH} levels" in text
    cycle: dict[str, Any] = {}
    cycle["self"] = cycle
    assert "nested deeper" in (storable_json(cycle, max_bytes=1_000_000) or "")


def test_storable_json_turns_huge_integers_into_a_note() -> None:
    assert json.loads(storable_json({"n": 10**5000}, max_bytes=10_000) or "") == {
        "n": "<integer of 16610 bits>"
    }


json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text()
    | st.binary(max_size=20)
    | st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(max_size=5) | st.integers(), children, max_size=4)
    ),
    max_leaves=20,
)


@given(json_like)
def test_storable_json_always_gives_text_jsonb_accepts(value: Any) -> None:
    text = storable_json(value, max_bytes=4096)
    if value is None:
        assert text is None
        return
    assert text is not None
    assert "\\u0000" not in text.replace("\\\\", "")
    assert len(text.encode("utf-8")) <= 4096
    json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in {text!r}"))


# -- the writer's reading of errors and its minimal record ---------------------------------


def test_transient_errors_are_retried_and_the_rest_isolated() -> None:
    assert is_transient(DatabaseError("lost", transient=True))
    assert is_transient(TimeoutError())
    assert not is_transient(DatabaseError("permission denied", sqlstate="42501"))
    assert not is_transient(ValueError("Out of range float values are not JSON compliant"))


def test_a_poison_outcome_is_substituted_by_unknown_unless_the_sink_refused_it() -> None:
    error = DatabaseError("permission denied for table outbox_budget_ledger", sqlstate="42501")
    base = Completion(uuid.uuid4(), 3, EffectStatus.SUCCEEDED, AttemptOutcome.SUCCEEDED)
    minimal = substitute(base, error)
    assert minimal is not None
    assert (minimal.status, minimal.outcome, minimal.attempt) == ("unknown", "unknown", 3)
    assert minimal.result_json is None
    assert "SQLSTATE 42501" in (minimal.error or "") and "reported succeeded" in (
        minimal.error or ""
    )
    refused = Completion(uuid.uuid4(), 1, EffectStatus.FAILED, AttemptOutcome.FAILED, error="x")
    assert (substitute(refused, error) or base).status == "failed"
    retry = Completion(uuid.uuid4(), 1, EffectStatus.PENDING, AttemptOutcome.RETRY)
    assert (substitute(retry, error) or base).status == "unknown", "never resent blindly"
    released = Completion(uuid.uuid4(), 1, EffectStatus.PENDING, AttemptOutcome.RELEASED)
    assert substitute(released, error) is None, "no call was made: nothing to substitute"
