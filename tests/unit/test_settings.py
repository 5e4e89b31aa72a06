from __future__ import annotations

from pathlib import Path

import pytest

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
