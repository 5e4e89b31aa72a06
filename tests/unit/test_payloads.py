from __future__ import annotations

import math

import pytest

from outbox.errors import PayloadError, ValidationError
from outbox.models import Compensation
from outbox.payloads import content_hash, encode


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
