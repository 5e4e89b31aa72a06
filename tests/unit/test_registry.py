"""The deliverer registry (entry points + TOML config) and the python.call deliverer."""

from __future__ import annotations

import asyncio
import inspect
import threading
import uuid
from pathlib import Path
from typing import Any

import pydantic
import pytest

from deliverers.http import Credential, HttpDeliverer
from deliverers.python_call import CallPayload, PythonCallDeliverer
from deliverers.registry import available_types, build_registry, load_config, parse_config
from deliverers.smtp import SmtpDeliverer
from outbox.delivery import (
    Deliverer,
    Delivery,
    Failed,
    Outcome,
    PermanentError,
    RetryableError,
    Succeeded,
)
from outbox.delivery.config import DeliverersConfig
from outbox.errors import ConfigurationError
from tests import fixtures_callables

SHIPPED = {
    "http.request": HttpDeliverer,
    "python.call": PythonCallDeliverer,
    "smtp.send": SmtpDeliverer,
}

CONFIG = """
[kinds."email.send"]
type = "smtp.send"
host = "smtp.internal"
port = 2525
max_attempts = 3

[kinds."ledger.post"]
type = "python.call"
function = "tests.fixtures_callables:echo"
idempotent = true

[kinds."http.request"]            # type defaults to the kind's name
allow_private = ["127.0.0.1"]
concurrency = 4
[kinds."http.request".credentials.billing]
env = "BILLING_TOKEN"
prefix = "Bearer "
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "deliverers.toml"
    path.write_text(text)
    return path


def kinds(**tables: dict[str, Any]) -> DeliverersConfig:
    """A config of these ``[kinds.*]`` tables, validated as a file's would be."""
    return parse_config({"kinds": tables})


# -- available_types / default registry --------------------------------------------------


def test_installed_types_include_the_shipped_deliverers() -> None:
    types = available_types()
    for name, cls in SHIPPED.items():
        assert types[name] is cls
    assert all(issubclass(cls, Deliverer) for cls in types.values())


@pytest.mark.parametrize("raw", [None, {}, {"kinds": {}}])
def test_default_registry_serves_each_type_under_its_own_name(
    raw: dict[str, Any] | None,
) -> None:
    registry = build_registry(None if raw is None else parse_config(raw))
    assert set(registry) == {n for n, c in available_types().items() if c.default_registered}
    assert "testing.record" in available_types() and "testing.record" not in registry
    for name, cls in SHIPPED.items():
        deliverer = registry[name]
        assert type(deliverer) is cls
        assert deliverer.kind == name
        assert deliverer.max_attempts == 10
    assert registry["http.request"].idempotent is True
    assert registry["smtp.send"].idempotent is False
    assert registry["python.call"].idempotent is False


# -- a config file -----------------------------------------------------------------------


def test_config_maps_alias_kinds_to_types_with_their_settings(tmp_path: Path) -> None:
    registry = build_registry(load_config(write(tmp_path, CONFIG)))

    assert set(registry) == {"email.send", "ledger.post", "http.request"}  # only what is listed
    email = registry["email.send"]
    assert isinstance(email, SmtpDeliverer)
    assert email.kind == "email.send"
    assert (email.config.host, email.config.port) == ("smtp.internal", 2525)
    assert email.max_attempts == 3
    assert email.idempotent is False

    ledger = registry["ledger.post"]
    assert isinstance(ledger, PythonCallDeliverer)
    assert ledger.idempotent is True  # declared in the config: the function dedups on the key

    http = registry["http.request"]
    assert isinstance(http, HttpDeliverer)
    assert http.concurrency == 4
    assert http.config.allow_private == ["127.0.0.1"]
    assert http.config.credentials == {"billing": Credential(env="BILLING_TOKEN", prefix="Bearer ")}


@pytest.mark.parametrize("text", ["", "[kinds]\n", "# nothing yet\n"])
def test_a_config_without_kinds_counts_as_no_config(tmp_path: Path, text: str) -> None:
    """docs/reference/deliverers-config.md: every installed type then serves its own kind.

    Except a stand-in (``testing.record``, ``default_registered`` false): it is
    served only where a config names it.
    """
    registry = build_registry(load_config(write(tmp_path, text)))
    assert set(registry) == {n for n, c in available_types().items() if c.default_registered}


def test_the_same_type_can_serve_several_kinds() -> None:
    registry = build_registry(
        kinds(
            **{
                "email.alerts": {"type": "smtp.send", "host": "alerts.internal"},
                "email.billing": {"type": "smtp.send", "host": "billing.internal"},
            }
        )
    )
    hosts = {}
    for kind, d in registry.items():
        assert isinstance(d, SmtpDeliverer)
        hosts[kind] = d.config.host
    assert hosts == {"email.alerts": "alerts.internal", "email.billing": "billing.internal"}


def test_unknown_type_names_the_kind_and_the_installed_types() -> None:
    with pytest.raises(ConfigurationError) as info:
        build_registry(kinds(**{"sms.send": {"type": "twilio.sms"}}))
    message = str(info.value)
    assert message.startswith("kinds.sms.send.type='twilio.sms': no such deliverer type")
    for name in SHIPPED:
        assert repr(name) in message


def test_a_kind_without_type_must_be_an_installed_type_name() -> None:
    with pytest.raises(ConfigurationError, match=r"kinds\.fax\.send\.type='fax\.send'"):
        build_registry(kinds(**{"fax.send": {"max_attempts": 2}}))


@pytest.mark.parametrize("bad_type", [["smtp.send"], {"name": "smtp.send"}, 3])
def test_a_type_that_is_not_a_string_is_a_configuration_error(bad_type: object) -> None:
    """A list used to reach `in dict` and raise TypeError (unhashable) instead."""
    with pytest.raises(ConfigurationError, match=r"kinds\.email\.send\.type="):
        build_registry(kinds(**{"email.send": {"type": bad_type}}))


@pytest.mark.parametrize(
    ("table", "field"),
    [
        ({"type": "smtp.send", "max_attempts": 0}, "max_attempts=0"),
        ({"type": "smtp.send", "max_attempts": 1001}, "max_attempts=1001"),
        ({"type": "smtp.send", "colour": "red"}, "colour"),
        ({"type": "smtp.send", "port": "not-a-port"}, "port='not-a-port'"),
        ({"type": "smtp.send", "concurrency": 0}, "concurrency=0"),
        ({"type": "http.request", "read_limit_bytes": -1}, "read_limit_bytes=-1"),
    ],
)
def test_a_bad_field_names_the_kind_and_the_field(table: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        build_registry(kinds(**{"email.send": table}))
    assert str(info.value).startswith(f"deliverer 'email.send': {field}: ")


def test_a_bad_field_in_a_file_is_reported_the_same_way(tmp_path: Path) -> None:
    path = write(tmp_path, '[kinds."email.send"]\ntype = "smtp.send"\nmax_attempts = 0\n')
    with pytest.raises(ConfigurationError, match=r"deliverer 'email.send': max_attempts=0: "):
        build_registry(load_config(path))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"kinds": ["http.request"]}, "config 'kinds' must be a table of kinds"),
        ({"kinds": {"http.request": "yes"}}, "kinds.http.request must be a table"),
    ],
)
def test_malformed_kinds_tables_are_configuration_errors(
    config: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message.replace(".", r"\.")):
        parse_config(config)


# -- only= -------------------------------------------------------------------------------


def test_only_keeps_the_named_default_kinds() -> None:
    registry = build_registry(only=["smtp.send", "http.request"])
    assert set(registry) == {"smtp.send", "http.request"}


def test_only_filters_configured_kinds(tmp_path: Path) -> None:
    registry = build_registry(load_config(write(tmp_path, CONFIG)), only=["ledger.post"])
    assert list(registry) == ["ledger.post"]


def test_only_with_a_kind_that_is_not_configured_names_it(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, CONFIG))
    with pytest.raises(ConfigurationError) as info:
        build_registry(config, only=["email.send", "sms.send", "fax.send"])
    assert str(info.value) == "kinds=['fax.send', 'sms.send']: not configured here"


def test_only_with_a_default_type_missing_from_a_config_is_refused(tmp_path: Path) -> None:
    """With a config, an installed type that the file does not list is not served."""
    with pytest.raises(ConfigurationError, match=r"kinds=\['smtp.send'\]: not configured here"):
        build_registry(load_config(write(tmp_path, CONFIG)), only=["smtp.send"])


@pytest.mark.parametrize("only", [None, []])
def test_empty_only_means_no_filter(only: list[str] | None) -> None:
    """The CLI passes `list(kinds) or None`; an empty list keeps every kind too."""
    assert set(build_registry(only=only)) == set(build_registry())


# -- load_config -------------------------------------------------------------------------


def test_load_config_reads_toml(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, CONFIG))
    email = config.kinds["email.send"]
    assert email.type == "smtp.send"
    assert email.settings.model_dump(exclude_defaults=True) == {
        "type": "smtp.send",
        "host": "smtp.internal",
        "port": 2525,
        "max_attempts": 3,
    }


def test_missing_config_file_is_a_configuration_error(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    with pytest.raises(ConfigurationError) as info:
        load_config(path)
    assert str(info.value) == f"config={str(path)!r}: No such file or directory"


def test_unreadable_config_path_is_a_configuration_error(tmp_path: Path) -> None:
    """A directory cannot be read as a file (chmod is no test here: root reads anything)."""
    with pytest.raises(ConfigurationError, match="Is a directory"):
        load_config(tmp_path)


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ('[kinds."email.send"\ntype = "smtp.send"\n', "(at line 1, column 20)"),
        ("kinds = [1, 2\n", "(at end of document)"),
        ("a = 1\na = 2\n", "(at line 2, column 6)"),
        ("= 3\n", "(at line 1, column 1)"),
    ],
)
def test_invalid_toml_is_a_configuration_error_naming_the_file_and_place(
    tmp_path: Path, text: str, where: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigurationError) as info:
        load_config(path)
    assert str(info.value).startswith(f"config={str(path)!r}: ")
    assert str(info.value).endswith(where)


def test_non_utf8_config_is_a_configuration_error(tmp_path: Path) -> None:
    """tomllib lets UnicodeDecodeError escape; it used to reach the user as a traceback."""
    path = tmp_path / "latin1.toml"
    path.write_bytes('[kinds."email.send"]\ntype = "smtp.send"\nhost = "café"\n'.encode("latin-1"))
    with pytest.raises(ConfigurationError, match="not UTF-8"):
        load_config(path)


# -- python.call -------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _clear_calls() -> None:
    fixtures_callables.CALLS.clear()


def delivery(deliverer: Deliverer, payload: Any, key: str = "key-1") -> Delivery:
    """A Delivery as the daemon builds it: the payload parsed by the deliverer first."""
    return Delivery(
        effect_id=uuid.uuid4(),
        run_id=uuid.uuid4(),
        kind=deliverer.kind,
        payload=deliverer.parse_payload(payload),
        idempotency_key=key,
        attempt=1,
    )


def call(deliverer: Deliverer, payload: Any, key: str = "key-1") -> Any:
    async def once() -> Outcome:
        outcome = deliverer.deliver(delivery(deliverer, payload, key))
        return await outcome if inspect.isawaitable(outcome) else outcome

    return asyncio.run(once())


def single(path: str, **config: Any) -> PythonCallDeliverer:
    made = PythonCallDeliverer.from_config("ledger.post", {"function": path, **config})
    assert isinstance(made, PythonCallDeliverer)
    return made


def test_configured_sync_function_gets_the_whole_payload_and_the_key() -> None:
    deliverer = single("tests.fixtures_callables:echo")
    payload = {"function": "not a lookup here", "amount": 5}

    outcome = call(deliverer, payload, key="k-42")

    assert outcome == Succeeded({"payload": payload, "key": "k-42"})
    [(name, argument, key, thread)] = fixtures_callables.CALLS
    assert (name, argument, key) == ("echo", payload, "k-42")
    assert thread != threading.main_thread().name  # blocking code stays off the event loop


def test_configured_async_function_is_awaited_on_the_loop() -> None:
    deliverer = single("tests.fixtures_callables:async_echo")

    outcome = call(deliverer, [1, 2], key="k-1")

    assert outcome == Succeeded({"async": True, "payload": [1, 2], "key": "k-1"})
    assert fixtures_callables.CALLS[0][3] == threading.main_thread().name


def test_an_object_with_an_async_call_method_is_awaited() -> None:
    """It used to run in a thread and return an un-awaited coroutine as the 'result'."""
    outcome = call(single("tests.fixtures_callables:async_callable"), {"x": 1})
    assert outcome == Succeeded({"instance": True, "payload": {"x": 1}})


def test_a_plain_function_returning_a_coroutine_has_it_awaited() -> None:
    outcome = call(single("tests.fixtures_callables:returns_coroutine"), "p", key="k")
    assert outcome == Succeeded({"async": True, "payload": "p", "key": "k"})


def test_a_dotted_attribute_path_is_resolved() -> None:
    outcome = call(single("tests.fixtures_callables:Namespace.nested"), None, key="k7")
    assert outcome == Succeeded("nested:k7")


def test_bare_kind_calls_a_function_registered_in_the_config() -> None:
    deliverer = PythonCallDeliverer.from_config(
        "python.call",
        {
            "functions": {
                "echo": "tests.fixtures_callables:echo",
                "async_echo": "tests.fixtures_callables:async_echo",
            }
        },
    )
    payload = deliverer.parse_payload({"function": "echo", "args": {"n": 1}})
    assert payload == CallPayload(function="echo", args={"n": 1})

    assert call(deliverer, {"function": "echo", "args": {"n": 1}}, key="a") == Succeeded(
        {"payload": {"n": 1}, "key": "a"}
    )
    assert call(deliverer, {"function": "async_echo"}, key="b") == Succeeded(
        {"async": True, "payload": None, "key": "b"}
    )
    assert [c[:3] for c in fixtures_callables.CALLS] == [
        ("echo", {"n": 1}, "a"),
        ("async_echo", None, "b"),
    ]


def test_bare_kind_with_an_unregistered_name_fails_without_importing_it() -> None:
    """A payload can never name an import path: `os:system` is just an unknown name."""
    deliverer = PythonCallDeliverer.from_config(
        "python.call", {"functions": {"echo": "tests.fixtures_callables:echo"}}
    )
    for name in ("nope", "os:system", "tests.fixtures_callables:echo"):
        outcome = call(deliverer, {"function": name, "args": "rm -rf /"})
        assert outcome == Failed(
            f"function {name!r} is not registered (config 'functions' or entry points)"
        )
    assert fixtures_callables.CALLS == []


@pytest.mark.parametrize(
    "payload", [{"args": 1}, {"function": ""}, {"function": "echo", "x": 1}, "echo"]
)
def test_bare_kind_payload_must_name_a_function(payload: Any) -> None:
    deliverer = PythonCallDeliverer("python.call")
    with pytest.raises(pydantic.ValidationError):
        deliverer.parse_payload(payload)


@pytest.mark.parametrize(
    "path", ["tests.fixtures_callables:flaky", "tests.fixtures_callables:async_flaky"]
)
def test_retryable_error_propagates_to_the_daemon(path: str) -> None:
    """PythonCallDeliverer does not convert it; the daemon's _call turns it into Retry."""
    with pytest.raises(RetryableError, match="sink busy") as info:
        call(single(path), {})
    if path.endswith(":flaky"):
        assert (info.value.retry_after, info.value.rate_limited) == (7.5, True)


def test_permanent_error_propagates_to_the_daemon() -> None:
    with pytest.raises(PermanentError, match="account closed"):
        call(single("tests.fixtures_callables:rejects"), {})


def test_errors_propagate_in_the_bare_form_too() -> None:
    deliverer = PythonCallDeliverer.from_config(
        "python.call", {"functions": {"rejects": "tests.fixtures_callables:rejects"}}
    )
    with pytest.raises(PermanentError):
        call(deliverer, {"function": "rejects"})


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("tests.fixtures_callables:missing", "has no attribute 'missing'"),
        ("no_such_module_for_outbox_tests:f", "No module named 'no_such_module_for_outbox_tests'"),
        ("tests.fixtures_callables", "expected 'package.module:attr'"),
        (":echo", "expected 'package.module:attr'"),
        ("tests.fixtures_callables:NOT_CALLABLE", "is not callable"),
    ],
)
def test_a_bad_function_path_in_the_config_is_a_configuration_error(
    path: str, message: str
) -> None:
    with pytest.raises(ConfigurationError) as info:
        single(path)
    assert str(info.value).startswith(f"deliverer 'ledger.post': function={path!r}")
    assert message in str(info.value)


def test_a_bad_path_in_the_functions_table_fails_at_start_up() -> None:
    """It used to surface only at delivery time, as retried ConfigurationErrors."""
    with pytest.raises(ConfigurationError, match=r"deliverer 'python\.call': function='nowhere:f'"):
        PythonCallDeliverer.from_config(
            "python.call",
            {"functions": {"ok": "tests.fixtures_callables:echo", "typo": "nowhere:f"}},
        )


def test_a_bad_function_path_through_the_registry_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="function='nowhere:post'"):
        build_registry(
            kinds(**{"ledger.post": {"type": "python.call", "function": "nowhere:post"}})
        )


def test_python_call_declares_idempotency_only_when_configured() -> None:
    assert single("tests.fixtures_callables:echo").idempotent is False
    assert single("tests.fixtures_callables:echo", idempotent=True).idempotent is True
    assert single("tests.fixtures_callables:echo").has_lookup is False
