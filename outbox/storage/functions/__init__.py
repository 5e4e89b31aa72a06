"""The database's functions and triggers: one current-truth file each, in this folder.

A fresh schema (``metadata.create_all``) loads every ``*.sql`` file here; the
numbered migrations hold frozen copies of earlier versions. A migration that
changes a function is produced from these files (``python -m tools.new_migration``),
and ``tests/integration/test_migrations.py`` checks that replaying every
migration yields exactly these bodies.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources

__all__ = ["LOAD_SETTINGS", "Definition", "definitions", "function_files", "functions_ddl"]

_FUNCTION = re.compile(r"CREATE OR REPLACE FUNCTION (\w+)\(")
_TRIGGER = re.compile(r"CREATE (?:CONSTRAINT )?TRIGGER (\w+)")
_TYPE = re.compile(r"CREATE TYPE (\w+)")


@dataclass(frozen=True)
class Definition:
    """One ``CREATE`` statement of a file (with the comment lines above it)."""

    file: str
    kind: str  # "function", "trigger" or "type"
    name: str
    text: str


#: What a script that (re)creates functions sets first (functions_ddl, and each
#: migration tools/new_migration writes). Bodies refer to each other in any order
#: (as pg_dump's do). The search path: the SECURITY DEFINER functions keep the one
#: they were created with (``SET search_path FROM CURRENT``), so it names the
#: outbox schema, then pg_catalog, then pg_temp explicitly, last: unnamed, pg_temp
#: would be searched first, and a caller's temporary table could stand in for an
#: outbox table inside a function that runs as the tables' owner.
LOAD_SETTINGS = (
    "SET LOCAL check_function_bodies = off;\n"
    "SELECT set_config('search_path', format('%I, pg_catalog, pg_temp', current_schema()), true);\n"
)

#: Loaded before the others: the types their signatures name.
TYPES_FILE = "types.sql"


def function_files() -> dict[str, str]:
    """Every file's name and text: the types first, then the rest by name."""
    folder = resources.files(__name__)
    files = sorted((e for e in folder.iterdir() if e.name.endswith(".sql")), key=lambda e: e.name)
    ordered = sorted(files, key=lambda e: e.name != TYPES_FILE)
    return {entry.name: entry.read_text() for entry in ordered}


def functions_ddl() -> str:
    """One script that (re)creates every function and trigger.

    Bodies are not checked against each other while it runs (as ``pg_dump`` does),
    so the files may come in any order.
    """
    return LOAD_SETTINGS + "\n".join(function_files().values())


def definitions() -> list[Definition]:
    """Every function and trigger the files define, in file order.

    A trigger's statement includes the ``DROP TRIGGER IF EXISTS`` before it.
    """
    found = []
    for file, text in function_files().items():
        for statement in _statements(text):
            body = "\n".join(line for line in statement.splitlines() if not line.startswith("--"))
            if match := _FUNCTION.search(body):
                found.append(Definition(file, "function", match[1], statement))
            elif match := _TRIGGER.search(body):
                found.append(Definition(file, "trigger", match[1], statement))
            elif match := _TYPE.search(body):
                found.append(Definition(file, "type", match[1], statement))
    return found


def _statements(text: str) -> list[str]:
    """Top-level statements, each with its leading comments; a DROP joins the next one."""
    out: list[str] = []
    current: list[str] = []
    quoted = False
    for line in text.splitlines():
        if not quoted and not current and not line.strip():
            continue
        current.append(line)
        if line.count("$$") % 2:
            quoted = not quoted
        ends = not quoted and line.rstrip().endswith(";") and not line.lstrip().startswith("--")
        if ends and not line.lstrip().upper().startswith("DROP TRIGGER"):
            out.append("\n".join(current))
            current = []
    return out
