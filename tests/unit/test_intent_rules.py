"""The intent rules (``outbox.governance.intent_rules``) against the shared table of cases."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from outbox.errors import ValidationError
from outbox.governance import intent_rules
from outbox.governance.intent_rules import (
    CREDENTIALS_BY_REFERENCE,
    REASONS,
    check_identifier,
    check_payload,
    find_violation,
    identifier_violation,
)
from tests.intent_rule_cases import IDENTIFIER_CASES, PAYLOAD_CASES


@pytest.mark.parametrize(("payload", "expected"), PAYLOAD_CASES)
def test_payload_cases(payload: Any, expected: tuple[str, str] | None) -> None:
    found = find_violation(payload)
    assert (None if found is None else (found.code, found.field)) == expected


@pytest.mark.parametrize(("value", "expected"), IDENTIFIER_CASES)
def test_identifier_cases(value: str, expected: str | None) -> None:
    found = identifier_violation(value, "key")
    assert (None if found is None else found.code) == expected


def test_every_code_has_a_reason() -> None:
    codes = {expected[0] for _, expected in PAYLOAD_CASES if expected is not None}
    codes |= {code for _, code in IDENTIFIER_CASES if code is not None}
    assert codes <= set(REASONS)
    assert set(REASONS) - codes == set(), "every rule has at least one case"


def test_a_credential_refusal_names_the_field_and_says_where_credentials_go() -> None:
    with pytest.raises(ValidationError) as info:
        check_payload({"headers": {"X-Auth-Token": "s3cr3t-value"}})
    assert info.value.field == "payload.headers"
    assert info.value.value == "X-Auth-Token"
    assert CREDENTIALS_BY_REFERENCE in str(info.value)
    assert "credentials." in str(info.value) and "env" in str(info.value)


@pytest.mark.parametrize(
    "payload",
    [
        {"url": "https://alice:s3cr3t-value@example.com/x"},
        {"url": "https://example.com/x?access_token=s3cr3t-value&b=2"},
        {"url": "https://example.com/x?sig=s3cr3t-value\n"},
        {"headers": {"X-Forward": "Bearer s3cr3t-value-0123456789"}},
        {"headers": {"X-Forward": "Token s3cr3t-value-0123456789"}},
        {"url": "https://maps.example.com/geo?key=s3cr3t-value"},
        {"headers": {"X-Note": "s3cr3t-value\r\n"}},
    ],
)
def test_a_refusal_never_repeats_the_secret(payload: dict[str, Any]) -> None:
    with pytest.raises(ValidationError) as info:
        check_payload(payload)
    assert "s3cr3t-value" not in str(info.value)
    assert "s3cr3t-value" not in repr(info.value.value)


def test_check_identifier_raises_naming_the_field() -> None:
    assert check_identifier("fine", "ordering_key") == "fine"
    with pytest.raises(ValidationError) as info:
        check_identifier("a\r\nb", "ordering_key")
    assert info.value.field == "ordering_key"
    assert "\n" not in str(info.value), "shown escaped: an error cannot forge a log line"


def test_the_rules_are_data() -> None:
    # What the SQL port reads: patterns as text, name sets, prefixes, in a fixed order.
    assert [r.code for r in intent_rules.HEADER_NAME_RULES] == [
        "framing-header",
        "reserved-header",
        "credential-header",
    ]
    for rule in intent_rules.HEADER_NAME_RULES + intent_rules.QUERY_NAME_RULES:
        assert isinstance(rule.names, frozenset)
        assert all(name == name.lower() for name in rule.names)
    assert isinstance(intent_rules.CREDENTIAL_NAME_PATTERN, str)


def test_every_rule_is_documented_in_one_place() -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "reference" / "client.md").read_text()
    section = docs.split("## What an intent may contain", 1)[1].split("\n## ", 1)[0]
    for code in REASONS:
        assert f"`{code}`" in section, code
    for name in intent_rules.FRAMING_HEADERS | intent_rules.CREDENTIAL_QUERY_NAMES:
        assert name in section.lower(), name
