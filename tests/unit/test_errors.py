"""Errors must survive whatever value they are about."""

from __future__ import annotations

import pytest

from outbox.errors import PayloadError, ValidationError


def _nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "value", [_nested(5000), 10**5000, {"n": 10**5000}], ids=["deep", "long-int", "dict"]
)
def test_an_error_about_an_unprintable_value_still_has_a_message(value: object) -> None:
    # repr() of these raises RecursionError / ValueError: the refusal itself used to crash.
    error = PayloadError("payload", value, "refused")
    assert str(error).startswith("payload=")
    assert error.value is value


def test_long_values_are_shortened() -> None:
    assert len(str(ValidationError("f", "x" * 10_000, "too long"))) < 120
