"""The deliverers config file as one typed model: kinds, approval gates, dry-run answers.

A TOML file read once (:meth:`DeliverersConfig.load`, through
``deliverers.registry.load_config``, which knows the installed types) becomes a
:class:`DeliverersConfig`; the registry builds its deliverers from ``kinds``,
``outbox deliver`` and ``outbox gates apply`` store ``approvals``, and the
dry-run deliverer answers from ``dry_run``. Every level refuses what it does
not know, with a "did you mean" hint: a misspelt table (``[[approval]]``,
``[kind."http.request"]``) must not silently drop a gate or a kind's settings.

Each kind's table is validated by the ``config_model`` of the deliverer type
serving it, so the types installed (entry points) are an input of the parse.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from outbox.delivery.contract import Deliverer, DelivererConfig
from outbox.delivery.dry_run import DryRunConfig
from outbox.errors import ConfigurationError, MissingExtra
from outbox.governance.gates import Gate
from outbox.validation import did_you_mean, validated_table

__all__ = ["DeliverersConfig", "KindConfig"]


class KindConfig(BaseModel):
    """One ``[kinds.K]`` table: the deliverer type serving kind K and its validated settings."""

    model_config = ConfigDict(frozen=True)

    #: The deliverer type's name (an ``outbox.deliverers`` entry point).
    type: str
    #: The table, validated by that type's ``config_model``.
    settings: DelivererConfig


class DeliverersConfig(BaseModel):
    """A deliverers config file: ``[kinds.*]``, ``[[approvals]]`` and ``[dry_run]``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: Effect kinds by name, each with the deliverer type serving it and that type's
    #: settings. Empty: every installed type serves the kind of its own name.
    kinds: dict[str, KindConfig] = Field(default_factory=dict)
    #: Approval gates (``[[approvals]]``): stored in PostgreSQL by ``outbox deliver``
    #: at start-up and by ``outbox gates apply``.
    approvals: list[Gate] = Field(default_factory=list)
    #: How ``outbox deliver --dry-run`` answers the effects of dry runs (``[dry_run]``).
    dry_run: DryRunConfig = Field(default_factory=DryRunConfig)

    @classmethod
    def load(
        cls,
        path: Path,
        types: Mapping[str, type[Deliverer]],
        missing: Mapping[str, ImportError] | None = None,
    ) -> DeliverersConfig:
        """Read a TOML file and :meth:`parse` it; a file that cannot be read is one line too."""
        where = f"config={str(path)!r}"
        try:
            with path.open("rb") as handle:
                raw = tomllib.load(handle)
        except OSError as exc:
            raise ConfigurationError(f"{where}: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigurationError(f"{where}: {exc}") from exc
        except UnicodeDecodeError as exc:  # tomllib decodes the bytes itself and lets this escape
            raise ConfigurationError(f"{where}: not UTF-8 (TOML must be): {exc}") from exc
        return cls.parse(raw, types, missing)

    @classmethod
    def parse(
        cls,
        raw: Mapping[str, Any],
        types: Mapping[str, type[Deliverer]],
        missing: Mapping[str, ImportError] | None = None,
    ) -> DeliverersConfig:
        """Validate a parsed TOML document; the first problem is one line naming its place.

        ``types`` are the installed deliverer types by name; ``missing`` the ones
        registered whose optional extra is not installed (their import error).
        """
        for name in raw:
            if name not in cls.model_fields:
                hint = did_you_mean(name, sorted(cls.model_fields))
                raise ConfigurationError(f"{name}: unknown table ({hint})")
        # A table given as None (from Python, never from TOML) counts as absent.
        raw = {name: table for name, table in raw.items() if table is not None}
        # Checked in the model's order (kinds, approvals, dry_run): the first problem wins.
        kinds = _kinds(raw.get("kinds", {}), types, missing or {})
        approvals = raw.get("approvals", [])
        if not isinstance(approvals, list):
            raise ConfigurationError("approvals: must be an array of tables ([[approvals]])")
        gates = [
            validated_table(Gate, table, f"approvals[{i}].", f"approvals[{i}]: must be a table")
            for i, table in enumerate(approvals)
        ]
        names = [g.name for g in gates]
        if duplicates := sorted({n for n in names if names.count(n) > 1}):
            raise ConfigurationError(f"approvals: name {duplicates[0]!r} is declared twice")
        dry_run = validated_table(
            DryRunConfig, raw.get("dry_run", {}), "dry_run.", "dry_run: must be a table ([dry_run])"
        )
        return cls(kinds=kinds, approvals=gates, dry_run=dry_run)


def _kinds(
    raw: Any, types: Mapping[str, type[Deliverer]], missing: Mapping[str, ImportError]
) -> dict[str, KindConfig]:
    if not isinstance(raw, Mapping):
        raise ConfigurationError("config 'kinds' must be a table of kinds")
    kinds: dict[str, KindConfig] = {}
    for kind, table in raw.items():
        if not isinstance(table, Mapping):
            raise ConfigurationError(f"kinds.{kind} must be a table")
        type_name = table.get("type", kind)
        if isinstance(type_name, str) and type_name in missing:
            extra = MissingExtra.of(missing[type_name], f"kinds.{kind}.type={type_name!r}")
            raise extra or ConfigurationError(f"kinds.{kind}.type={type_name!r}: cannot be loaded")
        if not isinstance(type_name, str) or type_name not in types:
            raise ConfigurationError(
                f"kinds.{kind}.type={type_name!r}: no such deliverer type "
                f"(installed: {sorted(types)})"
            )
        settings = types[type_name].parse_config(kind, table)
        kinds[kind] = KindConfig(type=type_name, settings=settings)
    return kinds
