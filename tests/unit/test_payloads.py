from __future__ import annotations

import math

import pytest

from outbox.errors import PayloadError, ValidationError
from outbox.models import Compensation
from outbox.payloads import content_hash, decode, encode, encode_sized


def test_canonical_encoding_sorts_keys_and_hashes_equal_payloads_equally() -> None:
    a = encode({"b": 1, "a": [1, 2]}, field="payload")
    b = encode({"a": [1, 2], "b": 1}, field="payload")
    assert a == b == '{"a":[1,2],"b":1}'
    assert content_hash(a) == content_hash(b)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, {"x": [math.nan]}])
def test_nan_and_infinity_are_refused_naming_the_field(bad: object) -> None:
    with pytest.raises(PayloadError) as info:
        encode(bad, field="payload")
    assert info.value.field == "payload"
    assert "payload=" in str(info.value)


def test_non_serialisable_value_is_refused() -> None:
    with pytest.raises(PayloadError, match=r"result=.*not JSON-serialisable"):
        encode({"when": object()}, field="result")


def test_size_limit_is_enforced_and_configurable() -> None:
    big = {"blob": "x" * 2000}
    encode(big, field="payload", max_bytes=4096)
    with pytest.raises(PayloadError, match="over the limit of 1000 bytes"):
        encode(big, field="payload", max_bytes=1000)


def test_nul_character_is_refused() -> None:
    with pytest.raises(PayloadError, match="NUL"):
        encode({"s": "a\x00b"}, field="state")


def test_pydantic_models_are_encoded_as_json() -> None:
    assert encode(Compensation(kind="k", payload={"a": 1}), field="x") == (
        '{"kind":"k","payload":{"a":1}}'
    )


def test_payload_error_is_a_validation_error_and_a_value_error() -> None:
    with pytest.raises(ValidationError):
        encode(math.nan, field="payload")
    with pytest.raises(ValueError):
        encode(math.nan, field="payload")


def _nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


def test_a_literal_backslash_u0000_is_text_not_a_nul() -> None:
    # L5: the six characters \u0000 were refused as a NUL.
    text = encode({"s": "C:\\u0000\\dir", "t": "\\\\u0000"}, field="payload")
    assert decode(text) == {"s": "C:\\u0000\\dir", "t": "\\\\u0000"}


@pytest.mark.parametrize("value", ["\x00", "a\\\x00", "\\\\\x00", {"k\x00": 1}])
def test_a_nul_after_backslashes_is_still_a_nul(value: object) -> None:
    with pytest.raises(PayloadError, match="NUL"):
        encode(value, field="payload")


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ({"s": "\ud800"}, "lone surrogate"),
        ({"\udfff": 1}, "lone surrogate"),
        (_nested(5000), "nested too deeply"),
        ({"n": 10**4999}, "integer too long"),
    ],
    ids=["surrogate", "surrogate-key", "deep", "long-int"],
)
def test_unstorable_values_are_typed_errors_naming_the_field(value: object, reason: str) -> None:
    # L2: these escaped as UnicodeEncodeError, RecursionError and a bare ValueError.
    with pytest.raises(PayloadError, match=reason) as info:
        encode(value, field="payload")
    assert info.value.field == "payload"


def test_encode_sized_counts_utf8_bytes() -> None:
    text, size = encode_sized({"s": "ü"}, field="payload")
    assert size == len(text.encode()) == len(text) + 1
