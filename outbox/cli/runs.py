"""``outbox runs list|show``: what runs exist and where each one is."""

from __future__ import annotations

import click

from outbox.cli._common import CliContext, console, emit, json_option, pass_cli, table
from outbox.models import RunStatus, real_kind

__all__ = ["COMMANDS"]


@click.group("runs")
def runs() -> None:
    """Inspect runs."""


@runs.command("list")
@click.option("--status", type=click.Choice([s.value for s in RunStatus]), default=None)
@click.option("--agent", default=None)
@click.option("--limit", type=click.IntRange(1, 100_000), default=50, show_default=True)
@json_option
@pass_cli
def runs_list(
    cli: CliContext, status: str | None, agent: str | None, limit: int, as_json: bool
) -> None:
    """List recent runs, newest first."""
    found = cli.outbox.runs(status=status, agent=agent, limit=limit)
    emit(
        found,
        as_json,
        lambda: table(
            f"runs ({len(found)})",
            ["id", "agent", "version", "status", "current step", "budget", "spent", "updated"],
            [
                (
                    r.id,
                    r.agent,
                    r.agent_version,
                    r.status.value,
                    r.current_step,
                    r.budget,
                    r.spent,
                    r.updated_at,
                )
                for r in found
            ],
        ),
    )


@runs.command("show")
@click.argument("run_id")
@json_option
@pass_cli
def runs_show(cli: CliContext, run_id: str, as_json: bool) -> None:
    """Show one run: inputs, state, plan, budget, steps and effects."""
    run = cli.outbox.run(run_id)
    record = run.record
    steps = [run.step(s) for s in run.completed_steps]
    effects = run.effects()
    remaining = None if record.budget is None else record.budget - record.spent - record.reserved
    data = {
        "run": record,
        "budget": {
            "budget": record.budget,
            "spent": record.spent,
            "reserved": record.reserved,
            "remaining": remaining,
        },
        "steps": steps,
        "effects": effects,
        "mode": record.mode.value,
    }

    def render() -> None:
        table(
            f"run {record.id}",
            ["field", "value"],
            [
                ("agent", f"{record.agent} {record.agent_version}"),
                ("mode", record.mode.value),
                ("status", record.status.value),
                ("inputs", record.inputs),
                ("inputs hash", record.inputs_hash),
                ("state", record.state),
                ("plan", record.plan),
                ("current step", record.current_step),
                (
                    "budget / spent / reserved / remaining",
                    f"{record.budget} / {record.spent} / {record.reserved} / {remaining}",
                ),
                ("result", record.result),
                ("error", record.error),
                ("created", record.created_at),
                ("updated", record.updated_at),
            ],
        )
        table(
            "steps",
            ["#", "step", "kind", "result", "completed"],
            [
                (i + 1, s.step_id, s.kind, s.result, s.completed_at)
                for i, s in enumerate(steps)
                if s is not None
            ],
        )
        if record.dry_run:
            table(
                "what would have happened (a dry run: no sink was called)",
                ["step", "#", "kind", "payload", "result (stub)", "status"],
                [
                    (
                        e.step_id,
                        e.step_index,
                        real_kind(e.kind),
                        e.payload,
                        e.result,
                        e.status.value,
                    )
                    for e in effects
                ],
            )
        else:
            table(
                "effects",
                ["id", "step", "kind", "status", "attempt", "key"],
                [
                    (e.id, e.step_id, e.kind, e.status.value, e.attempt, e.idempotency_key[:16])
                    for e in effects
                ],
            )
        console.print()

    emit(data, as_json, render)


@runs.command("cancel")
@click.argument("run_id")
@click.option("--reason", required=True, help="Why (kept on the run).")
@click.option(
    "--wait",
    "wait_seconds",
    type=float,
    default=0.0,
    help="Wait up to this many seconds for compensation to finish.",
)
@json_option
@pass_cli
def runs_cancel(
    cli: CliContext, run_id: str, reason: str, wait_seconds: float, as_json: bool
) -> None:
    """Cancel a run: pending effects cancelled, in-flight ones finish, then compensation."""
    import time

    ob = cli.outbox
    status = ob.cancel(run_id, reason)
    deadline = time.monotonic() + wait_seconds
    while status.value in ("cancelling", "compensating") and time.monotonic() < deadline:
        time.sleep(0.2)
        ob.advance_stopping_runs()
        status = ob.run(run_id).status
    emit(
        {"run_id": run_id, "status": status.value},
        as_json,
        lambda: console.print(f"run {run_id}: {status.value}"),
    )


@runs.command("versions")
@json_option
@pass_cli
def runs_versions(cli: CliContext, as_json: bool) -> None:
    """Unfinished runs per agent version: a version with none left can be retired."""
    rows = cli.outbox.run_versions()
    emit(
        rows,
        as_json,
        lambda: table(
            "unfinished runs by version",
            ["agent", "version", "status", "runs"],
            [(r["agent"], r["version"], r["status"], r["runs"]) for r in rows],
        ),
    )


@runs.command("diff")
@click.argument("run_a")
@click.argument("run_b")
@json_option
@pass_cli
def runs_diff(cli: CliContext, run_a: str, run_b: str, as_json: bool) -> None:
    """Compare the effects two runs intended (exit 1 when they differ, like diff).

    Effects are matched by step and index and compared on kind, payload,
    compensation, ordering key and key; each run's own id is written {run}, so
    a dry run and a real run of the same inputs compare equal.
    """
    import sys

    found = cli.outbox.diff_runs(run_a, run_b)

    def render() -> None:
        if found.identical:
            console.print(f"no difference in intended effects ({found.compared} compared)")
            return
        table(
            f"{len(found.changes)} difference(s) in {found.compared} intended effect(s)",
            ["step", "#", "change", "fields", "A", "B"],
            [(c.step_id, c.index, c.change, ", ".join(c.fields), c.a, c.b) for c in found.changes],
        )

    emit(found.as_dict(), as_json, render)
    if not found.identical:
        sys.exit(1)


COMMANDS = [runs]
