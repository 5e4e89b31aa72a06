"""The JSON Schemas in schemas/ match the models (run `outbox schemas export` after a change)."""

from __future__ import annotations

from pathlib import Path

import click
import pytest

from outbox.cli import cli
from outbox.cli._common import JsonOption, json_option
from outbox.cli.schemas import exported_models
from outbox.json_schemas import boundary_models, check_schemas, write_schemas

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"


def test_checked_in_schemas_match_the_models() -> None:
    assert check_schemas(SCHEMAS, exported_models()) == [], (
        "run `outbox schemas export` and commit schemas/"
    )


def test_drift_is_detected(tmp_path: Path) -> None:
    write_schemas(tmp_path)
    assert check_schemas(tmp_path) == []
    first = sorted(tmp_path.glob("*.json"))[0]
    first.write_text(first.read_text().replace('"type"', '"kind"', 1))
    (tmp_path / "Removed.json").write_text("{}")
    assert check_schemas(tmp_path) == sorted([first.name, "Removed.json"])


def test_every_core_boundary_model_is_exported() -> None:
    assert {
        "RunStart",
        "EffectIntent",
        "RunRecord",
        "StepRecord",
        "Effect",
        "EffectAttempt",
    } <= set(boundary_models())


def _commands(command: click.Command, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = [path]
    if isinstance(command, click.Group):
        for name in command.list_commands(click.Context(command)):
            found += _commands(_command((*path, name)), (*path, name))
    return found


def _command(path: tuple[str, ...]) -> click.Command:
    command: click.Command | None = cli
    for name in path:
        assert isinstance(command, click.Group)
        command = command.get_command(click.Context(command), name)  # loads lazy commands
    assert command is not None
    return command


def test_every_json_report_has_a_model_and_a_schema() -> None:
    with_json = []
    for path in _commands(cli):
        for param in _command(path).params:
            if "--json" in getattr(param, "opts", []):
                assert isinstance(param, JsonOption), f"{' '.join(path)}: use json_option(Model)"
                with_json.append("report." + ".".join(path))
    assert with_json, "no command has --json"
    assert set(with_json) <= set(exported_models())
    assert {"report.runs.show", "report.runs.versions", "report.reconcile"} <= set(with_json)


def test_json_option_wants_the_model() -> None:
    with pytest.raises(TypeError, match="pydantic model"):
        json_option(lambda: None)  # type: ignore[arg-type]
