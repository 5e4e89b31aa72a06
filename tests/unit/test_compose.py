"""compose.yaml parses, every setting it gives our services is one the code reads, and no
service but the one-shot bootstrap connects as the PostgreSQL superuser.

tests/integration/test_compose_roles.py runs the same bootstrap, migrations, roles,
relay and deliverers against a real PostgreSQL and a real Kafka-protocol broker.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import click
import yaml

from outbox.cli import cli
from outbox.settings import ENV_PREFIX, Settings
from outbox.storage.admin.roles import ROLES

ROOT = Path(__file__).resolve().parents[2]
BOOTSTRAP = ROOT / "deploy" / "compose" / "bootstrap.sql"
_VARIABLE = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


def interpolate(value: str, env: Mapping[str, str] | None = None) -> str:
    """``${NAME:-default}`` as compose resolves it."""
    env = os.environ if env is None else env
    return _VARIABLE.sub(lambda m: env.get(m[1]) or (m[2] or ""), value)


def load_compose(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """compose.yaml with its ``${...}`` resolved (defaults unless ``env`` says otherwise)."""
    text = interpolate((ROOT / "compose.yaml").read_text(), {} if env is None else env)
    loaded: dict[str, Any] = yaml.safe_load(text)
    return loaded


def bootstrap_roles() -> tuple[set[str], set[str], dict[str, str]]:
    """(group roles, logins, login -> group) that deploy/compose/bootstrap.sql makes."""
    sql = BOOTSTRAP.read_text()
    made_by = r"CREATE ROLE %I (NOLOGIN|LOGIN)', name\)\s+FROM unnest\(ARRAY\[([^]]*)\]"
    arrays = re.findall(made_by, sql)
    made = {kind: set(re.findall(r"'(\w+)'", names)) for kind, names in arrays}
    members = {}
    for group, logins in re.findall(r"GRANT (\w+) TO ([\w, ]+);", sql):
        for login in logins.split(","):
            members[login.strip()] = group
    return made["NOLOGIN"], made["LOGIN"], members


def dsn_login(dsn: str) -> tuple[str, str]:
    parts = urlsplit(dsn)
    return unquote(parts.username or ""), unquote(parts.password or "")


def bootstrap_passwords(compose: dict[str, Any]) -> dict[str, str]:
    """login -> the password the bootstrap service gives it (psql -v NAME_password=...)."""
    command = compose["services"]["bootstrap"]["command"]
    values = [command[i + 1] for i, arg in enumerate(command) if arg == "-v"]
    out = {}
    for value in values:
        name, _, password = value.partition("=")
        out[f"outbox_{name.removesuffix('_password')}"] = password
    return out


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
    compose = load_compose()
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


def test_no_service_connects_as_the_superuser_and_each_uses_its_role() -> None:
    compose = load_compose()
    services = compose["services"]
    superuser = services["postgres"]["environment"]["POSTGRES_USER"]
    groups, logins, members = bootstrap_roles()
    # The group roles are exactly those `outbox roles` grants.
    assert groups == {f"outbox_{spec.suffix}" for spec in ROLES}
    # Only the one-shot bootstrap (psql) is the superuser; it mounts the script it runs.
    assert services["bootstrap"]["environment"]["PGUSER"] == superuser
    assert services["bootstrap"]["command"][0] == "psql"
    assert "./deploy/compose/bootstrap.sql:/bootstrap.sql:ro" in services["bootstrap"]["volumes"]
    passwords = bootstrap_passwords(compose)
    expected = {
        "migrate": ("outbox_owner", None),
        "roles": ("outbox_owner", None),
        "relay": ("outbox_relay", "outbox_deliverer"),
        "deliver-1": ("outbox_deliver", "outbox_deliverer"),
        "deliver-2": ("outbox_deliver", "outbox_deliverer"),
    }
    for name, (login, group) in expected.items():
        user, password = dsn_login(services[name]["environment"]["OUTBOX_DSN"])
        assert user == login != superuser, name
        assert user in logins, f"{name} logs in as {user}, which the bootstrap does not make"
        assert members.get(user) == group, (name, user, members.get(user))
        assert password == passwords[user], f"{name}: the password is not the bootstrap's"
    # Every service with a database connection is in that list.
    with_dsn = {n for n, s in services.items() if "OUTBOX_DSN" in (s.get("environment") or {})}
    assert with_dsn == set(expected)


def test_the_roles_are_granted_before_any_long_running_service_starts() -> None:
    services = load_compose()["services"]
    assert services["roles"]["command"] == ["outbox", "roles"]

    def after(name: str) -> dict[str, str]:
        return {dep: spec["condition"] for dep, spec in services[name]["depends_on"].items()}

    assert after("migrate") == {"bootstrap": "service_completed_successfully"}
    assert after("roles") == {"migrate": "service_completed_successfully"}
    for name in ("relay", "deliver-1", "deliver-2"):
        assert after(name)["roles"] == "service_completed_successfully", name


def test_passwords_come_from_the_environment() -> None:
    env = {
        "OUTBOX_OWNER_PASSWORD": "o-secret",
        "OUTBOX_RELAY_PASSWORD": "r-secret",
        "OUTBOX_DELIVER_PASSWORD": "d-secret",
    }
    compose = load_compose(env)
    assert bootstrap_passwords(compose) == {
        "outbox_owner": "o-secret",
        "outbox_relay": "r-secret",
        "outbox_deliver": "d-secret",
    }
    dsn = compose["services"]["relay"]["environment"]["OUTBOX_DSN"]
    assert dsn_login(dsn) == ("outbox_relay", "r-secret")
