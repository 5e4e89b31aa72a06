"""``outbox check``: the crash-consistency kit, run on the user's own agent."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import click
import pydantic
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from outbox.cli._common import console, emit, json_option
from outbox.cli.reports import CheckReport

__all__ = ["COMMANDS"]


def _json(value: str, param: str) -> Any:
    try:
        return json.loads(value)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint=param) from None


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _signals(raw: tuple[str, ...]) -> dict[str, Any]:
    signals: dict[str, Any] = {}
    for item in raw:
        name, sep, payload = item.partition("=")
        if not sep or not name:
            raise click.BadParameter(f"{item!r}: expected NAME=JSON", param_hint="--signal")
        signals[name] = _json(payload, f"--signal {name}")
    return signals


@click.command("check")
@click.argument("handler_path", metavar="MODULE:FUNCTION")
@click.option("--agent", required=True, help="Agent name the runs are started under.")
@click.option("--version", "version", required=True, help="Agent version being checked.")
@click.option("--inputs", default="{}", show_default=True, help="Inputs of each run, as JSON.")
@click.option(
    "--runs", type=click.IntRange(1, 50), default=1, show_default=True, help="Runs per trial."
)
@click.option(
    "--sink",
    type=click.Choice(["record", "real"]),
    default="record",
    show_default=True,
    help="record: a recording sink stands in for every kind; real: your deliverers config.",
)
@click.option(
    "--config",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    envvar="OUTBOX_DELIVERERS_CONFIG",
    default=None,
    help="Deliverers config (real: used; record: its idempotent/lookup declarations).",
)
@click.option(
    "--dsn",
    "check_dsn",
    default=None,
    help="Make scratch databases on this server (needs CREATEDB). "
    "Default: a temporary embedded PostgreSQL (your .outbox is not touched).",
)
@click.option(
    "--signal",
    "signals",
    multiple=True,
    metavar="NAME=JSON",
    help="Send this signal to a run that waits for it (repeatable).",
)
@click.option("--upgrade-to", default=None, metavar="W", help="Also hand runs over to version W.")
@click.option(
    "--setup",
    default=None,
    metavar="MODULE:FUNCTION",
    help="Called with the Outbox by version-W workers (registers the upgrade).",
)
@click.option(
    "--upgrade-handler",
    default=None,
    metavar="MODULE:FUNCTION",
    help="Version W's handler (default: the same one).",
)
@click.option(
    "--only",
    multiple=True,
    metavar="TRIAL",
    help="Only this trial: a crash point, or point@step as the report names it (repeatable).",
)
@click.option(
    "--jobs", type=click.IntRange(1, 32), default=4, show_default=True, help="Trials at once."
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=1, max=3600),
    default=120.0,
    show_default=True,
    help="Seconds a trial may go with nothing moving before it is reported as stuck.",
)
@click.option(
    "--allow-nondeterministic-result",
    is_flag=True,
    help="Your agent's results legitimately vary between runs of the same inputs: do not "
    "compare them (by default two uninterrupted runs that end differently are a violation).",
)
@click.option("--keep-logs", is_flag=True, help="Keep the processes' logs even when it passes.")
@json_option(CheckReport)
def check(
    handler_path: str,
    agent: str,
    version: str,
    inputs: str,
    runs: int,
    sink: str,
    config: Path | None,
    check_dsn: str | None,
    signals: tuple[str, ...],
    upgrade_to: str | None,
    setup: str | None,
    upgrade_handler: str | None,
    only: tuple[str, ...],
    jobs: int,
    timeout: float,
    allow_nondeterministic_result: bool,
    keep_logs: bool,
    as_json: bool,
) -> None:
    """Kill your agent's workers and deliverers at every crash point; check nothing broke.

    Exits 1 when any crash point shows a violation (the report names the first,
    explains it, and prints the command that reproduces it alone).
    """
    from outbox.check.check import check_agent
    from outbox.check.plan import CheckOptions
    from outbox.check.report import render

    # A SIGTERM (a CI job's timeout, a service manager) ends the check as a ^C does:
    # its processes are killed and its scratch server and databases go, not left behind.
    signal.signal(signal.SIGTERM, _interrupted)

    try:
        options = CheckOptions(
            handler=handler_path,
            agent=agent,
            version=version,
            inputs=_json(inputs, "--inputs"),
            runs=runs,
            sink=sink,
            dsn=check_dsn,
            config=config,
            signals=_signals(signals),
            upgrade_to=upgrade_to,
            setup=setup,
            upgrade_handler=upgrade_handler,
            only=only,
            jobs=jobs,
            timeout=timeout,
            allow_nondeterministic_result=allow_nondeterministic_result,
        )
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "options"
        shown = f"={first['input']!r}" if first["loc"] else ""
        message = str(first["msg"]).removeprefix("Value error, ")
        raise click.UsageError(f"{where}{shown}: {message}") from None

    # Under --json, stdout is the report alone (a CI job redirects it to a file); the
    # progress goes to stderr, so a person watching the job still sees it move.
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True) if as_json else console,
        transient=True,
    )
    with progress:
        task = progress.add_task("preparing", total=None)
        done = 0

        def phase(what: str) -> None:
            progress.update(task, description=what)

        def advance(result: Any, planned: int) -> None:
            nonlocal done
            done += 1
            progress.update(task, total=planned, completed=done)
            mark = "[green]ok[/]" if result.ok else "[red]FAILED[/]"
            progress.console.print(f"  {result.plan.id}: {mark} ({result.seconds:.1f} s)")

        report = check_agent(options, progress=advance, keep_logs=keep_logs, phase=phase)
    emit(CheckReport.model_validate(report.as_dict()), as_json, lambda: render(report, console))
    if not report.ok:
        raise SystemExit(1)


COMMANDS = [check]
