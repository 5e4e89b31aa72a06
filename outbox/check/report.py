"""The report of a check: crash point x outcome, the first violation explained, how to reproduce it.

:class:`CheckReport` holds the trials; :meth:`CheckReport.rows` is the table a
person reads, :meth:`CheckReport.as_dict` the JSON a CI job keeps, and
:func:`render` prints it with rich.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from outbox.check.compare import GLOBAL, split
from outbox.check.crash import CRASH_POINTS, DELIVERER_POINTS, UPGRADE_POINTS, WORKER_POINTS
from outbox.check.crash import target as crash_target
from outbox.check.invariants import Applied
from outbox.check.plan import CheckOptions, TrialPlan
from outbox.check.trial import Crash, TrialResult

__all__ = ["CheckReport", "Row", "Violation", "explain", "render"]

#: Why a violation happens, and what to change; by kind.
WHY = {
    "duplicate_operations": (
        "one business operation took effect more often than in an uninterrupted run."
    ),
    "duplicate_intents": (
        "the run intended one operation under two keys, so no sink can tell them apart: "
        "a step id that changes between attempts (a time, a random value, a counter kept "
        "in memory), or the same operation intended from two steps, does that. "
        "Keep step ids stable and intend each operation in one step."
    ),
    "duplicate_keys": (
        "the sink applied one idempotency key twice: an effect was sent again to a sink that "
        "cannot dedup it. Declare a kind idempotent only when its sink dedups on the key."
    ),
    "lost": (
        "an intent was left pending or in flight, or an operation of the uninterrupted run "
        "was never intended after the crash."
    ),
    "phantoms": "something took effect at the sink that no intent stands for.",
    "regressed": "an effect recorded as done changed afterwards.",
    "reran": (
        "a recorded step's function ran after its step had committed: on resume it should "
        "have returned the recorded result instead."
    ),
    "result_differs": (
        "the run ended differently from an uninterrupted run of the same inputs. Code outside "
        "recorded steps that reads the clock, randomness or changing data does that: record "
        "such reads with run.call(...)."
    ),
    "unfinished": "the run did not end.",
    "nondeterministic_result": (
        "runs of the same inputs, started side by side in a reference trial (the uninterrupted "
        "one, or a hand-over), ended differently, so a crashed run has nothing to be compared "
        "with. Code outside recorded steps that reads the clock, randomness or changing data "
        "does that, and reads it again when a crashed run resumes: record such reads with "
        "run.call(...). If the result is meant to vary from run to run (a timestamp or a "
        "random draw already recorded in a step), pass --allow-nondeterministic-result "
        "(allow_nondeterministic_result=True): results are then not compared at all."
    ),
    "error": "the trial could not be carried out.",
    "reference_failed": (
        "the uninterrupted run itself did not complete, so there is nothing to compare a "
        'crashed run with: every crash would "end as it does uninterrupted". Make the '
        "agent complete with these inputs (its error is above), or check it with inputs "
        "it completes with."
    ),
    "unstable_step_ids": (
        "two runs of the same inputs, side by side, recorded different step ids. A step id "
        "computed from the clock, randomness or a counter kept in memory changes between "
        "attempts too: a resumed run records the step again under a new id, and intends its "
        "operations again under new keys, which no sink can tell apart. Keep step ids "
        "stable (a name, or one built from the inputs or from run.id) and intend each "
        "operation in one step."
    ),
    "not_reached": (
        "a crash point the uninterrupted run reached was never reached in this trial, so "
        "what a crash there does was not tried. The run took another path after a restart: "
        "a step id or a branch that depends on the process, the clock, randomness or "
        "changing data read outside a recorded step. Keep step ids stable and record such "
        "reads with run.call(...)."
    ),
}

SKIPPED = "not selected by --only"

KEYLESS = (
    "reached the sink without an idempotency key, so nothing can tell the second call "
    "from the first: it was made by the agent's own code (outside tx.intend), which runs "
    "again when a crashed run resumes. Intend it in a step instead: "
    "run.transaction(step, lambda tx: tx.intend(kind, payload))."
)
IN_A_CALL = (
    "was made by the function of recorded step {step!r}, and that function runs again when "
    "the process dies before its result is recorded (a step's function runs at least once, "
    "not exactly once: run.call is for reads). Intend the operation in a step instead: a "
    "deliverer then sends it with a stable idempotency key."
)
RUN_LESS = (
    "It was intended outside the run's steps (Outbox.transaction), with a new random key "
    "each time: that code runs again when a crashed run resumes, and intends the operation "
    "again under a key no sink has seen. Intend it in a step (run.transaction(step, lambda "
    "tx: tx.intend(kind, payload))), or give it a key of its own derived from the run "
    "(key=f'{run.id}:charge')."
)


@dataclass(frozen=True)
class Violation:
    """The first violation of a check, explained."""

    trial: str
    point: str
    where: str | None
    kind: str
    detail: str
    explanation: str
    reproduce: str
    logs: str | None
    #: What a failed process wrote last (for an ``error``).
    output: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-able."""
        return dict(self.__dict__)


@dataclass(frozen=True)
class Row:
    """One line of the table: a crash point (at one place), and what came of it."""

    point: str
    role: str
    where: str
    outcome: str
    detail: str
    trial: str

    def as_dict(self) -> dict[str, Any]:
        """JSON-able."""
        return dict(self.__dict__)


def _readable(operation: str) -> str:
    tag, masked = split(operation)
    return masked if tag == GLOBAL else f"{masked} (run {tag[:8]})"


def _humanize(kind: str, item: str, result: TrialResult) -> str:
    """A violation's text with tagged operations spelled for people."""
    if kind in ("duplicate_operations", "duplicate_intents"):
        applied = sum(1 for a in result.applied if a.operation == item)
        intended = sum(1 for i in result.intents if i.operation == item)
        return f"operation {_readable(item)}: intended {intended}x, applied {applied}x"
    return item


def explain(kind: str, item: str, result: TrialResult) -> str:
    """Why this violation happened, as far as the evidence tells."""
    if kind == "duplicate_operations":
        keyless = [a for a in result.applied if a.operation == item and a.key is None]
        if keyless:
            step = _inside_step(keyless, result)
            return "It " + (KEYLESS if step is None else IN_A_CALL.format(step=step))
    if kind in ("duplicate_operations", "duplicate_intents"):
        intents = [i for i in result.intents if i.operation == item]
        if len(intents) > 1 and any(i.run is None for i in intents):
            return RUN_LESS
        if len(intents) > 1:
            return WHY["duplicate_intents"]
    return WHY.get(kind, "")


def _inside_step(applied: list[Applied], result: TrialResult) -> str | None:
    """The recorded step whose function was running when one of these took effect, if any.

    A function runs from its ``step_start`` to its ``step_end`` event in one
    process; in a process killed in between, until its last event (the kill).
    """
    open_steps: dict[int, tuple[str, float]] = {}
    last: dict[int, float] = {}
    spans: list[tuple[str, float, float]] = []
    for event in result.events:
        last[event.pid] = event.t
        if event.point == "step_start" and event.where is not None:
            open_steps[event.pid] = (event.where, event.t)
        elif event.point == "step_end" and event.pid in open_steps:
            where, began = open_steps.pop(event.pid)
            spans.append((where, began, event.t))
    spans += [(where, began, last[pid]) for pid, (where, began) in open_steps.items()]
    for a in applied:
        for where, began, ended in spans:
            if a.t is not None and began <= a.t <= ended:
                return where
    return None


def _violation(result: TrialResult, options: CheckOptions) -> Violation:
    plan = result.plan
    point = plan.point or plan.id
    where = plan.targets[0] if len(plan.targets) == 1 else None
    output = None
    if result.error is not None:
        first_line, _, output = result.error.partition("\n")
        kind, detail, why = "error", first_line, WHY["error"]
    else:
        first = result.report.first()
        assert first is not None
        kind, item = first
        detail = f"{kind}: {_humanize(kind, item, result)}"
        why = explain(kind, item, result)
    when = CRASH_POINTS[point].when if point in CRASH_POINTS else "no crash"
    crashed = (
        ", ".join(f"{c.point}@{c.where}" if c.where else c.point for c in result.crashes)
        or "nothing"
    )
    return Violation(
        trial=plan.id,
        point=point,
        where=where,
        kind=kind,
        detail=f"{detail} (killed: {crashed}; {when})",
        explanation=why,
        reproduce=options.command(only=None if plan.role == "baseline" else plan.id),
        logs=None if result.logs is None else str(result.logs),
        output=output.strip() or None if output else None,
    )


def _crash_detail(result: TrialResult, point: str, where: str) -> tuple[str, str]:
    """(outcome, detail) of one crash of a trial that passed."""
    crash = next((c for c in result.crashes if c.point == point and c.where == where), None)
    if crash is None:
        # A planned target no process reached fails its trial (not_reached); a passing
        # trial without this crash means another one of its chain ended the run first.
        return "not reached", "no worker died here in this trial"
    if point == "parked":
        return "ok", "parked, worker killed; woken and resumed by another worker"
    ran = result.started.get((crash.run or "", where), 0)
    replayed = "replayed, not re-run" if ran <= 1 else f"function ran {ran}x (not recorded before)"
    return "ok", f"worker {crash.pid} killed; resumed; {replayed}"


@dataclass
class CheckReport:
    """Everything a check found."""

    options: CheckOptions
    baseline: TrialResult | None = None
    #: Every trial the uninterrupted run called for (before ``--only`` chose).
    planned: list[TrialPlan] = field(default_factory=list)
    results: list[TrialResult] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0
    #: Whether runs' results were compared with the uninterrupted run's (not when they
    #: were allowed to vary, and did).
    results_compared: bool = True

    def _by_id(self) -> dict[str, TrialResult]:
        return {r.plan.id: r for r in self.results}

    @property
    def failed(self) -> list[TrialResult]:
        """Trials that failed, the baseline first."""
        out = [r for r in [self.baseline, *self.results] if r is not None and not r.ok]
        return out

    @property
    def ok(self) -> bool:
        """No violation, and every trial ran."""
        return self.baseline is not None and not self.failed

    def first_violation(self) -> Violation | None:
        """The first failing trial in table order, a single crash rather than a chain."""
        if self.baseline is not None and not self.baseline.ok:
            return _violation(self.baseline, self.options)
        by_id = self._by_id()
        for row in self.rows():
            if row.outcome in ("VIOLATION", "error"):
                return _violation(by_id[row.trial], self.options)
        failed = [r for r in self.results if not r.ok]
        return _violation(failed[0], self.options) if failed else None

    def rows(self) -> list[Row]:
        """Crash point x outcome, in catalogue order."""
        by_id = self._by_id()
        planned = {p.id: p for p in self.planned}
        rows: list[Row] = []
        for point in WORKER_POINTS:
            plan = planned.get(point.name)
            if plan is None:
                rows.append(
                    Row(point.name, "worker", "-", "not reached", _never(point.name), point.name)
                )
                continue
            chain = by_id.get(point.name)
            tried = {r.plan.targets[0] for r in self.results if r.plan.point == point.name}
            if chain is None and not tried:
                steps = f"{len(plan.targets)} step(s)"
                rows.append(Row(point.name, "worker", steps, "skipped", SKIPPED, point.name))
                continue
            singles = {
                r.plan.targets[0]: r
                for r in self.results
                if r.plan.role == "worker"
                and r.plan.point == point.name
                and r.plan is not plan
                and r.plan.id != point.name
            }
            for where in plan.targets:
                single = singles.get(where)
                trial_id = crash_target(point.name, where)
                if single is not None:
                    rows.append(_row(point.name, "worker", where, single, trial_id))
                elif chain is None:
                    rows.append(Row(point.name, "worker", where, "skipped", SKIPPED, trial_id))
                elif chain.ok:
                    outcome, detail = _crash_detail(chain, point.name, where)
                    rows.append(Row(point.name, "worker", where, outcome, detail, chain.plan.id))
                else:
                    failed = _row(point.name, "worker", where, chain, chain.plan.id)
                    rows.append(
                        Row(
                            point.name,
                            "worker",
                            where,
                            failed.outcome if chain.error else "chain failed",
                            f"crashed at every step in turn: {failed.detail}",
                            chain.plan.id,
                        )
                    )
        names = [(p.name, "deliverer") for p in DELIVERER_POINTS]
        if self.options.upgrade_to is not None:
            names += [("handover", "upgrade"), *((p.name, "upgrade") for p in UPGRADE_POINTS)]
        for name, role in names:
            result = by_id.get(name)
            where = (
                "first time"
                if role == "deliverer"
                else f"{self.options.version}->{self.options.upgrade_to}"
            )
            handover = by_id.get("handover")
            if result is not None:
                rows.append(_row(name, role, where, result, name))
            elif role == "upgrade" and handover is not None and not handover.ok:
                rows.append(Row(name, role, where, "skipped", "the hand-over itself failed", name))
            elif name in planned:
                rows.append(Row(name, role, where, "skipped", SKIPPED, name))
            else:
                rows.append(Row(name, role, "-", "not reached", _never(name), name))
        return rows

    def as_dict(self) -> dict[str, Any]:
        """The report for machines (``--json``)."""
        first = self.first_violation()
        return {
            "ok": self.ok,
            "handler": self.options.handler,
            "agent": self.options.agent,
            "version": self.options.version,
            "runs_per_trial": self.options.runs,
            "sink": self.options.sink,
            "seconds": round(self.seconds, 1),
            "trials": [
                {
                    "id": r.plan.id,
                    "ok": r.ok,
                    "seconds": round(r.seconds, 1),
                    "crashes": [target_of(c) for c in r.crashes],
                }
                for r in [*([self.baseline] if self.baseline else []), *self.results]
            ],
            "crashes": sum(len(r.crashes) for r in self.results),
            "rows": [r.as_dict() for r in self.rows()],
            "first_violation": None if first is None else first.as_dict(),
            "violations": {
                r.plan.id: {k: v for k, v in r.report.counts().items() if v}
                | ({"error": 1} if r.error else {})
                for r in self.failed
            },
            "warnings": self.warnings,
            "command": self.options.command(),
        }


def target_of(crash: Crash) -> str:
    """``point@where`` of a crash."""
    return crash_target(crash.point, crash.where)


def _never(point: str) -> str:
    if point == "parked":
        return "the agent never waits"
    if point in ("after_claim", "after_call", "during_completion"):
        return "the agent intends no effects"
    if point == "after_note":
        return "no deliverer of its kinds notes an attempt (read-back: --sink real)"
    if point == "after_send":
        return "no transactional kafka.publish among its kinds (--sink real)"
    if (point in CRASH_POINTS and CRASH_POINTS[point].role == "upgrade") or point == "handover":
        return "no step to hand over at"
    return "the agent records no step"


def _row(point: str, role: str, where: str, result: TrialResult, trial: str) -> Row:
    if result.error is not None:
        return Row(point, role, where, "error", result.error.splitlines()[0][:200], trial)
    if not result.report.clean:
        first = result.report.first()
        assert first is not None
        kind, item = first
        return Row(
            point, role, where, "VIOLATION", f"{kind}: {_humanize(kind, item, result)}", trial
        )
    if result.not_reached and not result.crashes:
        return Row(point, role, where, "not reached", "no process got there", trial)
    if role == "deliverer":
        outcomes = result.attempt_outcomes
        redone = outcomes.get("expired", 0) + outcomes.get("looked_up", 0)
        unknown = result.report.statuses.get("unknown", 0)
        detail = f"deliverer killed; {redone} attempt(s) recovered"
        if unknown:
            detail += f", {unknown} left unknown for an operator"
        return Row(point, role, where, "ok", detail, trial)
    if len(result.plan.targets) == 1 and result.plan.point:
        outcome, detail = _crash_detail(result, result.plan.point, result.plan.targets[0])
        return Row(point, role, where, outcome, detail, trial)
    return Row(point, role, where, "ok", f"{len(result.crashes)} processes killed; resumed", trial)


_STYLE = {"ok": "green", "VIOLATION": "bold red", "error": "bold red", "chain failed": "red"}


def render(report: CheckReport, console: Console) -> None:
    """Print the table, the warnings, and the first violation (or the all-clear)."""
    options = report.options
    console.print(
        f"[bold]outbox check[/] {escape(options.handler)} "
        f"({escape(options.agent)} {escape(options.version)}); "
        f"{options.runs} run(s) per trial, sink: {options.sink}"
    )
    rows = report.rows() if report.baseline is not None and report.baseline.ok else []
    if rows:
        table = Table(title="crash point x outcome", title_justify="left")
        for name in ("crash point", "process", "where", "outcome", "detail"):
            table.add_column(name, overflow="fold")
        for row in rows:
            style = _STYLE.get(row.outcome, "dim")
            table.add_row(
                row.point,
                row.role,
                escape(row.where),
                f"[{style}]{row.outcome}[/]",
                escape(row.detail),
            )
        console.print(table)
    for warning in report.warnings:
        console.print(f"[yellow]warning:[/] {escape(warning)}")
    first = report.first_violation()
    crashes = sum(len(r.crashes) for r in report.results)
    if first is None:
        ended = (
            "every run ended as it does uninterrupted"
            if report.results_compared
            else "results not compared (they vary between uninterrupted runs)"
        )
        console.print(
            f"[bold green]passed[/]: {crashes} crashes in {len(report.results)} trials, "
            f"nothing lost, nothing applied twice, {ended} ({report.seconds:.0f} s)"
        )
        return
    console.print(f"[bold red]FAILED[/] at {escape(first.trial)} ({report.seconds:.0f} s)")
    console.print(f"  what:      {escape(first.detail)}")
    if first.explanation:
        console.print(f"  why:       {escape(first.explanation)}")
    if first.output:
        console.print("  output:")
        console.print(first.output, markup=False, highlight=False)
    # whole lines, never wrapped: they are meant to be copied
    console.print(f"  reproduce: {first.reproduce}", markup=False, highlight=False, soft_wrap=True)
    if first.logs:
        console.print(f"  logs:      {first.logs}", markup=False, highlight=False, soft_wrap=True)


def plain_text(report: CheckReport, width: int = 140) -> str:
    """The rendered report as plain text (for an assertion message)."""
    out = io.StringIO()
    render(report, Console(file=out, width=width, force_terminal=False, color_system=None))
    return out.getvalue()
