"""The SQL API's functions and trigger (docs/sql-api.md), as DDL text read from its migrations.

``schema.py`` runs this text when it creates a fresh schema, so a fresh schema and a
migrated one get the same definitions from one source.
"""

from __future__ import annotations

from importlib import resources

__all__ = ["SQL_API_MIGRATIONS", "sql_api_ddl"]

SQL_API_MIGRATION = "0007_sql_api.sql"
#: Migrations whose part below ``-- @functions`` (re)defines SQL API functions, in order.
#: 0010 replaces some of 0007's for governance (gates, dry runs, the step chain),
#: 0013 some of those for run control (pause, lanes, keys, values by reference),
#: 0015 one that locks the run row where a foreign key used to, 0020 adds dry
#: runs to outbox_start_run, 0021 chains outbox_commit_step's steps with v2 links,
#: and 0022 widens the credential rules in outbox_intent_rules.
SQL_API_MIGRATIONS = (
    SQL_API_MIGRATION,
    "0010_governance.sql",
    "0013_run_control.sql",
    "0015_lean_steps.sql",
    "0020_sql_dry_run.sql",
    "0021_audit_chain_v2.sql",
    "0022_credential_rules.sql",
)
_FUNCTIONS_MARKER = "-- @functions"


def sql_api_ddl() -> str:
    """The SQL API's functions and trigger: each migration's part below ``-- @functions``.

    Read from the migrations themselves, so a fresh schema and a migrated one get
    the same definitions from one text. A later migration that replaces one of
    these functions is listed in :data:`SQL_API_MIGRATIONS` too.
    """
    parts = []
    for name in SQL_API_MIGRATIONS:
        text_ = resources.files("outbox.storage.migrations").joinpath(name).read_text()
        parts.append(text_[text_.index(_FUNCTIONS_MARKER) :])
    return "\n".join(parts)
