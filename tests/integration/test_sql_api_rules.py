"""The SQL API enforces the Python client's rules: one list, compared here with the Python constants.

``outbox_intent_rules()`` (migration 0006) holds every limit and list the SQL
functions check. When a Python rule changes, this test fails until the SQL
rule is changed by a new migration.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import psycopg
import pytest

from deliverers.http import RESERVED_HEADERS, SECRET_HEADERS
from outbox import EffectIntent, RunStart, Settings
from outbox.models import LIVE_RUN_STATUSES

DOCS = Path(__file__).parents[2] / "docs" / "sql-api.md"


@pytest.fixture
def rules(dsn: str) -> dict[str, Any]:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT outbox_intent_rules()").fetchone()
    assert row is not None
    return dict(row[0])


def _field(model: type[Any], name: str) -> dict[str, Any]:
    schema = model.model_json_schema()["properties"][name]
    # optional fields are anyOf [constrained, null]
    return next((s for s in schema.get("anyOf", []) if s.get("type") != "null"), schema)


def test_intent_limits_are_the_python_models(rules: dict[str, Any]) -> None:
    kind = _field(EffectIntent, "kind")
    assert rules["kind_pattern"] == kind["pattern"]
    assert rules["kind_max_length"] == kind["maxLength"]
    assert rules["key_max_length"] == _field(EffectIntent, "key")["maxLength"]
    assert rules["ordering_key_max_length"] == _field(EffectIntent, "ordering_key")["maxLength"]
    attempts = _field(EffectIntent, "max_attempts")
    assert (rules["max_attempts_min"], rules["max_attempts_max"]) == (
        attempts["minimum"],
        attempts["maximum"],
    )
    assert rules["schema_version_min"] == _field(EffectIntent, "schema_version")["minimum"]
    assert rules["agent_max_length"] == _field(RunStart, "agent")["maxLength"]
    assert rules["version_max_length"] == _field(RunStart, "version")["maxLength"]


def test_defaults_are_the_python_settings(rules: dict[str, Any]) -> None:
    settings = Settings()
    assert rules["max_payload_bytes"] == settings.max_payload_bytes
    assert rules["step_id_max_length"] == settings.max_step_id_length
    assert rules["notify_window_ms"] == settings.notify_window_ms
    assert rules["live_run_statuses"] == [s.value for s in LIVE_RUN_STATUSES]


def test_header_rules_cover_the_http_deliverers(rules: dict[str, Any]) -> None:
    assert set(SECRET_HEADERS) <= set(rules["secret_headers"])
    assert set(RESERVED_HEADERS) <= set(rules["framing_headers"])
    assert all(h == h.lower() for h in rules["secret_headers"] + rules["framing_headers"])
    pattern = re.compile(rules["secret_header_pattern"])
    assert pattern.search("x-auth-token") and pattern.search("x-session-id")
    assert not pattern.search("x-request-id") and not pattern.search("content-type")


def test_every_documented_function_exists_after_migrate(dsn: str) -> None:
    documented = set(re.findall(r"^### `(outbox_\w+)\(", DOCS.read_text(), re.MULTILINE))
    assert len(documented) >= 12, "docs/sql-api.md documents each function under a ### heading"
    with psycopg.connect(dsn) as conn:
        present = {
            r[0]
            for r in conn.execute(
                "SELECT proname FROM pg_proc WHERE pronamespace = 'public'::regnamespace"
            )
        }
    assert documented <= present, documented - present


def test_every_sqlstate_raised_is_documented() -> None:
    migration = (
        Path(__file__).parents[2] / "outbox" / "storage" / "migrations" / "0006_sql_api.sql"
    ).read_text()
    raised = set(re.findall(r"'(OB\d{3})'", migration))
    documented = set(re.findall(r"^\| `(OB\d{3})` \|", DOCS.read_text(), re.MULTILINE))
    assert raised == documented
