"""Which deliverer serves which effect kind: entry points plus an optional TOML config.

Deliverer *types* are found through the ``outbox.deliverers`` entry points
(``http.request``, ``python.call``, ``smtp.send``, ``kafka.publish`` ship with
agent-outbox; a package can add its own). The config file maps effect *kinds*
to types with their settings::

    [kinds."http.request"]            # type defaults to the kind's name
    allow_private = ["127.0.0.1"]
    [kinds."http.request".credentials.billing]
    env = "BILLING_TOKEN"
    prefix = "Bearer "

    [kinds."email.send"]
    type = "smtp.send"
    host = "smtp.internal"

    [kinds."ledger.post"]
    type = "python.call"
    function = "myapp.ledger:post"
    idempotent = true

Without a config file, every installed type serves the kind of its own name
with default settings (except types that only make sense configured, such as
the ``testing.record`` stand-in of ``outbox check``).
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from outbox.delivery import Deliverer
from outbox.errors import ConfigurationError

__all__ = ["available_types", "build_registry", "load_config"]


def available_types() -> dict[str, type[Deliverer]]:
    """Installed deliverer types by name."""
    found: dict[str, type[Deliverer]] = {}
    for entry in entry_points(group="outbox.deliverers"):
        try:
            cls = entry.load()
        except ImportError:  # an optional extra (kafka) that is not installed
            continue
        if not (isinstance(cls, type) and issubclass(cls, Deliverer)):
            raise ConfigurationError(f"entry point {entry.name!r} is not a Deliverer subclass")
        found[entry.name] = cls
    return found


def load_config(path: Path) -> dict[str, Any]:
    """Read a deliverers config file (TOML)."""
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except OSError as exc:
        raise ConfigurationError(f"config={str(path)!r}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigurationError(f"config={str(path)!r}: {exc}") from exc
    except UnicodeDecodeError as exc:  # tomllib decodes the bytes itself and lets this escape
        raise ConfigurationError(f"config={str(path)!r}: not UTF-8 (TOML must be): {exc}") from exc


def build_registry(
    config: Mapping[str, Any] | None = None, *, only: list[str] | None = None
) -> dict[str, Deliverer]:
    """Deliverers by the kind they serve; ``only`` keeps a subset of kinds."""
    types = available_types()
    kinds: Mapping[str, Any] = (config or {}).get("kinds") or {}
    if not isinstance(kinds, Mapping):
        raise ConfigurationError("config 'kinds' must be a table of kinds")
    registry: dict[str, Deliverer] = {}
    if not kinds:
        for name, cls in types.items():
            if cls.default_registered:
                registry[name] = cls.from_config(name, {})
    for kind, raw in kinds.items():
        if not isinstance(raw, Mapping):
            raise ConfigurationError(f"kinds.{kind} must be a table")
        type_name = raw.get("type", kind)
        if not isinstance(type_name, str) or type_name not in types:
            raise ConfigurationError(
                f"kinds.{kind}.type={type_name!r}: no such deliverer type "
                f"(installed: {sorted(types)})"
            )
        registry[kind] = types[type_name].from_config(kind, raw)
    if only:
        missing = sorted(set(only) - set(registry))
        if missing:
            raise ConfigurationError(f"kinds={missing}: not configured here")
        registry = {k: v for k, v in registry.items() if k in only}
    return registry
