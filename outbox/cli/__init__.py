"""The ``outbox`` command line: one group, sub-commands in sibling modules."""

from __future__ import annotations

import importlib
import logging
import sys
from pathlib import Path
from typing import NoReturn

import click

from outbox.cli._common import CliContext
from outbox.cli._dsn import choose_dsn
from outbox.errors import MissingExtra, OutboxError

__all__ = ["cli", "commands", "main"]


#: Each command: the module that defines it and the summary ``outbox --help`` shows,
#: so that listing the commands imports none of them (tests/unit/test_cli_lazy.py
#: keeps both in step with the commands themselves).
COMMANDS: dict[str, tuple[str, str]] = {
    "archive": ("db", "Read what `outbox gc --archive` wrote."),
    "audit": ("audit", "Hash chains over steps and attempt logs; signed run records."),
    "check": (
        "check",
        "Kill your agent's workers and deliverers at every crash point; check nothing broke.",
    ),
    "db": ("db", "Manage the embedded PostgreSQL (used when no OUTBOX_DSN is set)."),
    "deliver": (
        "deliver",
        "Deliver pending effects until SIGTERM/SIGINT (then finish in-flight calls and exit 0).",
    ),
    "demo": (
        "demo",
        "Five agent runs, two deliverers, two kill -9s: nothing lost, nothing duplicated.",
    ),
    "effects": ("effects", "Inspect effects and act on them."),
    "gates": ("gates", "Approval gates: which intents wait for a person's approval."),
    "gc": ("db", "Delete (or archive and delete) finished history older than a horizon."),
    "migrate": ("db", "Apply pending migrations (idempotent; safe when run twice at once)."),
    "reconcile": (
        "deliver",
        "Resolve effects whose attempt started but never recorded an end; list the unknown ones.",
    ),
    "relay": (
        "relay",
        "Stream mode: publish pending effects to Kafka for `outbox deliver --from-kafka`.",
    ),
    "roles": (
        "roles",
        "Create or update the agent, deliverer, operator and reader roles and their grants.",
    ),
    "runs": ("runs", "Inspect and control runs: list, show, pause, resume, fork, cancel."),
    "schemas": (
        "schemas",
        "Export or check the JSON Schemas of boundary models and --json reports.",
    ),
    "serve": (
        "worker",
        "Signed signals, the HTTP API (/api/v1), /healthz, /metrics and the console (/console).",
    ),
    "signal": ("worker", "Send a signal (an approval, a webhook's news) to a run."),
    "sink": (
        "worker",
        "A sample HTTP sink that honours Idempotency-Key (GET /stats shows what it applied).",
    ),
    "worker": ("worker", "Execute runs of one agent version until SIGTERM/SIGINT."),
}


class _LazyGroup(click.Group):
    """A group that imports a command's module only when that command runs."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*COMMANDS, *self.commands})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            module = importlib.import_module(f"outbox.cli.{COMMANDS[cmd_name][0]}")
            for command in module.COMMANDS:
                self.add_command(command)
        return self.commands.get(cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(len(name) for name in names)  # as click's own
        # A stand-in with the summary shortens it as the real command would.
        rows = [
            (name, click.Command(name, help=COMMANDS[name][1]).get_short_help_str(limit))
            for name in names
        ]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=_LazyGroup)
@click.version_option(
    package_name="agent-outbox", prog_name="outbox", message="%(prog)s %(version)s"
)
@click.option(
    "--dsn",
    envvar="OUTBOX_DSN",
    default=None,
    help="PostgreSQL DSN. Default: the embedded server in --home. A password here shows "
    "in the process list: prefer OUTBOX_DSN or --dsn-file.",
)
@click.option(
    "--dsn-file",
    envvar="OUTBOX_DSN_FILE",
    default=None,
    type=click.Path(path_type=Path, dir_okay=False),
    help="Read the DSN from this file (a secret mounted 0600, say).",
)
@click.option(
    "--home",
    envvar="OUTBOX_HOME",
    default=None,
    type=click.Path(path_type=Path),
    help="Directory of the embedded server (default ./.outbox).",
)
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
@click.pass_context
def cli(
    ctx: click.Context, dsn: str | None, dsn_file: Path | None, home: Path | None, verbose: int
) -> None:
    """agent-outbox: durable steps and effectively-once side effects for long-running agents."""
    level = {0: logging.WARNING, 1: logging.INFO}.get(verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx.obj = CliContext(dsn=choose_dsn(ctx, dsn, dsn_file), home=home)
    ctx.call_on_close(ctx.obj.close)


def commands(
    command: click.Command | None = None, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], click.Command]]:
    """Every command under ``outbox`` (groups included), depth first, by name.

    Lives here, not with the docs generator (``tools/``): ``outbox schemas``
    finds each command's ``--json`` report model by walking this tree at run time.
    """
    if command is None:
        command = cli
    found = [(path, command)]
    if isinstance(command, click.Group):
        ctx = click.Context(command)
        for name in command.list_commands(ctx):  # loads a lazy group's commands
            sub = command.get_command(ctx, name)
            if sub is not None:
                found += commands(sub, (*path, name))
    return found


def _one_line(text: str) -> str:
    """A driver's message spans lines (DETAIL, HINT): an error is printed on one."""
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def _fail(message: str, code: int = 1) -> NoReturn:
    click.echo(f"error: {_one_line(message)}", err=True)
    sys.exit(code)


def _command_words() -> str:
    """``outbox relay``: the program and the sub-command words typed, options left out."""
    words = []
    for argument in sys.argv[1:]:
        if argument.startswith("-") or not argument.replace("-", "").isalpha():
            break
        words.append(argument)
    return " ".join(["outbox", *words]) if words else ""


def _not_utf8(arguments: list[str]) -> int | None:
    """The position of the first argument that was not UTF-8, if any.

    Python keeps such bytes as lone surrogates, which no database column,
    header or log line can hold.
    """
    for position, argument in enumerate(arguments, start=1):
        try:
            argument.encode()
        except UnicodeEncodeError:
            return position
    return None


def _after_interrupt(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while Ctrl-C was being handled.

    Cleaning up after Ctrl-C can fail in turn (psycopg cancels the query it was
    waiting on, and a late cancel can hit the next statement, the one that stops
    the command's children): the user asked to stop, so that is an abort.
    """
    seen: BaseException | None = exc.__context__
    while seen is not None:
        if isinstance(seen, KeyboardInterrupt | click.exceptions.Abort):
            return True
        seen = seen.__context__
    return False


def _aborted() -> NoReturn:
    click.echo("aborted", err=True)
    sys.exit(130)


def main() -> None:
    """Entry point of the ``outbox`` script: bad input becomes one clear line and exit 1 or 2."""
    position = _not_utf8(sys.argv[1:])
    if position is not None:
        shown = ascii(sys.argv[position])
        _fail(f"argument {position} ({shown}) is not valid UTF-8", code=2)
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        _aborted()
    except click.ClickException as exc:
        if _after_interrupt(exc):
            _aborted()
        hint = ""
        if isinstance(exc, click.UsageError) and exc.ctx is not None:
            hint = f" (see `{exc.ctx.command_path} --help`)"
        _fail(exc.format_message() + hint, code=exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except OutboxError as exc:
        if _after_interrupt(exc):
            _aborted()
        _fail(f"{type(exc).__name__}: {exc}")
    except ImportError as exc:
        # An optional extra's library (kafka for stream mode, cryptography for signed
        # records): one line naming the install, never a traceback.
        missing = MissingExtra.of(exc, _command_words() or "this command")
        if missing is None:
            raise
        _fail(f"{type(missing).__name__}: {missing}")
    except OSError as exc:
        # The environment refused: a file, a directory, an address to listen on.
        _fail(f"{type(exc).__name__}: {exc}")
