"""``outbox schemas export|check``: JSON Schemas of every boundary model, kept in ``schemas/``."""

from __future__ import annotations

from pathlib import Path

import click
from pydantic import BaseModel

from outbox.cli._common import console, emit, json_option
from outbox.cli.reports import SchemasCheckReport, SchemasExportReport, report_models
from outbox.json_schemas import (
    boundary_models,
    check_schemas,
    unavailable_models,
    write_schemas,
)

__all__ = ["COMMANDS", "exported_models"]


def exported_models() -> dict[str, type[BaseModel]]:
    """Every model whose schema is in ``schemas/``: boundary records and payloads, and reports."""
    return dict(sorted({**boundary_models(), **report_models()}.items()))


@click.group("schemas")
def schemas() -> None:
    """Export or check the JSON Schemas of boundary models and --json reports."""


@schemas.command("export")
@click.option(
    "--dir",
    "directory",
    type=click.Path(path_type=Path, file_okay=False),
    default=Path("schemas"),
    show_default=True,
    help="Write the files here.",
)
@json_option(SchemasExportReport)
def schemas_export(directory: Path, as_json: bool) -> None:
    """Write one JSON Schema file per boundary model and per --json report."""
    written = write_schemas(directory, exported_models())
    _say_unavailable()
    emit(
        SchemasExportReport([str(p) for p in written]),
        as_json,
        lambda: console.print(f"wrote {len(written)} schema(s) to {directory}"),
    )


def _say_unavailable() -> dict[str, str]:
    """One line on stderr per schema an optional extra is missing for; stem → that line."""
    missing = {stem: f"{stem}.json: {why}" for stem, why in unavailable_models().items()}
    for line in missing.values():
        click.echo(f"skipped: {line}", err=True)
    return missing


@schemas.command("check")
@click.option(
    "--dir",
    "directory",
    type=click.Path(path_type=Path),
    default=Path("schemas"),
    show_default=True,
    help="Compare with the files here.",
)
@json_option(SchemasCheckReport)
def schemas_check(directory: Path, as_json: bool) -> None:
    """Exit 1 when a schema file differs from its model."""
    skipped = _say_unavailable()
    drift = check_schemas(directory, exported_models(), unchecked=skipped)
    emit(
        SchemasCheckReport(drift=drift, skipped=sorted(f"{s}.json" for s in skipped)),
        as_json,
        lambda: console.print("schemas are in sync" if not drift else f"out of date: {drift}"),
    )
    if drift:
        raise SystemExit(1)


COMMANDS = [schemas]
