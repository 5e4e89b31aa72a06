"""Write the next migration from the function files: ``python -m tools.new_migration NAME``.

Replays every shipped migration into one scratch database, creates a second one
fresh from ``outbox/storage/schema.py`` and the function files, and compares their
functions, triggers and types. Every one whose definition differs (or is new) is
copied from its file into
``outbox/storage/migrations/NNNN_NAME.sql``; a function the files no longer
define is dropped, and so is one whose arguments or result changed (``CREATE OR
REPLACE`` cannot change them). Table changes are not detected: write them into
the new file by hand, above the generated part.

Uses ``OUTBOX_DSN``'s server if set (its role must be allowed to create
databases), else a throwaway embedded server.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
from sqlalchemy.engine import make_url

from outbox.storage.embedded import EmbeddedServer
from outbox.storage.engine import make_engine
from outbox.storage.functions import definitions
from outbox.storage.migrate import migrate, shipped
from outbox.storage.schema import metadata

MIGRATIONS = Path(__file__).resolve().parents[1] / "outbox" / "storage" / "migrations"
CATALOG = {
    "function": """
        SELECT p.proname, pg_get_function_identity_arguments(p.oid), pg_get_function_result(p.oid),
               pg_get_functiondef(p.oid)
          FROM pg_proc p WHERE p.pronamespace = 'public'::regnamespace AND p.prokind = 'f'""",
    "trigger": """
        SELECT t.tgname, t.tgrelid::regclass::text, '', pg_get_triggerdef(t.oid)
          FROM pg_trigger t WHERE NOT t.tgisinternal""",
    "type": """
        SELECT t.typname, '', '',
               string_agg(a.attname || ' ' || format_type(a.atttypid, a.atttypmod), ', '
                          ORDER BY a.attnum)
          FROM pg_type t JOIN pg_class c ON c.oid = t.typrelid AND c.relkind = 'c'
          JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0
         WHERE t.typnamespace = 'public'::regnamespace GROUP BY t.typname""",
}
#: (kind, name, identity arguments) -> (arguments, result, definition)
Catalog = dict[tuple[str, str, str], tuple[str, str, str]]


@contextmanager
def _server() -> Iterator[str]:
    """An admin DSN: OUTBOX_DSN's server, or a throwaway embedded one."""
    if os.environ.get("OUTBOX_DSN"):
        yield make_url(os.environ["OUTBOX_DSN"]).render_as_string(hide_password=False)
        return
    home = Path(tempfile.mkdtemp(prefix="outbox-new-migration-"))
    home.chmod(0o711)  # run as root, the server runs as another user
    server = EmbeddedServer(home)
    try:
        server.ensure_running()
        yield server.dsn("postgres")
    finally:
        server.stop(mode="immediate")
        shutil.rmtree(home, ignore_errors=True)


def _catalog(dsn: str, *, fresh: bool) -> Catalog:
    """The functions, triggers and types of a migrated database, or of a fresh one (the files)."""
    engine = make_engine(dsn)
    try:
        if fresh:
            metadata.create_all(engine)
        else:
            migrate(engine)
    finally:
        engine.dispose()
    with psycopg.connect(dsn) as conn:
        found: Catalog = {}
        for kind, query in CATALOG.items():
            for name, args, result, text in conn.execute(query):
                found[(kind, name, args if kind == "function" else "")] = (args, result, text)
    return found


def changes(admin_dsn: str) -> tuple[list[str], list[str]]:
    """(drops, definitions) that bring a migrated database to the function files."""
    url = make_url(admin_dsn)
    names = ("outbox_newmig_old", "outbox_newmig_new")
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        for name in names:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            conn.execute(f"CREATE DATABASE {name}")
    try:
        old, new = (
            _catalog(url.set(database=n).render_as_string(hide_password=False), fresh=f)
            for n, f in zip(names, (False, True), strict=True)
        )
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            for name in names:
                conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    files = {(d.kind, d.name): d for d in definitions()}
    drops, creates = [], []
    for (kind, name, args), (_, result, text) in sorted(old.items()):
        kept = new.get((kind, name, args))
        if kind == "type" and kept is not None and kept[2] != text:
            raise SystemExit(f"type {name} changed: write its migration by hand (DROP ... CASCADE)")
        if kind == "function" and (kept is None or kept[1] != result):
            drops.append(f"DROP FUNCTION {name}({args});")
    for (kind, name, args) in old:
        if kind != "function" and (kind, name, args) not in new:
            raise SystemExit(f"{kind} {name} is in no file: drop it in a migration by hand")
    for (kind, name, args), (_, _, text) in new.items():
        definition = files[(kind, name)]
        dropped = any(d.startswith(f"DROP FUNCTION {name}(") for d in drops)
        changed = old.get((kind, name, args), (None, None, None))[2] != text or dropped
        if changed and definition.text not in creates:
            creates.append(definition.text)
    # types first: the functions' signatures name them
    creates.sort(key=lambda text: re.search(r"^CREATE TYPE", text, re.MULTILINE) is None)
    return drops, creates


def main(argv: list[str] | None = None) -> int:
    """Write the migration file, or say that the files match the migrations."""
    parser = argparse.ArgumentParser(prog="python -m tools.new_migration", description=__doc__)
    parser.add_argument("name", help="what the migration does, in snake_case")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"[a-z0-9_]+", args.name):
        parser.error(f"name={args.name!r}: use lower-case letters, digits and _")
    with _server() as admin:
        drops, creates = changes(admin)
    if not drops and not creates:
        print("the function files match the migrations: nothing to write")
        return 0
    version = shipped()[-1].version + 1
    path = MIGRATIONS / f"{version:04d}_{args.name}.sql"
    head = (
        f"-- agent-outbox {version:04d}: {args.name.replace('_', ' ')}.\n"
        "-- Generated by `python -m tools.new_migration` from outbox/storage/functions;\n"
        "-- a frozen copy: change the function files, never this one.\n\n"
        "-- Bodies refer to each other in any order (as pg_dump's do).\n"
        "SET LOCAL check_function_bodies = off;\n\n"
    )
    path.write_text(head + "\n\n".join([*drops, *creates]) + "\n")
    print(f"wrote {path} ({len(drops)} drop(s), {len(creates)} definition(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
