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
        ctx = click.Context(command)
        for name in command.list_commands(ctx):  # `outbox` loads its commands lazily
            sub = command.get_command(ctx, name)
            assert sub is not None
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
        assert command[0] == "outbox" and command[1] in cli.list_commands(click.Context(cli)), (
            name,
            command,
        )
    assert services["relay"]["environment"]["OUTBOX_KAFKA_BOOTSTRAP"] == "kafka:9092"
    assert "OUTBOX_DELIVER_FROM_KAFKA" in services["deliver-1"]["environment"]


def test_the_compose_deliverers_config_loads() -> None:
    from deliverers.registry import build_registry, load_config

    config = load_config(ROOT / "deploy" / "deliverers.toml")
    assert "http.request" in build_registry(config)


def test_the_image_build_context_leaves_out_local_state() -> None:
    """``docker build .`` must not take in .venv, .outbox (live data), node_modules or .git."""
    import fnmatch

    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def ignored(path: str) -> bool:
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        for pattern in patterns:
            bare = pattern.removeprefix("**/")
            if any(fnmatch.fnmatch(p, pattern) for p in prefixes):
                return True
            if pattern.startswith("**/") and any(fnmatch.fnmatch(part, bare) for part in parts):
                return True
        return False

    for path in (
        ".venv/bin/python",
        ".outbox/pg/PG_VERSION",
        "clients/typescript/node_modules/pg/package.json",
        ".git/HEAD",
        "outbox/__pycache__/client.cpython-311.pyc",
    ):
        assert ignored(path), path
    # What `pip install .` in the Dockerfile needs is kept.
    for path in ("pyproject.toml", "README.md", "outbox/client.py", "deliverers/http.py"):
        assert not ignored(path), path
    assert "COPY . /app" in (ROOT / "Dockerfile").read_text()
