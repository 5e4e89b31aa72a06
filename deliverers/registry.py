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

import logging
from collections.abc import Mapping
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from outbox.delivery import Deliverer
from outbox.delivery.config import DeliverersConfig
from outbox.errors import ConfigurationError, MissingExtra

__all__ = ["available_types", "build_registry", "load_config", "parse_config", "unavailable_types"]

log = logging.getLogger(__name__)


def _entry_points() -> tuple[dict[str, type[Deliverer]], dict[str, ImportError]]:
    found: dict[str, type[Deliverer]] = {}
    failed: dict[str, ImportError] = {}
    for entry in entry_points(group="outbox.deliverers"):
        try:
            cls = entry.load()
        except ImportError as exc:  # an optional extra (kafka) that is not installed
            failed[entry.name] = exc
            continue
        if not (isinstance(cls, type) and issubclass(cls, Deliverer)):
            raise ConfigurationError(f"entry point {entry.name!r} is not a Deliverer subclass")
        found[entry.name] = cls
    return found, failed


def available_types() -> dict[str, type[Deliverer]]:
    """Installed deliverer types by name."""
    return dict(_entry_points()[0])


def unavailable_types() -> dict[str, ImportError]:
    """Registered deliverer types that cannot be imported (an optional extra is missing)."""
    return dict(_entry_points()[1])


def parse_config(raw: Mapping[str, Any]) -> DeliverersConfig:
    """Validate a parsed deliverers config against the installed types."""
    return DeliverersConfig.parse(raw, *_entry_points())


def load_config(path: Path) -> DeliverersConfig:
    """Read and validate a deliverers config file (TOML): every table, every key."""
    return DeliverersConfig.load(path, *_entry_points())


def build_registry(
    config: DeliverersConfig | None = None, *, only: list[str] | None = None
) -> dict[str, Deliverer]:
    """Deliverers by the kind they serve, from a loaded config; ``only`` keeps a subset of kinds.

    No config, or one without ``[kinds.*]``: every installed type serves the kind
    of its own name, with default settings.
    """
    types, failed = _entry_points()
    registry: dict[str, Deliverer] = {}
    if config is None or not config.kinds:
        for name, cls in types.items():
            if cls.default_registered:
                registry[name] = cls(name)
        for name, exc in failed.items():
            if (missing := MissingExtra.of(exc, f"kind {name!r}")) is not None:
                log.info("%s; not served", missing)
    else:
        for kind, table in config.kinds.items():
            registry[kind] = types[table.type](kind, table.settings)
    if only:
        missing_kinds = sorted(set(only) - set(registry))
        if missing_kinds:
            raise ConfigurationError(f"kinds={missing_kinds}: not configured here")
        registry = {k: v for k, v in registry.items() if k in only}
    return registry
