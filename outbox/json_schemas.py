"""JSON Schemas of every model that crosses a boundary, kept in ``schemas/``.

The records and deliverer payloads are listed here; the CLI adds the model of
each ``--json`` report (``outbox.cli.schemas.exported_models``). Beside one
schema per model: ``http-api.openapi.json``, the OpenAPI document of ``outbox
serve``'s HTTP API (generated from its routes and models).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from importlib.metadata import entry_points
from pathlib import Path

from pydantic import BaseModel

from outbox import models
from outbox.errors import MissingExtra

__all__ = [
    "OPENAPI_FILE",
    "boundary_models",
    "check_schemas",
    "documents",
    "render",
    "unavailable_models",
    "write_schemas",
]

#: The HTTP API's OpenAPI document, in ``schemas/``.
OPENAPI_FILE = "http-api.openapi.json"

_CORE: tuple[type[BaseModel], ...] = (
    models.RunStart,
    models.EffectIntent,
    models.Compensation,
    models.RunRecord,
    models.StepRecord,
    models.Effect,
    models.EffectAttempt,
)


def boundary_models() -> dict[str, type[BaseModel]]:
    """File stem → model: the core records plus each installed deliverer's payload model."""
    found: dict[str, type[BaseModel]] = {model.__name__: model for model in _CORE}
    for entry in entry_points(group="outbox.deliverers"):
        try:
            deliverer = entry.load()
        except ImportError as exc:
            if MissingExtra.of(exc, "") is None:
                raise
            continue  # listed by unavailable_models()
        payload_model = getattr(deliverer, "payload_model", None)
        if isinstance(payload_model, type) and issubclass(payload_model, BaseModel):
            found[f"payload.{entry.name}"] = payload_model
    return dict(sorted(found.items()))


def unavailable_models() -> dict[str, MissingExtra]:
    """File stem → why it cannot be made: payloads of deliverers whose extra is missing."""
    missing: dict[str, MissingExtra] = {}
    for entry in entry_points(group="outbox.deliverers"):
        try:
            entry.load()
        except ImportError as exc:
            found = MissingExtra.of(exc, f"the {entry.name!r} deliverer")
            if found is None:
                raise
            missing[f"payload.{entry.name}"] = found
    return missing


def render(model: type[BaseModel]) -> str:
    """The schema text as written to disk (stable: sorted keys, trailing newline)."""
    return json.dumps(model.model_json_schema(), indent=2, sort_keys=True) + "\n"


def documents(models: Mapping[str, type[BaseModel]] | None = None) -> dict[str, str]:
    """File name → text of everything ``schemas/`` holds (``models`` default: boundary ones)."""
    from outbox.serve.api.openapi import openapi_document

    chosen = boundary_models() if models is None else models
    found = {f"{name}.json": render(model) for name, model in chosen.items()}
    found[OPENAPI_FILE] = json.dumps(openapi_document(), indent=2, sort_keys=True) + "\n"
    return found


def write_schemas(
    directory: Path, models: Mapping[str, type[BaseModel]] | None = None
) -> list[Path]:
    """Write every schema (and the OpenAPI document); return the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in documents(models).items():
        path = directory / name
        path.write_text(text)
        written.append(path)
    return written


def check_schemas(
    directory: Path,
    models: Mapping[str, type[BaseModel]] | None = None,
    unchecked: Collection[str] = (),
) -> list[str]:
    """Names whose file is missing, different, or left over from a removed model.

    ``unchecked`` are stems whose model cannot be made here (an optional extra
    is missing): their files are not taken for leftovers.
    """
    expected = documents(models)
    skip = {f"{stem}.json" for stem in unchecked}
    drift = [
        name
        for name, text in expected.items()
        if not (directory / name).exists() or (directory / name).read_text() != text
    ]
    drift += [
        p.name for p in directory.glob("*.json") if p.name not in expected and p.name not in skip
    ]
    return sorted(drift)
