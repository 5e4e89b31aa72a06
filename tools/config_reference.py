"""The deliverers config reference: each table of the one model, each type's keys, as Markdown.

The blocks of docs/reference/deliverers-config.md, rendered by
``python -m tools.reference`` (which imports them from here).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from pydantic import BaseModel

from tools.markdown import field_meaning, fields_table, nested_models, summary, table

__all__ = [
    "Shipped",
    "approvals_block",
    "config_models",
    "deliverers_block",
    "dry_run_block",
    "dry_run_models",
    "gate_models",
    "shipped_deliverers",
    "tables_block",
]


@dataclass(frozen=True)
class Shipped:
    """A deliverer type shipped in ``deliverers/``, by its entry-point name."""

    name: str
    cls: type[Any]


@functools.cache
def shipped_deliverers() -> list[Shipped]:
    """The ``outbox.deliverers`` entry points that point into this repository's ``deliverers``."""
    found = []
    for entry in entry_points(group="outbox.deliverers"):
        if entry.value.split(".")[0] != "deliverers":
            continue
        try:
            found.append(Shipped(entry.name, entry.load()))
        except ImportError:  # an extra that is not installed (kafka)
            continue
    return sorted(found, key=lambda s: s.name)


def deliverers_block() -> str:
    """Every kind's keys, then each shipped type's own."""
    from outbox.delivery import Deliverer, DelivererConfig

    parts = [
        "### Every kind\n",
        f"`outbox.delivery.DelivererConfig`: {summary(DelivererConfig)}\n",
        fields_table(DelivererConfig, toml=True),
        "",
    ]
    for shipped in shipped_deliverers():
        cls = shipped.cls
        config = cls.config_model
        payload = cls.payload_model
        facts = [
            f"`{cls.__module__}.{cls.__name__}`",
            "idempotent by default" if cls.default_idempotent else "not idempotent by default",
            (
                "no `lookup`"
                if cls.lookup is Deliverer.lookup
                else "offers `lookup` when configured"
                if "has_lookup" in vars(cls)
                else "offers `lookup`"
            ),
        ]
        if payload is not None:
            facts.append(
                f"payload: [`schemas/payload.{shipped.name}.json`]"
                f"(../../schemas/payload.{shipped.name}.json)"
            )
        parts.append(f"### `{shipped.name}`\n")
        parts.append(f"{summary(cls)} ({'; '.join(facts)}.)\n")
        own = [n for n in config.model_fields if n not in DelivererConfig.model_fields]
        if own:
            parts.append(f"`{config.__name__}`: {summary(config)}\n")
            parts.append(fields_table(config, own, toml=True))
        else:
            parts.append("No settings beyond every kind's.")
        for nested in nested_models(config):
            if nested is config or issubclass(nested, DelivererConfig):
                continue
            parts.append(f"\nEach entry of a `{nested.__name__}` table: {summary(nested)}\n")
            parts.append(fields_table(nested, toml=True))
        parts.append("")
    return "\n".join(parts).rstrip()


def gate_models() -> list[type[BaseModel]]:
    """The models of an ``[[approvals]]`` table of the deliverers config and its conditions."""
    from outbox.governance.gates import Condition, Gate

    return [Gate, Condition]


def approvals_block() -> str:
    """The keys of an ``[[approvals]]`` table and of its conditions."""
    from outbox.governance.gates import Condition, Gate

    order = [
        "name",
        "kind",
        "when",
        *(n for n in Gate.model_fields if n not in {"name", "kind", "when"}),
    ]
    return "\n".join(
        [
            f"`outbox.governance.gates.Gate`: {summary(Gate)}\n",
            fields_table(Gate, order, toml=True),
            f"\nEach entry of `when` (`outbox.governance.gates.Condition`): {summary(Condition)}\n",
            fields_table(Condition, toml=True),
        ]
    )


def dry_run_models() -> list[type[BaseModel]]:
    """The models of the ``[dry_run]`` table and its stubs."""
    from outbox.delivery.dry_run import DryRunConfig, DryRunStub

    return [DryRunConfig, DryRunStub]


def dry_run_block() -> str:
    """The keys of ``[dry_run]`` and of each of its stubs."""
    config, stub = dry_run_models()
    return "\n".join(
        [
            f"`outbox.delivery.dry_run.DryRunConfig`: {summary(config)}\n",
            fields_table(config, toml=True),
            f"\nEach entry of `stubs` (`{stub.__name__}`): {summary(stub)}\n",
            fields_table(stub, toml=True),
        ]
    )


def tables_block() -> str:
    """The top-level tables of a deliverers config: one row per field of the one model."""
    from outbox.delivery.config import DeliverersConfig

    spelled = {"kinds": '`[kinds."K"]`', "approvals": "`[[approvals]]`", "dry_run": "`[dry_run]`"}
    rows = [
        [spelled.get(name, f"`[{name}]`"), field_meaning(DeliverersConfig, name)]
        for name in DeliverersConfig.model_fields
    ]
    return table(["table", "meaning"], rows)


def config_models() -> list[type[BaseModel]]:
    """Every config model of a shipped deliverer, nested tables included."""
    from outbox.delivery import DelivererConfig

    found: list[type[BaseModel]] = [DelivererConfig]
    for shipped in shipped_deliverers():
        for model in [shipped.cls.config_model, *nested_models(shipped.cls.config_model)]:
            if model not in found:
                found.append(model)
    return found
