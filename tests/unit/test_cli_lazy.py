"""``outbox --help`` answers without importing the commands, and says the same as they do.

The root group lists its commands from a table (module, summary); a command's
module is imported only when it runs. This keeps the table true, and
``--help``'s CPU time small (measured in the report of issue 31, not here).
"""

from __future__ import annotations

import inspect
import subprocess
import sys

import click

import outbox.cli as root
from outbox.cli import COMMANDS, cli


def test_the_table_names_each_command_its_module_and_its_summary() -> None:
    ctx = click.Context(cli)
    assert cli.list_commands(ctx) == sorted(COMMANDS)
    for name, (module, summary) in COMMANDS.items():
        command = cli.get_command(ctx, name)
        assert command is not None, name
        assert command.callback is None or command.callback.__module__.endswith(f".{module}"), name
        first = " ".join(inspect.cleandoc(command.help or "").split("\n\n")[0].split())
        assert summary == first, f"COMMANDS[{name!r}] should say {first!r}"


def test_listing_the_commands_imports_none_of_them() -> None:
    code = (
        "import sys, outbox.cli\n"
        "from click.testing import CliRunner\n"
        "out = CliRunner().invoke(outbox.cli.cli, ['--help']).output\n"
        "assert 'reconcile' in out, out\n"
        "heavy = [m for m in ('sqlalchemy', 'psycopg', 'outbox.client', 'outbox.cli.deliver')"
        " if m in sys.modules]\n"
        "print(heavy)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_version() -> None:
    from click.testing import CliRunner

    out = CliRunner().invoke(root.cli, ["--version"]).output
    assert out.strip() == f"outbox {__import__('outbox').__version__}"
