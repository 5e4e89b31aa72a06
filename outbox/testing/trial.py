"""One trial: a scratch database, the agent's runs, real processes killed on plan, the evidence.

:func:`run_trial` starts the runs, a deliverer and a worker (armed as the
plan says), replaces each process that died at its crash point, sends the
runs the signals they wait for, and waits until every run has ended and no
effect is on its way. Then it reads the database, the sink's log and the
trace, and checks the invariants against a :class:`~outbox.testing.compare.Reference`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from outbox.client import Outbox
from outbox.models import TERMINAL_RUN_STATUSES, RunRecord, RunStatus
from outbox.storage.engine import make_engine
from outbox.storage.scratch import ScratchDatabases
from outbox.testing.compare import (
    Reference,
    RunOutcome,
    differences,
    expectations,
    masker,
    outcome_of,
    tag_operations,
)
from outbox.testing.crash import TraceEvent, read_trace, target
from outbox.testing.invariants import (
    Applied,
    Intent,
    Report,
    check,
    load_database,
    load_sink_log,
    replay_violations,
)
from outbox.testing.plan import CheckOptions, TrialPlan
from outbox.testing.processes import Fleet, Process

__all__ = ["Crash", "TrialContext", "TrialError", "TrialResult", "run_trial"]

log = logging.getLogger(__name__)

_TERMINAL = {s.value for s in TERMINAL_RUN_STATUSES}
_OPEN_EFFECTS = ("pending", "in_flight", "dispatched")
_TICK = 0.1
_QUIET = 0.3


class TrialError(Exception):
    """The trial could not be carried out (a process failed, or nothing finished in time)."""


@dataclass
class TrialContext:
    """What every trial of one check shares."""

    options: CheckOptions
    databases: ScratchDatabases
    workdir: Path
    #: Record mode: the kinds known so far, each with (idempotent, has a lookup).
    kinds: dict[str, tuple[bool, bool]] = field(default_factory=dict)
    #: Record mode: the declarations of the user's deliverers config.
    declarations: dict[str, tuple[bool, bool]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def env(self, dsn: str, sink_url: str | None) -> dict[str, str]:
        """The environment of this trial's processes."""
        env = dict(os.environ)
        env["OUTBOX_DSN"] = dsn
        env["OUTBOX_HOME"] = str(self.workdir / "no-embedded-server")
        # The agent's module must import in the children as it does here.
        paths = [os.getcwd(), *[p for p in sys.path if p and Path(p).is_dir()]]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        if sink_url is not None:
            env["OUTBOX_CHECK_SINK"] = sink_url
            env.pop("OUTBOX_DELIVERERS_CONFIG", None)
        return env

    def learn_kinds(self, kinds: list[str]) -> bool:
        """Add kinds; True when there was a new one."""
        with self.lock:
            new = [k for k in kinds if k not in self.kinds]
            for kind in new:
                self.kinds[kind] = self.declarations.get(kind, (True, False))
            return bool(new)

    def record_config(self, path: Path, sink_url: str) -> Path:
        """A deliverers config serving every known kind with a stand-in posting to the sink."""
        with self.lock:
            kinds = dict(self.kinds)
        lines = []
        for kind, (idempotent, lookup) in sorted(kinds.items()):
            lines += [
                f"[kinds.{json.dumps(kind)}]",
                'type = "testing.record"',
                f"url = {json.dumps(sink_url)}",
                f"idempotent = {str(idempotent).lower()}",
                f"lookup = {str(lookup).lower()}",
                "",
            ]
        path.write_text("\n".join(lines))
        return path


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


class _Supervisor:
    """Keeps one trial's processes, runs and signals moving; knows when it is done."""

    def __init__(
        self,
        ctx: TrialContext,
        ob: Outbox,
        fleet: Fleet,
        run_ids: list[str],
        sink_url: str | None,
        logs: Path,
    ) -> None:
        self.ctx = ctx
        self.ob = ob
        self.fleet = fleet
        self.run_ids = run_ids
        self.sink_url = sink_url
        self.logs = logs
        self.deadline = time.monotonic() + ctx.options.timeout
        self.deliverer: Process | None = None
        self._deliverer_armed: str | None = None
        self._configs = 0

    # -- processes ---------------------------------------------------------------------

    def _config(self) -> None:
        if self.sink_url is None:
            return
        self._configs += 1
        path = self.logs / f"deliverers-{self._configs}.toml"
        self.fleet.config = self.ctx.record_config(path, self.sink_url)

    def _progress(self) -> None:
        """A process was started: the trial is moving; its time limit starts again."""
        self.deadline = time.monotonic() + self.ctx.options.timeout

    def start_deliverer(self, crash_at: str | None = None) -> Process:
        self._progress()
        self._config()
        self.deliverer = self.fleet.deliverer("--grace", "2", crash_at=crash_at)
        self._deliverer_armed = crash_at
        return self.deliverer

    def _restart_deliverer(self) -> None:
        """A new kind appeared (record mode): serve it too."""
        old = self.deliverer
        if old is not None and old.poll() is None:
            self.fleet.stop(old)
        self.start_deliverer(self._deliverer_armed)

    def worker(self, *, crash_at: str | None = None, new_version: bool = False) -> Process:
        opts = self.ctx.options
        self._progress()
        if new_version:
            return self.fleet.worker(
                "--concurrency",
                str(max(4, opts.runs)),
                crash_at=crash_at,
                handler=opts.upgrade_handler or opts.handler,
                version=opts.upgrade_to,
                setup=opts.setup,
            )
        return self.fleet.worker("--concurrency", str(max(4, opts.runs)), crash_at=crash_at)

    # -- one look around ---------------------------------------------------------------

    def _records(self) -> list[RunRecord]:
        return [r for r in self.ob.store.list_runs(limit=10_000) if str(r.id) in self.run_ids]

    def tick(self) -> bool:
        """Signal waiting runs, serve new kinds, notice failed processes; True when all is done."""
        records = self._records()
        for record in records:
            name = record.wait_signal
            if record.status == RunStatus.WAITING and name in self.ctx.options.signals:
                self.ob.signal(
                    record.id,
                    name,
                    self.ctx.options.signals[name],
                    dedup_key=f"outbox-check:{name}:{record.updated_at.isoformat()}",
                )
        if self.sink_url is not None and self.ctx.learn_kinds(self.ob.store.effect_kinds()):
            self._restart_deliverer()
        elif self.sink_url is not None and self.fleet.config is not None:
            served = self.fleet.config.read_text()
            if any(f"[kinds.{json.dumps(k)}]" not in served for k in self.ctx.kinds):
                self._restart_deliverer()
        for proc in self.fleet.procs:
            code = proc.poll()
            if code not in (None, 0, -signal.SIGKILL) and code != -signal.SIGTERM:
                raise TrialError(
                    f"a process exited with status {code}:\n{self.fleet.log_of(proc)[-3000:]}"
                )
        finished = all(r.status.value in _TERMINAL for r in records)
        counts = self.ob.store.effect_counts()
        return finished and not any(counts.get(s, 0) for s in _OPEN_EFFECTS)

    def _late(self) -> None:
        if time.monotonic() > self.deadline:
            raise TrialError(
                f"not finished within {self.ctx.options.timeout:g} s: {self.explain_stuck()}"
            )

    def wait_for_exit(self, proc: Process) -> bool:
        """Until ``proc`` exits (True) or every run ended and every effect settled (False)."""
        while True:
            if proc.poll() is not None:
                return True
            if self.tick():
                return proc.poll() is not None
            self._late()
            time.sleep(_TICK)

    def wait_until_done(self) -> None:
        """Until every run ended and every effect settled, for a quiet moment."""
        quiet_since: float | None = None
        while True:
            if self.tick():
                quiet_since = quiet_since or time.monotonic()
                if time.monotonic() - quiet_since >= _QUIET:
                    return
            else:
                quiet_since = None
            self._late()
            time.sleep(_TICK)

    def stop_all(self) -> list[str]:
        """SIGTERM everything still running; notes on anything that did not exit cleanly."""
        notes = []
        for proc in self.fleet.alive():
            proc.send_signal(signal.SIGTERM)
        for proc in self.fleet.procs:
            try:
                code = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait(timeout=30)
                notes.append(f"process {proc.pid} ignored SIGTERM for 30 s")
            if code not in (0, -signal.SIGKILL, -signal.SIGTERM):
                notes.append(f"process {proc.pid} exited with {code}")
        return notes

    def explain_stuck(self) -> str:
        """Why the runs have not finished, in a person's words."""
        parts = []
        try:
            records = self._records()
            counts = self.ob.store.effect_counts()
        except Exception as exc:  # the explanation must not hide the timeout
            return f"(could not read the runs: {exc})"
        for record in records:
            where = f"run {str(record.id)[:8]} is {record.status.value}"
            if record.status == RunStatus.WAITING and record.wait_signal:
                hint = (
                    ""
                    if record.wait_signal in self.ctx.options.signals
                    else f" (pass --signal {record.wait_signal}=JSON)"
                )
                where += f", waiting for signal {record.wait_signal!r}{hint}"
            elif record.status == RunStatus.WAITING and record.wait_effect:
                where += f", waiting for effect {record.wait_effect}"
            elif record.status == RunStatus.WAITING and record.wake_at:
                where += f", sleeping until {record.wake_at.isoformat()}"
            elif record.current_step:
                where += f" after step {record.current_step!r}"
            parts.append(where)
        open_effects = {s: n for s, n in counts.items() if s in _OPEN_EFFECTS and n}
        if open_effects:
            parts.append(f"effects still open: {open_effects}")
        return "; ".join(parts)


def _died_at(fleet: Fleet, proc: Process, events: list[TraceEvent]) -> Crash | None:
    if proc.returncode != -signal.SIGKILL:
        return None
    for event in reversed(events):
        if event.pid == proc.pid and event.crash:
            return Crash(event.point, event.where, proc.pid, event.run)
    armed = fleet.armed.get(proc.pid)
    return Crash(armed or "?", None, proc.pid, None)


def _drive(plan: TrialPlan, sup: _Supervisor, result: TrialResult) -> list[Process]:
    """Start and replace processes as the plan says; the armed ones."""
    armed: list[Process] = []

    def doomed(proc: Process, what: str) -> None:
        armed.append(proc)
        if not sup.wait_for_exit(proc):
            result.not_reached.append(what)

    if plan.role == "deliverer":
        assert plan.point is not None
        sup.worker()
        doomed(sup.start_deliverer(crash_at=plan.point), plan.point)
        if armed[-1].poll() is not None:
            sup.start_deliverer()
        else:  # never reached: it finished the work itself
            sup._deliverer_armed = None
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
    for rid, outcome in result.outcomes.items():
        if outcome.status not in _TERMINAL:
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
        launcher="fork",
    )
    try:
        run_ids = [
            str(ob.start_run(ctx.options.agent, ctx.options.version, ctx.options.inputs).id)
            for _ in range(
                max(ctx.options.runs, 2) if plan.role == "baseline" else ctx.options.runs
            )
        ]
        sup = _Supervisor(ctx, ob, fleet, run_ids, sink_url, logs)
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
        try:
            ctx.databases.drop(dsn)
        except Exception:  # the check's end drops whatever is left
            log.warning("could not drop %s", dsn, exc_info=True)
    result.seconds = time.monotonic() - started
    return result
