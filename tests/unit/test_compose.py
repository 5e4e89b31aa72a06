"""compose.yaml parses, and every setting it gives our services is one the code reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import yaml

from outbox.cli import cli
from outbox.settings import ENV_PREFIX, Settings

ROOT = Path(__file__).resolve().parents[2]


def _envvars(command: click.Command) -> set[str]:
    names: set[str] = set()
    for param in command.params:
        envvar = getattr(param, "envvar", None)
        if isinstance(envvar, str):
            names.add(envvar)
        elif envvar:
            names.update(envvar)
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            names |= _envvars(sub)
    return names


def known_variables() -> set[str]:
    settings = {ENV_PREFIX + name.upper() for name in Settings.model_fields}
    return settings | _envvars(cli) | {"OUTBOX_WEBHOOK_SECRET"}


def test_compose_parses_and_our_services_use_only_known_variables() -> None:
    compose: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    assert {"postgres", "kafka", "relay", "deliver-1", "deliver-2", "sink"} <= set(services)
    known = known_variables()
    ours = {name: spec for name, spec in services.items() if "build" in spec}
    assert {"relay", "deliver-1", "deliver-2", "sink", "migrate"} <= set(ours)
    for name, spec in ours.items():
        unknown = set(spec.get("environment") or {}) - known
        assert not unknown, f"{name} sets variables no code reads: {sorted(unknown)}"
        command = spec["command"]
        assert command[0] == "outbox" and command[1] in cli.commands, (name, command)
    assert services["relay"]["environment"]["OUTBOX_KAFKA_BOOTSTRAP"] == "kafka:9092"
    assert "OUTBOX_DELIVER_FROM_KAFKA" in services["deliver-1"]["environment"]


def test_the_compose_deliverers_config_loads() -> None:
    from deliverers.registry import build_registry, load_config

    config = load_config(ROOT / "deploy" / "deliverers.toml")
    assert "http.request" in build_registry(config)
