from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError as PydanticValidationError

from outbox.delivery.settings import DeliverySettings
from outbox.errors import ConfigurationError
from outbox.settings import Settings


def test_defaults() -> None:
    settings = Settings()
    assert settings.dsn is None
    assert settings.home == Path(".outbox")
    assert settings.max_payload_bytes == 1024 * 1024


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
