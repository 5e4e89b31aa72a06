"""The JSON Schemas in schemas/ match the models (run `outbox schemas export` after a change)."""

from __future__ import annotations

from pathlib import Path

from outbox.json_schemas import boundary_models, check_schemas, write_schemas

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"


def test_checked_in_schemas_match_the_models() -> None:
    assert check_schemas(SCHEMAS) == [], "run `outbox schemas export` and commit schemas/"


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
