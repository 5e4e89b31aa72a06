"""``outbox demo``: real agents, real deliverers, real crashes, and a tally at the end.

On the embedded default, with no set-up: a local HTTP sink that honours
``Idempotency-Key`` (and answers 429 a few times), two ``outbox deliver``
processes, and five runs:

- three invoice reconciliations, each in its own agent process; one agent is
  killed with SIGKILL mid-run and started again; one deliverer is killed with
  SIGKILL while it holds calls in flight, and a new one takes its place;
- a vendor payment that waits for the CFO's approval (a signal), at zero
  compute, then pays;
- a trip booking that is cancelled after its bookings went through: the
  bookings are compensated (refunded) in reverse order.

The tally compares what was intended with what the sink applied. The demo
waits for and counts its own runs and their effects only, so a database reused
after the quickstart or after a demo stopped with Ctrl-C does not hold it up
(:mod:`outbox.cli.demo_story`); a deliverer it did not start that delivers some
of its effects is named, and counted apart.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from outbox.cli._common import CliContext, console, emit, json_option, pass_cli, table
from outbox.cli.reports import DemoReport

if TYPE_CHECKING:  # the story imports the client: `outbox demo --help` does not
    from outbox.cli.demo_story import Demo, Snapshot

__all__ = ["COMMANDS"]

TIME_LIMIT = 120.0


@click.command("demo")
@click.option("--keep-logs", is_flag=True, help="Keep the child processes' logs and say where.")
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=TIME_LIMIT,
    show_default=True,
    help="Give up after this many seconds, saying what the demo was still waiting for.",
)
@json_option(DemoReport)
@pass_cli
def demo(cli: CliContext, keep_logs: bool, timeout: float, as_json: bool) -> None:
    """Five agent runs, two deliverers, two kill -9s: nothing lost, nothing duplicated."""
    from deliverers.testing import IdempotentHttpSink
    from outbox.cli.demo_story import Demo

    ob = cli.outbox
    workdir = Path(tempfile.mkdtemp(prefix="outbox-demo-"))
    config = workdir / "deliverers.toml"
    config.write_text('[kinds."http.request"]\nallow_private = ["127.0.0.1"]\n')
    env = {
        **os.environ,
        "OUTBOX_DSN": ob.engine.url.render_as_string(hide_password=False),
        "PYTHONUNBUFFERED": "1",
    }
    deliver_args = [
        "outbox",
        "deliver",
        "--config",
        str(config),
        "--concurrency",
        "16",
        "--lease",
        "2",
        "--poll",
        "0.5",
        "--grace",
        "5",
    ]
    started = time.monotonic()
    failure: str | None = None
    with IdempotentHttpSink(latency=0.03) as sink:
        story = Demo(ob, sink, workdir, env, deliver_args)
        progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(bar_width=20),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("[dim]{task.fields[detail]}"),
            console=console,
            disable=as_json,
        )
        now: Snapshot | None = None
        try:
            with progress:
                story.look_for_other_deliverers()
                story.start()
                runs_task = progress.add_task("runs", total=len(story.run_ids), detail="")
                effects_task = progress.add_task("effects", total=None, detail="")
                while True:
                    now = story.look()
                    story.advance(now)
                    for note in story.notes:
                        _note(note, as_json)
                    story.notes.clear()
                    if story.finished(now):
                        break
                    runs_waiting, effects_waiting = story.waiting_for(now)
                    progress.update(
                        runs_task,
                        completed=len(story.run_ids) - len(runs_waiting),
                        detail=f"waiting for {', '.join(runs_waiting)}" if runs_waiting else "",
                    )
                    progress.update(
                        effects_task,
                        total=max(now.effects_intended, 1),
                        completed=now.effects_done,
                        detail=f"waiting for {effects_waiting}" if effects_waiting else "",
                    )
                    story.check_processes()
                    if time.monotonic() - started > timeout:
                        waiting = "; ".join(
                            w for w in (", ".join(runs_waiting), effects_waiting) if w
                        )
                        raise click.ClickException(
                            f"demo did not finish in {timeout:g}s: still waiting for "
                            f"{waiting}; logs in {workdir}"
                        )
                    time.sleep(0.05)
                progress.update(runs_task, completed=len(story.run_ids), detail="")
                progress.update(
                    effects_task, total=now.effects_intended, completed=now.effects_done, detail=""
                )
                story.unfinished_stories()
        except click.ClickException as exc:
            failure = exc.format_message()
        finally:
            story.stop()
        stats = sink.stats(keys=story.own_keys())
    summary = _summary(story, stats, time.monotonic() - started, failure)
    if not keep_logs and failure is None:
        for path in workdir.iterdir():
            path.unlink()
        workdir.rmdir()
    kept = workdir if keep_logs or failure else None
    embedded = None if cli.settings.dsn else cli.settings.home
    emit(summary, as_json, lambda: _render(summary, kept, embedded))
    if failure is not None:
        raise click.ClickException(failure)
    if summary.duplicates_applied_at_sink or summary.lost or summary.phantom:
        raise click.ClickException(
            f"{summary.lost} lost, {summary.duplicates_applied_at_sink} applied twice, "
            f"{summary.phantom} applied but not recorded; logs: rerun with --keep-logs"
        )


def _note(text: str, as_json: bool) -> None:
    """Tell the user something as it happens (on stderr under ``--json``)."""
    if as_json:
        click.echo(text, err=True)
    else:
        console.print(f"[yellow]{text}[/]")


def _summary(story: Demo, stats: dict[str, Any], seconds: float, error: str | None) -> DemoReport:
    now = story.look()
    tally = now.tally
    intended = now.effects_intended
    # compensated effects were applied, then undone by their refunds
    applied = tally["status"].get("succeeded", 0) + tally["status"].get("compensated", 0)
    statuses = [s.value for s in now.statuses.values()]
    runs_waiting, effects_waiting = story.waiting_for(now)
    return DemoReport(
        finished=error is None,
        error=error,
        waiting_for=[*runs_waiting, *([f"effects: {effects_waiting}"] if effects_waiting else [])],
        runs=len(story.run_ids),
        runs_completed=statuses.count("completed"),
        runs_compensated=statuses.count("compensated"),
        effects_intended=intended,
        effects_delivered=applied,
        attempts_retried=tally["outcome"].get("retry", 0),
        attempts_recovered_after_crash=tally["outcome"].get("expired", 0),
        redeliveries_seen_by_sink=stats["redeliveries"],
        duplicates_applied_at_sink=len(stats["duplicate_keys_applied"])
        + len(stats["duplicate_operations"]),
        # Open effects of a demo that did not finish are neither lost nor delivered yet.
        lost=0 if error else (intended - applied) + max(0, applied - stats["keys_applied"]),
        phantom=max(0, stats["keys_applied"] - applied),
        other_deliverers=sorted(story.others),
        delivered_by_other_deliverers=sum(story.others.values()),
        seconds=round(seconds, 1),
        events=story.events,
    )


def _render(summary: DemoReport, logs: Path | None, embedded: Path | None) -> None:
    for event in summary.events:
        console.print(f"  • {event}")
    table(
        "demo summary",
        ["", "count"],
        [
            ("runs completed", f"{summary.runs_completed} / {summary.runs}"),
            ("runs cancelled and compensated", summary.runs_compensated),
            ("effects intended", summary.effects_intended),
            ("effects delivered", summary.effects_delivered),
            ("  by deliverers the demo did not start", summary.delivered_by_other_deliverers),
            ("attempts retried (429 from the sink)", summary.attempts_retried),
            (
                "attempts recovered after the deliverer was killed",
                summary.attempts_recovered_after_crash,
            ),
            ("redeliveries the sink deduplicated", summary.redeliveries_seen_by_sink),
            ("duplicates applied at the sink", summary.duplicates_applied_at_sink),
            ("lost", summary.lost),
            ("seconds", summary.seconds),
        ],
    )
    if logs is not None:
        console.print(f"logs: {logs}")
    if embedded is not None:
        console.print(
            f"[dim]The embedded PostgreSQL in {embedded} keeps running, so the next command "
            "starts at once: `outbox db stop` stops it.[/]"
        )


COMMANDS = [demo]
