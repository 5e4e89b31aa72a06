"""What every command shares: the lazily opened store, and output as a table or as JSON."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from uuid import UUID

import click
from pydantic import BaseModel
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from outbox.errors import DatabaseError

if TYPE_CHECKING:  # imported when a command needs them: `outbox --help` does not
    from outbox.client import Outbox
    from outbox.settings import Settings

__all__ = [
    "STARTUP_RETRY_SECONDS",
    "CliContext",
    "JsonOption",
    "emit",
    "json_option",
    "listening",
    "page_options",
    "page_title",
    "pass_cli",
    "retried_at_startup",
    "run_suffix",
    "short",
    "table",
]

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

# Piped output is read by scripts and logs, not by a narrow terminal: do not wrap it at 80.
console = Console() if Console().is_terminal else Console(width=200)


@dataclass
class CliContext:
    """Options of the root group; opens the store only when a command needs it."""

    dsn: str | None
    home: Path | None
    _outbox: Outbox | None = field(default=None, repr=False)

    @property
    def settings(self) -> Settings:
        from outbox.settings import Settings

        return Settings.from_env(dsn=self.dsn, home=self.home)

    @property
    def outbox(self) -> Outbox:
        if self._outbox is None:
            from outbox.client import Outbox

            with self.starting():
                self._outbox = Outbox.connect(settings=self.settings)
        return self._outbox

    @contextmanager
    def starting(self) -> Iterator[None]:
        """A spinner on stderr while the embedded server starts (created, the first time).

        Nothing shows when a DSN is set, when the server already runs, or when
        stderr is not a terminal.
        """
        settings = self.settings
        if settings.dsn:
            yield
            return
        from outbox.storage.admin.embedded import EmbeddedServer

        try:
            state = EmbeddedServer(settings.home).status()
        except OSError:  # connecting says what is wrong with the home
            state = None
        if state is None or state.running:
            yield
            return
        what = "starting" if state.initialized else "creating (the first time: a few seconds)"
        with Console(stderr=True).status(f"{what} the embedded PostgreSQL in {settings.home}"):
            yield

    def close(self) -> None:
        if self._outbox is not None:
            self._outbox.close()
            self._outbox = None


pass_cli = click.make_pass_decorator(CliContext)


@contextmanager
def listening(host: str, port: int, *, hint: str = "'--host' / '--port'") -> Iterator[None]:
    """Turn a failure to listen (unknown host, address in use) into one line naming the options."""
    try:
        yield
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise click.BadParameter(
            f"cannot listen on {host}:{port}: {reason}", param_hint=hint
        ) from None


def can_listen(host: str, port: int) -> None:
    """Bind and release ``host:port`` (raises ``OSError``), so a server fails before it starts."""
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
        return


class JsonOption(click.Option):
    """``--json``, knowing the model of what the command prints with it."""

    def __init__(self, *args: Any, report: type[BaseModel], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: The report's model: ``emit`` accepts only an instance of it, and its JSON
        #: Schema is exported as ``schemas/report.<command>.json``.
        self.report = report


def json_option(report: type[BaseModel]) -> Callable[[F], F]:
    """``--json`` for a command whose report is an instance of ``report``."""
    if not (isinstance(report, type) and issubclass(report, BaseModel)):
        raise TypeError("json_option(Model): name the pydantic model the command prints")
    return click.option(
        "--json",
        "as_json",
        is_flag=True,
        cls=JsonOption,
        report=report,
        help="Print JSON instead of a table (see docs/reference/json.md).",
    )


def page_options(*, most: int, default: int, noun: str, since: str) -> Callable[[F], F]:
    """``--limit`` and ``--before``: a listing a page at a time, newest first.

    ``noun`` names what is listed ("effects"), ``since`` how the next page
    follows the last row shown ("intended before", "started before").
    """

    def wrap(command: F) -> F:
        command = click.option(
            "--before",
            metavar=f"{noun.rstrip('s').upper()}_ID",
            default=None,
            help=f"The next page: {noun} {since} this one (the last id shown).",
        )(command)
        return click.option(
            "--limit",
            type=click.IntRange(1, most),
            default=default,
            show_default=True,
            help="At most this many.",
        )(command)

    return wrap


def _declared_report() -> type[BaseModel] | None:
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return None
    for param in ctx.command.params:
        if isinstance(param, JsonOption):
            return param.report
    return None


def emit(report: BaseModel, as_json: bool, render: Callable[[], None]) -> None:
    """Print ``report`` as JSON when asked, else call ``render`` (tables for people).

    ``report`` must be an instance of the model the command declared with
    :func:`json_option`, so the printed JSON is what its schema says.
    """
    declared = _declared_report()
    if declared is not None and not isinstance(report, declared):
        raise TypeError(f"{type(report).__name__} printed where {declared.__name__} was declared")
    if as_json:
        click.echo(report.model_dump_json(indent=2))
    else:
        render()


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def short(value: Any, width: int = 60) -> str:
    """A cell: datetimes to the second, long text cut."""
    if value is None:
        return ""
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(value, UUID | Decimal | Enum):
        return str(value.value if isinstance(value, Enum) else value)
    text = value if isinstance(value, str) else json.dumps(_plain(value), default=str)
    return text if len(text) <= width else text[: width - 1] + "…"


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Print a rich table that fits the terminal without breaking an id.

    A column of ids keeps each id whole on one line (copy it, paste it into the
    next command). When the table is wider than the terminal, columns are left
    out from the right (ids and the first two columns stay) and the caption
    says which: ``--json`` or a wider terminal shows them.
    """
    cells = [[short(v) for v in row] for row in rows]
    ids = {i for i in range(len(columns)) if _all_ids([row[i] for row in rows])}
    shown = list(range(len(columns)))
    dropped: list[str] = []
    while True:
        out = Table(title=title, title_justify="left")
        for i in shown:
            if i in ids:
                out.add_column(columns[i], no_wrap=True, min_width=36)
            else:
                out.add_column(columns[i], overflow="fold")
        for row in cells:
            out.add_row(*(row[i] for i in shown))
        if dropped:
            out.caption = f"left out: {', '.join(dropped)} (a wider terminal or --json shows them)"
            out.caption_justify = "left"
        droppable = [i for i in shown[2:] if i not in ids]
        natural = Measurement.get(console, console.options.update_width(100_000), out).maximum
        if not droppable or natural <= console.width:
            break
        shown.remove(droppable[-1])
        dropped.insert(0, columns[droppable[-1]])
    console.print(out)


def _all_ids(values: Sequence[Any]) -> bool:
    present = [v for v in values if v is not None and v != ""]
    return bool(present) and all(isinstance(v, UUID) or _is_uuid_text(v) for v in present)


def _is_uuid_text(value: Any) -> bool:
    if not isinstance(value, str) or len(value) != 36:
        return False
    try:
        UUID(value)
    except ValueError:
        return False
    return True


def page_title(
    what: str, found: Sequence[Any], limit: int, command: str, order: str = "newest first"
) -> str:
    """``effects (100, newest first; more: COMMAND --before ID)``: a listing's title."""
    if len(found) < limit:
        return f"{what} ({len(found)}, {order})"
    return f"{what} ({len(found)}, {order}; more: {command} --before {found[-1].id})"


def run_suffix(run_id: UUID | None) -> str:
    """A run's id in a narrow column: ``…`` and its last 8 hex digits (random, unlike the first)."""
    return f"…{str(run_id)[-8:]}" if run_id is not None else ""


#: How long a daemon's start-up checks are tried again after a connection was lost.
STARTUP_RETRY_SECONDS = 30.0


def retried_at_startup(what: str, step: Callable[[], T]) -> T:
    """Run a start-up step of a daemon; a connection lost meanwhile does not end the process.

    A connection the server cut (a backend terminated, a server restarting: an
    error with a transient SQLSTATE) is tried again, with a backoff, for up to
    :data:`STARTUP_RETRY_SECONDS`, as the running daemon would. A server that
    cannot be reached at all the first time, or any other error, still fails at
    once with its one line, so a wrong DSN is told without delay.
    """
    deadline = time.monotonic() + STARTUP_RETRY_SECONDS
    pause, first = 0.1, True
    while True:
        try:
            return step()
        except DatabaseError as exc:
            # a restart cuts a connection it had accepted with no SQLSTATE: reached too
            reached = exc.sqlstate is not None or exc.connection_lost
            if not exc.transient or (first and not reached) or time.monotonic() > deadline:
                raise
            logging.getLogger("outbox.cli").warning(
                "%s: the connection was lost (%s); trying again in %.1fs", what, exc, pause
            )
        first = False
        time.sleep(pause)
        pause = min(pause * 2, 2.0)
