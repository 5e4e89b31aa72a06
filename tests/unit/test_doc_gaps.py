"""Answers the docs once lacked (issue 31), kept true against the code.

Each test reads a page and the code it describes: a new crash point, a changed
minimum PostgreSQL version, a renamed JSON field, fails here until the page
says it too.
"""

from __future__ import annotations

import inspect
import re
import shlex
from pathlib import Path

import pytest

from outbox import faults
from outbox.errors import ConfigurationError
from outbox.models import Effect
from outbox.storage import migrate

DOCS = Path(__file__).resolve().parents[2] / "docs"


def read(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def section(text: str, heading: str) -> str:
    return text.split(heading + "\n", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]


def test_every_crash_point_is_in_the_table_and_the_examples_parse() -> None:
    page = read("howto/check-your-agent.md")
    table = section(page, "### What is killed, where")
    for point in faults.POINTS:
        assert f"`{point}`" in table, f"crash point {point} is not in check-your-agent.md"
    by_hand = section(page, "### Crash points by hand: `OUTBOX_TEST_CRASH_AT`")
    (block,) = re.findall(r"```bash\n(.*?)```", by_hand, flags=re.S)
    targets = []
    for line in block.splitlines():
        words = shlex.split(line.split("#", 1)[0])
        env = dict(w.split("=", 1) for w in words if "=" in w and w.split("=")[0].isupper())
        if faults.CRASH_ENV in env:
            targets.append(faults.parse_target(env[faults.CRASH_ENV]))
        assert set(env) <= {faults.CRASH_ENV, faults.TRACE_ENV}, line
    assert ("after_step", None, 3) in targets and ("after_call", "email.send", 1) in targets
    with pytest.raises(ValueError, match="no crash point 'after_stpe'"):
        faults.parse_target("after_stpe")


def test_the_lowest_postgresql_is_stated_and_refused_below() -> None:
    major = migrate.MIN_SERVER_VERSION // 10000
    assert f"version {major} or newer" in read("reference/settings.md")
    assert f"PostgreSQL {major} or newer" in read("quickstart.md")
    migrate.refuse_old_server(migrate.MIN_SERVER_VERSION)
    migrate.refuse_old_server(180001)
    with pytest.raises(ConfigurationError, match=rf"PostgreSQL 12\.8 is too old.*{major} or newer"):
        migrate.refuse_old_server(120008)
    with pytest.raises(ConfigurationError, match=r"PostgreSQL 9\.6 is too old"):
        migrate.refuse_old_server(90624)
    migrate.refuse_server_encoding("UTF8")
    migrate.refuse_server_encoding("SQL_ASCII")
    with pytest.raises(ConfigurationError, match=r"LATIN1: .* needs a UTF8 database"):
        migrate.refuse_server_encoding("LATIN1")


def test_the_digest_an_approval_names_is_the_payload_hash_of_the_json() -> None:
    assert "payload_hash" in Effect.model_fields
    assert "return self.payload_hash" in inspect.getsource(Effect.digest.fget)  # type: ignore[attr-defined]
    for name in ("howto/governance.md", "reference/client.md", "reference/http.md"):
        paragraphs = [p for p in read(name).split("\n\n") if "digest" in p and "approv" in p]
        assert any("payload_hash" in p for p in paragraphs), name


def test_the_check_says_where_it_runs() -> None:
    where = section(read("howto/check-your-agent.md"), "## Where the check runs")
    for needle in (
        "OUTBOX_DSN",
        "outbox --dsn",
        "./.outbox",
        "outbox check --dsn",
        "CREATE DATABASE",
    ):
        assert needle in where, needle


def test_the_quickstart_says_how_to_stop_the_embedded_server() -> None:
    """It keeps running after the demo and the examples: the page names the command."""
    import click

    from outbox.cli import cli

    stop = section(read("quickstart.md"), "## A run in code")
    assert "```bash\noutbox db stop\n```" in stop
    db = cli.get_command(click.Context(cli), "db")
    assert isinstance(db, click.Group) and "stop" in db.list_commands(click.Context(db))
