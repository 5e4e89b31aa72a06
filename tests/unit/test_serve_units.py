"""Pure parts of `outbox serve`: signature checks, JSON depth, redaction, settings."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from outbox.errors import ConfigurationError
from outbox.serve.console.present import REDACTED, clip, redact, redact_text
from outbox.serve.settings import Credentials, ServeSettings
from outbox.serve.webhooks import sign, too_deep, verify

SECRET = b"0123456789abcdef"


@pytest.mark.parametrize(
    ("timestamp", "signature"),
    [
        ("\u00b2", "sha256=" + "0" * 64),  # a digit to str.isdigit(), not to int()
        ("١٢٣", "sha256=" + "0" * 64),  # Arabic-Indic digits
        ("1" * 40, "sha256=" + "0" * 64),
        (None, "sha256=" + "0" * 64),
        ("now", "x"),
    ],
)
def test_verify_refuses_malformed_timestamps(timestamp: str | None, signature: str) -> None:
    assert verify(SECRET, timestamp, signature, "/p", b"", tolerance=60) is not None


@pytest.mark.parametrize("signature", ["sha256=é" + "0" * 63, "sha256=" + "Z" * 64, "md5=00", ""])
def test_verify_refuses_malformed_signatures(signature: str) -> None:
    stamp = str(int(time.time()))
    assert verify(SECRET, stamp, signature, "/p", b"{}", tolerance=60) is not None


def test_verify_accepts_a_good_signature() -> None:
    stamp = int(time.time())
    good = sign(SECRET, stamp, "/p", b"{}")
    assert verify(SECRET, str(stamp), good, "/p", b"{}", tolerance=60) is None
    assert verify(SECRET, str(stamp), good, "/q", b"{}", tolerance=60) == "bad signature"


def test_json_depth_is_measured_outside_strings() -> None:
    assert too_deep(b"[" * 65 + b"]" * 65)
    assert not too_deep(b"[" * 64 + b"]" * 64)
    assert not too_deep(json.dumps({"s": "[" * 1000}).encode())
    assert not too_deep(json.dumps({"s": '\\"[[[[' * 100}).encode())


def test_redaction_of_payloads() -> None:
    shown = redact(
        {
            "url": "https://user:pw@api.example/x?access_token=t1&page=2&api_key=k",
            "headers": {"Authorization": "Bearer abc", "X-Request": "ok"},
            "json": {"password": "p", "nested": [{"client_secret": "s", "n": 1}]},
            "note": "Bearer xyz",
        }
    )
    text = json.dumps(shown)
    for secret in ("pw", "t1", "abc", '"p"', '"s"', "xyz", "=k"):
        assert secret not in text, secret
    assert shown["headers"]["X-Request"] == "ok" and "page=2" in shown["url"]
    assert shown["json"]["nested"][0] == {"client_secret": REDACTED, "n": 1}


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("401 Unauthorized (Authorization: Bearer sk_live_51HxQ2eLkdjf8s7d)", "sk_live_51HxQ2e"),
        ("retried with ApiKey AbCdEf0123456789xyzQ", "AbCdEf0123456789"),
        ("okta said no to SSWS 00aBcDeFgHiJkLmNoPqRsT", "00aBcDeFgHiJ"),
        ("github: Token ghp_16C7e42F292c6912E7710c8", "ghp_16C7e42F"),
        ("Api-Key k3y-k3y-k3y-k3y and more", "k3y-k3y-k3y"),
        ("failed POST https://bob:hunter2@api.example/x?access_token=abc&page=2", "hunter2"),
        ("failed POST https://api.example/x?access_token=abc123456&page=2", "abc123456"),
        ('{"password": "hunter2", "user": "bob"}', "hunter2"),
        ("x-api-key=abcd1234 rejected", "abcd1234"),
        ("client_secret: s3cr3t-value", "s3cr3t-value"),
        ("jwt eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.sig", "eyJhbGciOiJIUzI1NiJ9"),
        ("Bearer xyz", "xyz"),
    ],
)
def test_redact_text_finds_credentials_anywhere(text: str, secret: str) -> None:
    shown = redact_text(text)
    assert secret not in shown and REDACTED in shown, shown


def test_redact_text_leaves_ordinary_text() -> None:
    for text in (
        "Token expired for user 7",
        "idempotency_key='invoice-77': already intended with a different payload",
        "connection refused to https://api.example/v1/charges?page=2",
        "2026-12-02T09:39:46+00:00",
        "sort_key: 7, key: order-7",
    ):
        assert redact_text(text) == text, text


def test_a_field_named_key_is_shown_and_a_clipped_secret_never_half_shown() -> None:
    assert redact({"key": "order-7", "sort_key": 1}) == {"key": "order-7", "sort_key": 1}
    assert redact({"signature": "abc", "X-Amz-Signature": "d"}) == {
        "signature": REDACTED,
        "X-Amz-Signature": REDACTED,
    }
    text = "x" * 130 + " Bearer sk_live_51HxQ2eLkdjf8s7d"
    assert "sk_l" not in clip(text, 140) and clip(text, 140).endswith("…")


@pytest.mark.parametrize(
    "field",
    [
        "tolerance",
        "header_timeout",
        "body_timeout",
        "idle_timeout",
        "counts_cache_seconds",
        "max_wait",
        "wait_poll",
    ],
)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_settings_refuse_non_finite_and_negative(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        ServeSettings(**{field: value})


def test_credentials_are_long_enough_and_read_from_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="at least 16"):
        Credentials(operator_token=b"short")
    token = tmp_path / "token"
    token.write_text("operator-token-0123456789\n")
    creds = Credentials.from_env({"OUTBOX_OPERATOR_TOKEN_FILE": str(token)})
    assert creds.is_operator("operator-token-0123456789") and not creds.is_operator("x")
    assert creds.may_scrape("operator-token-0123456789")
    with pytest.raises(ConfigurationError, match="cannot read"):
        Credentials.from_env({"OUTBOX_METRICS_TOKEN_FILE": str(tmp_path / "missing")})


def test_the_api_token_is_its_own_credential(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="api_token: must be at least 16"):
        Credentials(api_token=b"short")
    token = tmp_path / "api-token"
    token.write_text("api-token-0123456789abcdef\n")
    from_file = Credentials.from_env({}, api_token_file=token)
    from_env_file = Credentials.from_env({"OUTBOX_API_TOKEN_FILE": str(token)})
    from_env = Credentials.from_env(
        {"OUTBOX_API_TOKEN": "api-token-0123456789abcdef", "OUTBOX_OPERATOR_TOKEN": "o" * 20}
    )
    for creds in (from_file, from_env_file, from_env):
        assert creds.may_call_api("api-token-0123456789abcdef")
        assert not creds.may_call_api("api-token-0123456789abcdeX") and not creds.may_call_api(None)
    # Neither credential opens the other's door.
    assert not from_env.may_call_api("o" * 20) and not from_env.is_operator(
        "api-token-0123456789abcdef"
    )
    assert "api-token" not in repr(from_env)
    assert not Credentials().may_call_api("anything-at-all-0123")


class _Transport:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


class _Conn:
    def __init__(self) -> None:
        self.transport = _Transport()


def test_connections_are_capped_per_client_and_the_longest_waiting_makes_room() -> None:
    from outbox.serve.transport import _Connections

    state = _Connections(per_client=2, total=3)
    a, b, c, d, e = (_Conn() for _ in range(5))
    assert state.admit(a, "10.0.0.1") and state.admit(b, "10.0.0.1")  # type: ignore[arg-type]
    assert not state.admit(c, "10.0.0.1")  # type: ignore[arg-type]  # the client's cap
    assert state.admit(d, "10.0.0.2")  # type: ignore[arg-type]
    state.waiting.update({b: None, d: None})  # type: ignore[dict-item]  # b waits longest
    assert state.admit(e, "10.0.0.3")  # type: ignore[arg-type]  # full: b is closed for it
    assert b.transport.closed and not d.transport.closed and not a.transport.closed
    state.release("10.0.0.1")  # b's connection_lost
    assert state.by_client == {"10.0.0.1": 1, "10.0.0.2": 1, "10.0.0.3": 1}
    state.waiting.clear()  # every connection busy with a request: a new one is refused
    assert not state.admit(_Conn(), "10.0.0.4")  # type: ignore[arg-type]
