"""http.request without a network: Retry-After parsing, the payload model, credentials."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path

import pydantic
import pytest
from hypothesis import given
from hypothesis import strategies as st

from deliverers.http import (
    MAX_RETRY_AFTER,
    Credential,
    HttpDeliverer,
    HttpRequest,
    parse_retry_after,
)
from outbox.errors import ConfigurationError

NOW = datetime(2015, 10, 21, 7, 0, 0, tzinfo=UTC)
URL = "https://api.example.com/v1/charges"

# -- parse_retry_after ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "seconds"),
    [("120", 120.0), ("0", 0.0), ("  30 ", 30.0), ("007", 7.0), ("86400", 86400.0)],
)
def test_delta_seconds(header: str, seconds: float) -> None:
    assert parse_retry_after(header) == seconds


@pytest.mark.parametrize("header", [None, "", "   "])
def test_absent_or_blank_is_none(header: str | None) -> None:
    assert parse_retry_after(header) is None


@pytest.mark.parametrize(
    "header",
    [
        "soon",
        "1.5",  # delta-seconds is an integer
        "-5",
        "+5",
        "12abc",
        "1e3",
        "²",  # str.isdigit() is true, float() refuses it: used to raise ValueError
        "١٢",  # Arabic-Indic digits: not RFC 9110 DIGITs
        "Mon, 32 Jan 2020 00:00:00 GMT",  # day out of range
        "Wed, 21 Foo 2015 07:28:00 GMT",
    ],
)
def test_garbage_is_none(header: str) -> None:
    assert parse_retry_after(header, now=NOW) is None


@pytest.mark.parametrize("header", ["86401", "999999999999999999999999"])
def test_delta_seconds_are_capped_at_a_day(header: str) -> None:
    assert parse_retry_after(header) == MAX_RETRY_AFTER == 24 * 3600.0


@pytest.mark.parametrize(
    "header",
    [
        "Wed, 21 Oct 2015 07:28:00 GMT",  # IMF-fixdate
        "Wed, 21 Oct 2015 09:28:00 +0200",  # numeric zone
        "Wed, 21 Oct 2015 07:28:00 -0000",  # no zone information: taken as UTC
        "Wednesday, 21-Oct-15 07:28:00 GMT",  # obsolete RFC 850 form
        "Wed Oct 21 07:28:00 2015",  # obsolete asctime form
    ],
)
def test_http_date_in_the_future_is_seconds_from_now(header: str) -> None:
    assert parse_retry_after(header, now=NOW) == 28 * 60.0


def test_http_date_in_the_past_is_zero() -> None:
    assert parse_retry_after("Wed, 21 Oct 2015 06:00:00 GMT", now=NOW) == 0.0


def test_http_date_more_than_a_day_ahead_is_capped() -> None:
    assert parse_retry_after("Fri, 23 Oct 2015 07:00:00 GMT", now=NOW) == MAX_RETRY_AFTER


def test_http_date_is_measured_from_the_real_clock_by_default() -> None:
    in_an_hour = format_datetime(datetime.now(UTC) + timedelta(hours=1), usegmt=True)
    seconds = parse_retry_after(in_an_hour)
    assert seconds is not None and 3500.0 < seconds <= 3600.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0


@given(st.text(max_size=60))
def test_any_header_value_parses_to_none_or_a_bounded_delay(header: str) -> None:
    seconds = parse_retry_after(header, now=NOW)
    assert seconds is None or 0.0 <= seconds <= MAX_RETRY_AFTER


# -- HttpRequest -------------------------------------------------------------------------


def test_minimal_request_gets_defaults() -> None:
    request = HttpRequest.model_validate({"url": URL})
    assert request.method == "POST"
    assert request.headers == {}
    assert request.json_body is None
    assert request.timeout == 10.0
    assert request.credential is None


def test_json_alias_and_field_name_both_populate_the_body() -> None:
    by_alias = HttpRequest.model_validate({"url": URL, "json": {"amount": 5}})
    by_name = HttpRequest.model_validate({"url": URL, "json_body": {"amount": 5}})
    assert by_alias.json_body == by_name.json_body == {"amount": 5}
    assert by_alias.model_dump(by_alias=True)["json"] == {"amount": 5}


def test_http_deliverer_parses_payloads_with_the_model() -> None:
    deliverer = HttpDeliverer("http.request")
    parsed = deliverer.parse_payload({"url": URL, "method": "PUT", "json": [1, 2]})
    assert isinstance(parsed, HttpRequest)
    assert (parsed.method, parsed.json_body) == ("PUT", [1, 2])


@pytest.mark.parametrize(
    "name",
    ["Authorization", "authorization", "Cookie", "X-Api-Key", "X-API-KEY", "Proxy-Authorization"],
)
def test_secret_headers_are_refused_pointing_at_credentials(name: str) -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        HttpRequest.model_validate({"url": URL, "headers": {name: "secret-value"}})
    [error] = info.value.errors()
    assert error["loc"] == ("headers",)
    assert f"header {name!r} carries a secret" in error["msg"]
    assert "name a configured credential instead" in error["msg"]
    assert "secret-value" not in error["msg"]  # what the daemon records: loc and msg only


@pytest.mark.parametrize("name", ["Idempotency-Key", "idempotency-key", "Host", "Content-Length"])
def test_reserved_headers_are_refused(name: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=f"header '{name}' is set by the deliverer"):
        HttpRequest.model_validate({"url": URL, "headers": {name: "x"}})


def test_ordinary_headers_are_kept() -> None:
    headers = {"Content-Type": "application/json", "X-Trace": "abc"}
    assert HttpRequest.model_validate({"url": URL, "headers": headers}).headers == headers


@pytest.mark.parametrize(
    "url",
    [
        "ftp://example.com/file",
        "file:///etc/passwd",
        "javascript:alert(1)",
        "example.com/path",
        "/relative/path",
        "http://",
        "https:///no-host",
    ],
)
def test_non_http_urls_are_refused(url: str) -> None:
    with pytest.raises(
        pydantic.ValidationError, match="must be an absolute http:// or https:// URL"
    ):
        HttpRequest.model_validate({"url": url})


@pytest.mark.parametrize(
    "url", ["http://example.com", "https://example.com:8443/a?b=c", "HTTPS://EXAMPLE.COM/x"]
)
def test_http_and_https_urls_are_accepted(url: str) -> None:
    assert HttpRequest.model_validate({"url": url}).url == url


@pytest.mark.parametrize(
    "payload",
    [
        {"url": ""},
        {"url": URL, "method": "TRACE"},
        {"url": URL, "timeout": 0},
        {"url": URL, "timeout": 301},
        {"url": URL, "body": "x"},  # unknown field
        {},
    ],
)
def test_other_invalid_payloads_are_refused(payload: dict[str, object]) -> None:
    with pytest.raises(pydantic.ValidationError):
        HttpRequest.model_validate(payload)


# -- Credential --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields", [{}, {"env": "TOKEN", "file": "/run/secrets/token"}, {"prefix": "Bearer "}]
)
def test_credential_needs_exactly_one_source(fields: dict[str, str]) -> None:
    with pytest.raises(pydantic.ValidationError, match="set exactly one of env or file"):
        Credential.model_validate(fields)


def test_credential_from_env_applies_the_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_TEST_TOKEN", "tok-1")
    credential = Credential(env="OUTBOX_TEST_TOKEN", prefix="Bearer ")
    assert credential.header == "Authorization"
    assert credential.value() == "Bearer tok-1"


def test_credential_is_read_at_each_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rotated secret is picked up without rebuilding the deliverer."""
    monkeypatch.setenv("OUTBOX_TEST_TOKEN", "old")
    credential = Credential(header="X-Api-Key", env="OUTBOX_TEST_TOKEN")
    assert credential.value() == "old"
    monkeypatch.setenv("OUTBOX_TEST_TOKEN", "new")
    assert credential.value() == "new"


def test_missing_env_is_a_configuration_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OUTBOX_TEST_ABSENT", raising=False)
    credential = Credential(env="OUTBOX_TEST_ABSENT")
    with pytest.raises(ConfigurationError, match="credential env 'OUTBOX_TEST_ABSENT' is not set"):
        credential.value()


def test_credential_from_file_is_stripped_prefixed_and_reread(tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text("s3cret\n")
    credential = Credential(file=secret, prefix="Token ")
    assert credential.value() == "Token s3cret"
    secret.write_text("rotated")
    assert credential.value() == "Token rotated"


def test_missing_credential_file_raises_oserror(tmp_path: Path) -> None:
    """The deliverer turns this OSError into a Retry (the file may appear)."""
    credential = Credential(file=tmp_path / "absent")
    with pytest.raises(FileNotFoundError):
        credential.value()


def test_credential_is_frozen_and_strict() -> None:
    credential = Credential(env="X")
    with pytest.raises(pydantic.ValidationError):
        credential.env = "Y"  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError, match="value"):
        Credential.model_validate({"env": "X", "value": "inline-secret"})


def test_credentials_in_the_http_config_are_validated_naming_the_kind() -> None:
    good = HttpDeliverer.from_config(
        "billing.charge", {"credentials": {"billing": {"env": "BILLING", "prefix": "Bearer "}}}
    )
    assert isinstance(good, HttpDeliverer)
    assert good.config.credentials["billing"] == Credential(env="BILLING", prefix="Bearer ")
    with pytest.raises(
        ConfigurationError, match=r"deliverer 'billing.charge': credentials\.billing"
    ):
        HttpDeliverer.from_config("billing.charge", {"credentials": {"billing": {}}})
