from __future__ import annotations

from pathlib import Path

import pydantic
import pytest
from pydantic import ValidationError as PydanticValidationError

from outbox.delivery.settings import DeliverySettings
from outbox.errors import ConfigurationError
from outbox.settings import Settings


def test_defaults() -> None:
    settings = Settings()
    assert settings.dsn is None
    assert settings.home == Path(".outbox")
    assert settings.max_payload_bytes == 64 * 1024 * 1024
    assert settings.blob_threshold_bytes == 16 * 1024


def test_environment_is_read_and_overrides_win() -> None:
    env = {"OUTBOX_DSN": "postgresql://x/y", "OUTBOX_MAX_PAYLOAD_BYTES": "2048"}
    settings = Settings.from_env(env)
    assert settings.dsn == "postgresql://x/y"
    assert settings.max_payload_bytes == 2048
    assert Settings.from_env(env, max_payload_bytes=10).max_payload_bytes == 10


def test_bad_environment_value_names_the_variable() -> None:
    with pytest.raises(ConfigurationError, match="OUTBOX_MAX_PAYLOAD_BYTES='lots'"):
        Settings.from_env({"OUTBOX_MAX_PAYLOAD_BYTES": "lots"})


def test_settings_are_frozen() -> None:
    with pytest.raises(ValueError):
        Settings().max_payload_bytes = 5  # type: ignore[misc]


def test_a_deliverer_owner_may_not_pose_as_a_relay() -> None:
    """Stream deliverers take effects held by relay owners: a deliverer may not use that name."""
    with pytest.raises(PydanticValidationError, match="owner") as caught:
        DeliverySettings(owner="relay:host:1:abc")
    assert "relay:" in str(caught.value)
    assert DeliverySettings(owner="deliverer:host:1").owner == "deliverer:host:1"


def test_stream_settings_share_every_default_and_rule_of_poll_mode() -> None:
    from outbox.delivery.settings import StreamSettings

    stream = StreamSettings(bootstrap_servers="localhost:9092")
    poll = DeliverySettings()
    shared = set(DeliverySettings.model_fields) - {"owner"}
    assert {f: getattr(stream, f) for f in shared} == {f: getattr(poll, f) for f in shared}
    with pytest.raises(pydantic.ValidationError, match="may not start with 'relay:'"):
        StreamSettings(bootstrap_servers="localhost:9092", owner="relay:host:1:abc")


def test_a_relay_owner_must_look_like_one() -> None:
    from outbox.delivery.settings import RelaySettings

    assert RelaySettings(bootstrap_servers="k:9092").owner.startswith("relay:")
    with pytest.raises(pydantic.ValidationError, match="must start with 'relay:'"):
        RelaySettings(bootstrap_servers="k:9092", owner="host:1")


def test_step_caps_have_defaults_and_come_from_the_environment() -> None:
    settings = Settings()
    assert settings.max_step_intents == 10_000
    assert settings.max_step_bytes == 64 * 1024 * 1024
    env = {"OUTBOX_MAX_STEP_INTENTS": "50", "OUTBOX_MAX_STEP_BYTES": "4096"}
    assert Settings.from_env(env).max_step_intents == 50
    assert Settings.from_env(env).max_step_bytes == 4096
    with pytest.raises(ConfigurationError, match="OUTBOX_MAX_STEP_BYTES"):
        Settings.from_env({"OUTBOX_MAX_STEP_BYTES": str(2 * 1024**3)})


@pytest.mark.parametrize("value", ["99999999999", "2147483648", "-1"])
def test_idle_in_transaction_timeout_is_bounded(value: str) -> None:
    # L1: PostgreSQL refused the unbounded value at connect time with a two-line error.
    with pytest.raises(ConfigurationError, match="OUTBOX_IDLE_IN_TRANSACTION_TIMEOUT_MS"):
        Settings.from_env({"OUTBOX_IDLE_IN_TRANSACTION_TIMEOUT_MS": value})


@pytest.mark.parametrize(
    ("dsn", "reason"),
    [
        ("garbage", "not a URL"),
        ("mysql://user:hunter2@db/x", "not PostgreSQL"),
        ("http://example.com", "not PostgreSQL"),
    ],
)
def test_a_dsn_that_is_not_postgresql_is_a_configuration_error(dsn: str, reason: str) -> None:
    from outbox.storage.dsn import psycopg_url
    from outbox.storage.engine import resolve_dsn

    with pytest.raises(ConfigurationError, match=reason) as info:
        resolve_dsn(Settings(dsn=dsn))
    assert "hunter2" not in str(info.value)
    assert psycopg_url("postgresql://u@h/db").drivername == "postgresql+psycopg"


def test_a_relays_producer_keeps_acks_all_and_idempotence() -> None:
    from outbox.delivery.settings import RelaySettings

    tuned = RelaySettings(bootstrap_servers="k:9092", producer={"linger_ms": 0, "acks": "all"})
    assert tuned.producer_settings == {
        "linger_ms": 0,
        "batch_size": 512 * 1024,
        "acks": "all",
        "enable_idempotence": True,
    }
    assert (
        RelaySettings(bootstrap_servers="k:9092", producer={"acks": -1}).producer_settings["acks"]
        == "all"
    ), "kafka-python's -1 is 'all'"
    for key, value in (("acks", 1), ("acks", 0), ("enable_idempotence", False)):
        with pytest.raises(pydantic.ValidationError, match=f"{key}={value!r}: a relay publishes"):
            RelaySettings(bootstrap_servers="k:9092", producer={key: value})
    for key, value in (("retries", 0), ("max_in_flight_requests_per_connection", 6)):
        with pytest.raises(pydantic.ValidationError, match=f"{key}={value}: a relay's idempotent"):
            RelaySettings(bootstrap_servers="k:9092", producer={key: value})


def test_kafka_options_read_numbers_and_booleans() -> None:
    from outbox.cli.deliver import kafka_options_of

    given = (
        "acks=-1",
        "enable_idempotence=True",
        "compression_type=gzip",
        "acks=all",
        "client_id=007",
        "sasl_plain_password=true",
        "send_buffer_bytes=131072",
        "retries=3",
        "linger_ms=--5",
        "batch_size=²",
    )
    assert kafka_options_of(given[:3]) == {
        "acks": -1,
        "enable_idempotence": True,
        "compression_type": "gzip",
    }
    assert kafka_options_of(given[3:]) == {
        "acks": "all",
        "client_id": "007",
        "sasl_plain_password": "true",
        "send_buffer_bytes": 131072,
        "retries": 3,
        "linger_ms": "--5",  # not a number: kafka-python refuses it, named
        "batch_size": "²",
    }


def test_kafka_options_do_not_override_what_outbox_sets_itself() -> None:
    from outbox.delivery.settings import RelaySettings, StreamSettings

    with pytest.raises(pydantic.ValidationError, match="bootstrap_servers: give it as --kafka"):
        RelaySettings(bootstrap_servers="k:9092", producer={"bootstrap_servers": "x:1"})
    for key in ("group_id", "enable_auto_commit", "auto_offset_reset", "bootstrap_servers"):
        with pytest.raises(pydantic.ValidationError, match=f"{key}: "):
            StreamSettings(bootstrap_servers="k:9092", consumer={key: "x"})
