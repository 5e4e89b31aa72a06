"""The SQL API enforces the Python client's rules: one list, held equal to the Python constants.

``outbox_intent_rules()`` (migration 0007) holds every limit and list the SQL
functions check; ``outbox.governance.intent_rules`` and ``Settings`` hold Python's. When a
Python rule changes, this test fails until a new migration changes the SQL
rule. (The shared refusal cases run in ``test_sql_api.py``.)
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outbox import RunStart, Settings
from outbox.governance import intent_rules as rules_py
from outbox.models import ACTIVE_RUN_STATUSES, LIVE_RUN_STATUSES
from outbox.storage.functions import functions_ddl

DOCS = Path(__file__).parents[2] / "docs" / "sql-api.md"


@pytest.fixture
def rules(dsn: str) -> dict[str, Any]:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT outbox_intent_rules()").fetchone()
    assert row is not None
    return dict(row[0])


def _same_characters(sql_pattern: str, python_pattern: str) -> None:
    # The SQL spells its character classes with escapes and from U+0001 (text
    # cannot hold a NUL); both must match exactly the same characters.
    sql, python = re.compile(sql_pattern), re.compile(python_pattern)
    for code in range(1, 0x3000):
        char = chr(code)
        assert bool(sql.search(char)) == bool(python.search(char)), hex(code)


def _rule(rule: rules_py.NameRule) -> dict[str, Any]:
    return {
        "code": rule.code,
        "names": sorted(rule.names),
        "prefixes": list(rule.prefixes),
        "pattern": rule.pattern,
    }


def test_intent_rules_are_pythons(rules: dict[str, Any]) -> None:
    assert rules["kind_pattern"] == rules_py.KIND_PATTERN
    assert rules["max_kind_length"] == rules_py.MAX_KIND_LENGTH
    assert rules["max_key_length"] == rules_py.MAX_KEY_LENGTH
    assert rules["max_attempts"] == rules_py.MAX_ATTEMPTS
    assert rules["max_schema_version"] == rules_py.MAX_SCHEMA_VERSION
    assert rules["max_delay_seconds"] == rules_py.MAX_DELAY_SECONDS
    assert rules["max_amount"] == rules_py.MAX_AMOUNT
    assert rules["headers_field"] == rules_py.HEADERS_FIELD
    assert rules["url_field"] == rules_py.URL_FIELD
    assert rules["header_name_pattern"] == rules_py.HEADER_NAME_PATTERN
    assert rules["credential_value_pattern"] == rules_py.CREDENTIAL_VALUE_PATTERN
    assert rules["header_name_rules"] == [_rule(r) for r in rules_py.HEADER_NAME_RULES]
    assert rules["query_name_rules"] == [_rule(r) for r in rules_py.QUERY_NAME_RULES]
    assert rules["reasons"] == dict(rules_py.REASONS)
    _same_characters(rules["control_characters"], rules_py.CONTROL_CHARACTERS)
    _same_characters(rules["header_value_forbidden"], rules_py.HEADER_VALUE_FORBIDDEN)


def test_run_limits_are_the_python_models(rules: dict[str, Any]) -> None:
    schema = RunStart.model_json_schema()["properties"]
    assert rules["max_agent_length"] == schema["agent"]["maxLength"]
    assert rules["max_version_length"] == schema["version"]["maxLength"]


def test_settings_defaults_are_pythons(rules: dict[str, Any]) -> None:
    settings = Settings()
    for name in (
        "max_payload_bytes",
        "blob_threshold_bytes",
        "max_step_intents",
        "max_step_bytes",
        "max_step_id_length",
        "notify_window_ms",
    ):
        assert rules[name] == getattr(settings, name), name
    assert rules["live_run_statuses"] == [s.value for s in LIVE_RUN_STATUSES]
    assert rules["active_run_statuses"] == [s.value for s in ACTIVE_RUN_STATUSES]
    assert rules["max_priority"] == rules_py.MAX_PRIORITY
    assert rules["max_fairness_key_length"] == rules_py.MAX_FAIRNESS_KEY_LENGTH


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
    raised = set(re.findall(r"'(OB\d{3})'", functions_ddl()))
    documented = set(re.findall(r"^\| `(OB\d{3})` \|", DOCS.read_text(), re.MULTILINE))
    assert raised == documented
