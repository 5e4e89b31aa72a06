"""One trial: a scratch database, the agent's runs, real processes killed on plan, the evidence.

:func:`run_trial` starts the runs, then a deliverer and workers (armed as the
plan says, through a :class:`~outbox.check.supervisor.Supervisor`),
replaces each process that died at its crash point, and waits until every
run has ended and no effect is on its way. Then it reads the database, the sink's log and the
trace, and checks the invariants against a :class:`~outbox.check.compare.Reference`.
"""

from __future__ import annotations

import logging
import re
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from outbox.check.compare import (
    Reference,
    RunOutcome,
    differences,
    disagreements,
    expectations,
    failed_references,
    masker,
    outcome_of,
    tag_operations,
    unstable_step_ids,
)
from outbox.check.crash import TraceEvent, read_trace, target
from outbox.check.invariants import (
    Applied,
    Intent,
    Report,
    check,
    replay_violations,
)
from outbox.check.logs import load_database, load_sink_log
from outbox.check.plan import TrialPlan
from outbox.check.processes import Fleet, Process
from outbox.check.supervisor import TERMINAL, Supervisor, TrialContext, TrialError
from outbox.client import Outbox
from outbox.storage.engine import make_engine

__all__ = ["Crash", "TrialResult", "run_trial"]

log = logging.getLogger(__name__)

#: Leases of a check's workers and deliverers.
CHECK_LEASE_SECONDS = "5"


@dataclass(frozen=True)
class Crash:
    """A process that died at a crash point."""

    point: str
    where: str | None
    pid: int
    run: str | None


@dataclass
class TrialResult:
    """What one trial did and found."""

    plan: TrialPlan
    report: Report = field(default_factory=Report)
    crashes: list[Crash] = field(default_factory=list)
    #: Targets no process reached (the run had moved past them, or never got there).
    not_reached: list[str] = field(default_factory=list)
    outcomes: dict[str, RunOutcome] = field(default_factory=dict)
    intents: list[Intent] = field(default_factory=list)
    applied: list[Applied] = field(default_factory=list)
    #: How often each (run, step) function ran.
    started: dict[tuple[str, str], int] = field(default_factory=dict)
    events: list[TraceEvent] = field(default_factory=list)
    #: Attempt-log rows by outcome (succeeded, retry, expired, ...).
    attempt_outcomes: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0
    logs: Path | None = None

    @property
    def ok(self) -> bool:
        """It ran, and found no violation."""
        return self.error is None and self.report.clean


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:80]


def _died_at(fleet: Fleet, proc: Process, events: list[TraceEvent]) -> Crash | None:
    if proc.returncode != -signal.SIGKILL:
        return None
    for event in reversed(events):
        if event.pid == proc.pid and event.crash:
            return Crash(event.point, event.where, proc.pid, event.run)
    armed = fleet.armed.get(proc.pid)
    return Crash(armed or "?", None, proc.pid, None)


def _drive(plan: TrialPlan, sup: Supervisor, result: TrialResult) -> list[Process]:
    """Start and replace processes as the plan says; the armed ones."""
    armed: list[Process] = []

    def doomed(proc: Process, what: str) -> None:
        armed.append(proc)
        if not sup.wait_for_exit(proc):
            result.not_reached.append(what)

    if plan.role == "deliverer":
        assert plan.point is not None
        sup.worker()
        deliverer = sup.start_deliverer(crash_at=plan.point)
        if deliverer is None:  # no kind known: nothing to deliver, nothing to crash in
            result.not_reached.append(plan.point)
            sup.start_deliverer()
            return armed
        doomed(deliverer, plan.point)
        if deliverer.poll() is not None:
            sup.start_deliverer()
        else:  # never reached: it finished the work itself
            sup.disarm_deliverer()
        return armed
    sup.start_deliverer()
    if plan.role == "baseline":
        sup.worker()
    elif plan.role == "worker":
        assert plan.point is not None
        for where in plan.targets:
            crash_at = target(plan.point, where)
            doomed(sup.worker(crash_at=crash_at), crash_at)
            if armed[-1].poll() is None:
                break  # the runs are done: the later targets are not reached either
        result.not_reached += [target(plan.point, w) for w in plan.targets[len(armed) :]]
        sup.worker()
    else:  # a hand-over to the new version: the old worker dies, a new one takes the runs
        assert plan.handover is not None
        doomed(sup.worker(crash_at=plan.handover), plan.handover)
        if plan.role == "upgrade":
            assert plan.point is not None
            doomed(sup.worker(crash_at=plan.point, new_version=True), plan.point)
        sup.worker(new_version=True)
    return armed


def _evidence(
    ctx: TrialContext,
    plan: TrialPlan,
    result: TrialResult,
    dsn: str,
    ob: Outbox,
    run_ids: list[str],
    sink_log: Path | None,
    sink_url: str | None,
    trace: Path,
    reference: Reference | None,
) -> None:
    normalize = masker(sink_url)
    intents, attempts, _ = load_database(dsn, normalize)
    applied, requests = load_sink_log(sink_log, normalize) if sink_log else ([], 0)
    result.intents, result.applied = tag_operations(intents, applied, run_ids)
    result.attempt_outcomes = dict(Counter(a.outcome for a in attempts))
    result.events = read_trace(trace)
    reran, result.started = replay_violations(result.events)
    result.outcomes = {rid: outcome_of(ob.run(rid), normalize) for rid in run_ids}
    if reference is None:  # the reference itself: its own counts are what is expected
        intended = Counter(i.operation for i in result.intents if i.operation)
        applied_ops = Counter(a.operation for a in result.applied if a.operation)
        counts = {op: max(intended[op], applied_ops[op]) for op in intended | applied_ops}
        keyless = {a.operation for a in result.applied if a.key is None and a.operation}
        report = check(
            result.intents,
            attempts,
            result.applied,
            requests=requests,
            expected_counts=counts,
            sink_kinds=None if sink_log else [],
            keyless_allowed=keyless,
        )
        # Runs of the same inputs that end differently leave nothing to compare a crashed
        # run with: the very mistake (a clock read outside a step) the comparison is for.
        if not ctx.options.allow_nondeterministic_result:
            report.nondeterministic_result = disagreements(result.outcomes)
        # Nor does a reference that failed: every trial would "end as it does".
        report.reference_failed = failed_references(result.outcomes)
        # A step id that differs between two runs differs between attempts too: a crash
        # point planned at it is never reached, and the step's intents get new keys.
        report.unstable_step_ids = unstable_step_ids(
            {rid: ob.run(rid).completed_steps for rid in run_ids}, sink_url
        )
    else:
        wanted = expectations(reference, run_ids)
        report = check(
            result.intents,
            attempts,
            result.applied,
            requests=requests,
            expected_counts=wanted.counts,
            sink_kinds=None if sink_log else [],
            keyless_allowed=wanted.keyless,
        )
        if reference.outcome is not None:
            for rid, outcome in result.outcomes.items():
                for line in differences(reference.outcome, outcome):
                    report.result_differs.append(f"run {rid}: {line}")
    report.reran = reran
    # A point the uninterrupted run reached and this trial never did was not tried:
    # a trial that passes without it proves nothing about it.
    report.not_reached = [
        f"{where}: reached by the uninterrupted run, never reached in this trial"
        for where in result.not_reached
    ]
    for rid, outcome in result.outcomes.items():
        if outcome.status not in TERMINAL:
            report.unfinished.append(f"run {rid}: {outcome.status}")
    if plan.role in ("handover", "upgrade"):
        wanted_version = ctx.options.upgrade_to
        for rid, outcome in result.outcomes.items():
            if outcome.version != wanted_version or outcome.upgrades != 1:
                report.result_differs.append(
                    f"run {rid}: version {outcome.version} after {outcome.upgrades} upgrades "
                    f"(expected {wanted_version}, upgraded once)"
                )
    result.report = report


def run_trial(
    ctx: TrialContext,
    plan: TrialPlan,
    reference: Reference | None,
    *,
    sink_factory: Callable[[Path], Any] | None = None,
) -> TrialResult:
    """Carry out ``plan`` in a fresh scratch database; compare with ``reference`` (None: it is one).

    ``sink_factory(log_path)`` makes the recording sink (record mode).
    """
    started = time.monotonic()
    result = TrialResult(plan)
    logs = ctx.workdir / _safe(plan.id)
    logs.mkdir(parents=True, exist_ok=True)
    result.logs = logs
    trace = logs / "trace.jsonl"
    dsn = ctx.databases.clone()
    sink = None
    if ctx.options.sink == "record":
        assert sink_factory is not None
        sink = sink_factory(logs / "sink.jsonl").start()
    sink_url = None if sink is None else str(sink.url)
    ob = Outbox(make_engine(dsn, pool_size=2, application_name="outbox-check"))
    fleet = Fleet(
        ctx.env(dsn, sink_url),
        logs,
        ctx.options.config if sink is None else None,
        handler=ctx.options.handler,
        agent=ctx.options.agent,
        version=ctx.options.version,
        trace=trace,
        # Long enough that a starved process keeps its lease on a busy machine; a
        # killed one's leases are ended when its death is seen (Supervisor.wait_for_exit).
        lease=CHECK_LEASE_SECONDS,
        launcher="fork",
    )
    try:
        run_ids = [
            str(ob.start_run(ctx.options.agent, ctx.options.version, ctx.options.inputs).id)
            for _ in range(
                max(ctx.options.runs, 2) if plan.role == "baseline" else ctx.options.runs
            )
        ]
        sup = Supervisor(ctx, ob, fleet, run_ids, sink_url, logs)
        try:
            armed = _drive(plan, sup, result)
            sup.wait_until_done()
        except TrialError as exc:
            result.error = str(exc)
        result.notes += sup.stop_all()
        events = read_trace(trace)
        for proc in armed if result.error is None else []:
            crash = _died_at(fleet, proc, events)
            if crash is not None:
                result.crashes.append(crash)
        _evidence(
            ctx,
            plan,
            result,
            dsn,
            ob,
            run_ids,
            None if sink is None else sink.log_path,
            sink_url,
            trace,
            reference,
        )
    except Exception as exc:
        log.exception("trial %s failed", plan.id)
        result.error = result.error or f"{type(exc).__name__}: {exc}"
    finally:
        fleet.close()
        ob.close()
        if sink is not None:
            sink.stop()
        # The database stays until the check ends: DROP DATABASE forces a checkpoint,
        # which trials running alongside would wait for.
    result.seconds = time.monotonic() - started
    return result
