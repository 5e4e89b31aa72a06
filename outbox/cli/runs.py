"""``outbox runs list|show``: what runs exist and where each one is."""

from __future__ import annotations

import itertools

import click

from outbox.cli._common import (
    CliContext,
    console,
    emit,
    json_option,
    page_options,
    page_title,
    pass_cli,
    short,
    table,
)
from outbox.cli.reports import (
    Budget,
    CancelReport,
    ForkReport,
    PauseReport,
    ResumeReport,
    RunDetailReport,
    RunDiffReport,
    RunListReport,
    VersionsReport,
)
from outbox.models import RunStatus, real_kind
from outbox.validation import as_uuid

__all__ = ["COMMANDS"]


@click.group("runs")
def runs() -> None:
    """Inspect and control runs: list, show, pause, resume, fork, cancel."""


@runs.command("list")
@click.option(
    "--status",
    type=click.Choice([s.value for s in RunStatus]),
    default=None,
    help="Only runs in this status.",
)
@click.option("--agent", default=None, help="Only runs of this agent.")
@page_options(most=100_000, default=50, noun="runs", since="started before")
@json_option(RunListReport)
@pass_cli
def runs_list(
    cli: CliContext,
    status: str | None,
    agent: str | None,
    limit: int,
    before: str | None,
    as_json: bool,
) -> None:
    """List recent runs, newest first, a page at a time (--limit, --before)."""
    from outbox.client_core import run_filters

    filters = run_filters(status=status, agent=agent, limit=limit)
    if before is not None:
        filters["before"] = as_uuid(before, "before")
    found = cli.outbox.store.list_runs(**filters)
    emit(
        RunListReport(found),
        as_json,
        lambda: table(
            page_title("runs", found, limit, "outbox runs list"),
            # What matters most first: a narrow terminal leaves out columns from the right.
            ["id", "status", "agent", "version", "current step", "budget", "spent", "updated"],
            [
                (
                    r.id,
                    r.status.value,
                    r.agent,
                    r.agent_version,
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
@json_option(RunDetailReport)
@pass_cli
def runs_show(cli: CliContext, run_id: str, as_json: bool) -> None:
    """Show one run: inputs, state, plan, budget, steps and effects."""
    run = cli.outbox.run(run_id)
    record = run.record
    steps = [s for s in (run.step(s) for s in run.completed_steps) if s is not None]
    effects = run.effects()
    remaining = None if record.budget is None else record.budget - record.spent - record.reserved
    data = RunDetailReport(
        run=record,
        budget=Budget(
            budget=record.budget,
            spent=record.spent,
            reserved=record.reserved,
            remaining=remaining,
        ),
        steps=steps,
        effects=effects,
        mode=record.mode,
    )

    def render() -> None:
        table(
            f"run {record.id}",
            ["field", "value"],
            [
                ("agent", f"{record.agent} {record.agent_version}"),
                ("mode", record.mode.value),
                ("status", record.status.value),
                *(
                    [("paused", f"since {short(record.paused_at)}: {record.pause_reason}")]
                    if record.paused_at is not None
                    else []
                ),
                ("key", record.key),
                ("priority / fairness key", f"{record.priority} / {record.fairness_key!r}"),
                *(
                    [("forked from", f"{record.forked_from} at step {record.forked_at_step}")]
                    if record.forked_from is not None
                    else []
                ),
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
            [(i + 1, s.step_id, s.kind, s.result, s.completed_at) for i, s in enumerate(steps)],
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
@click.option(
    "--reason",
    required=True,
    help="Why (kept on the run and in the attempt log of each effect it cancels).",
)
@click.option("--by", "operator", default=None, help="Who cancels it (default: your user).")
@click.option(
    "--wait",
    "wait_seconds",
    type=float,
    default=0.0,
    help="Wait up to this many seconds for compensation to finish.",
)
@json_option(CancelReport)
@pass_cli
def runs_cancel(
    cli: CliContext,
    run_id: str,
    reason: str,
    operator: str | None,
    wait_seconds: float,
    as_json: bool,
) -> None:
    """Cancel a run: pending effects cancelled, in-flight ones finish, then compensation.

    Each effect it cancels gets a row in its attempt log (outcome "cancelled")
    with who (--by) and why (--reason), via "cli".
    """
    import time

    ob = cli.outbox
    status = ob.cancel(run_id, reason, by=operator, via="cli")
    deadline = time.monotonic() + wait_seconds
    while status.value in ("cancelling", "compensating") and time.monotonic() < deadline:
        time.sleep(0.2)
        ob.advance_stopping_runs()
        status = ob.run(run_id).status
    emit(
        CancelReport(run_id=as_uuid(run_id, "run_id"), status=status),
        as_json,
        lambda: console.print(f"run {run_id}: {status.value}"),
    )


@runs.command("pause")
@click.argument("run_id")
@click.option("--reason", required=True, help="Why (kept on the run until it is resumed).")
@json_option(PauseReport)
@pass_cli
def runs_pause(cli: CliContext, run_id: str, reason: str, as_json: bool) -> None:
    """Pause a run: not claimed by workers, its effects not started by deliverers.

    Work in flight finishes and is recorded: the step a worker is in, then the
    worker lets the run go (status "running" until then); attempts already
    made get their outcome recorded. `outbox runs resume` goes on.
    """
    status = cli.outbox.pause(run_id, reason)
    note = "paused" if status.value == "paused" else "pausing: the step in flight finishes first"
    emit(
        PauseReport(run_id=as_uuid(run_id, "run_id"), status=status, reason=reason),
        as_json,
        lambda: console.print(f"run {run_id}: {note}"),
    )


@runs.command("resume")
@click.argument("run_id")
@json_option(ResumeReport)
@pass_cli
def runs_resume(cli: CliContext, run_id: str, as_json: bool) -> None:
    """Resume a paused run: runnable again, its held effects delivered.

    A run that was waiting re-checks its wait: a deadline that passed while
    paused is acted on now, a signal sent meanwhile is consumed now.
    """
    status = cli.outbox.resume(run_id)
    emit(
        ResumeReport(run_id=as_uuid(run_id, "run_id"), status=status),
        as_json,
        lambda: console.print(f"run {run_id}: {status.value}"),
    )


@runs.command("fork")
@click.argument("run_id")
@click.option(
    "--from",
    "from_step",
    required=True,
    metavar="STEP",
    help="The first step the fork runs anew (the steps before it replay the original's).",
)
@click.option(
    "--version",
    default=None,
    help="Agent version the fork is pinned to (default: the original's).",
)
@click.option(
    "--allow-unsettled",
    is_flag=True,
    help="Fork even when STEP or a later step has an effect that may already have taken "
    "effect (unknown, in_flight, dispatched): the fork intends it again under a new key.",
)
@json_option(ForkReport)
@pass_cli
def runs_fork(
    cli: CliContext,
    run_id: str,
    from_step: str,
    version: str | None,
    allow_unsettled: bool,
    as_json: bool,
) -> None:
    """Restart a run from a step, as a new run linked to it; the original is not changed.

    The fork replays the original's recorded steps before STEP without calling
    their functions (what they intended is not intended again) and runs STEP
    and the steps after it for real, with new idempotency keys. STEP may be the
    step a failed run failed at. It is refused, listing them, when an effect of
    STEP or a later step may already have taken effect (unknown, in_flight,
    dispatched): settle those first, or pass --allow-unsettled.
    """
    fork = cli.outbox.fork(run_id, from_step, version=version, allow_unsettled=allow_unsettled)
    record = fork.record
    assert record.forked_from is not None  # a fork always names its original
    data = ForkReport(
        run_id=record.id,
        forked_from=record.forked_from,
        from_step=from_step,
        version=record.agent_version,
        # The fork is committed before its handle is read, so a worker may already have
        # run from_step and later ones: the replayed steps are those before it.
        replayed_steps=list(itertools.takewhile(lambda s: s != from_step, fork.completed_steps)),
        status=record.status,
    )
    emit(
        data,
        as_json,
        lambda: console.print(
            f"run {record.id} forked from {record.forked_from} at step {from_step!r} "
            f"({record.agent} {record.agent_version}; {len(data.replayed_steps)} step(s) replay)"
        ),
    )


@runs.command("versions")
@json_option(VersionsReport)
@pass_cli
def runs_versions(cli: CliContext, as_json: bool) -> None:
    """Unfinished runs per agent version: a version with none left can be retired."""
    rows = cli.outbox.run_versions()
    emit(
        VersionsReport.model_validate(rows),
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
@json_option(RunDiffReport)
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

    emit(RunDiffReport.model_validate(found.as_dict()), as_json, render)
    if not found.identical:
        sys.exit(1)


COMMANDS = [runs]
