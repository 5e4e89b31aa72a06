"""``outbox check``: run an agent in real worker processes, kill them at every crash point, compare.

:func:`check_agent` is the whole check: a scratch server (a temporary
embedded PostgreSQL, or scratch databases on ``dsn``), an uninterrupted,
traced trial that becomes the reference and the plan, then every planned
trial (``jobs`` at a time), each failing worker chain split into single
crashes, and a :class:`~outbox.check.report.CheckReport`. The scratch
databases are dropped at the end; the trials' logs are kept when something
failed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from outbox.check.compare import Reference, split
from outbox.check.plan import BASELINE, CheckOptions, TrialPlan, plan_trials, select
from outbox.check.report import CheckReport
from outbox.check.supervisor import TrialContext
from outbox.check.trial import TrialResult, run_trial
from outbox.errors import ConfigurationError
from outbox.storage.admin.embedded import EmbeddedServer
from outbox.storage.admin.scratch import ScratchDatabases
from outbox.validation import import_callable

__all__ = ["Progress", "check_agent", "scratch_server"]

#: Called with each finished trial and how many are planned so far.
Progress = Callable[[TrialResult, int], None]

# The scratch server's data is thrown away; durability against a crash of
# PostgreSQL itself is not what a check is about (its processes die, not the server).
SCRATCH_SETTINGS = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}


@contextlib.contextmanager
def scratch_server(dsn: str | None = None) -> Iterator[str]:
    """A DSN to make scratch databases on: ``dsn``, or a temporary embedded server.

    The embedded server lives in a fresh temporary directory (never the
    user's ``.outbox``) and is stopped and deleted on exit.
    """
    if dsn is not None:
        yield dsn
        return
    # A short path: the server's Unix socket lives in it. Made here, so it may be
    # opened to traversal: run as root, the server runs as another OS user, who
    # must enter it (its data directory inside stays private to that user).
    home = Path(tempfile.mkdtemp(prefix="outbox-check-"))
    home.chmod(0o711)
    server = EmbeddedServer(home, settings=SCRATCH_SETTINGS)
    try:
        yield server.ensure_running()
    finally:
        with contextlib.suppress(Exception):
            server.stop(mode="immediate")
        shutil.rmtree(home, ignore_errors=True)


def _importable(path: str, field: str) -> None:
    """Fail early, with one clear line, when the workers could not import ``path``."""
    sys.path.insert(0, os.getcwd())  # as ``python -m outbox`` children will have it
    try:
        import_callable(path, field=field)
    finally:
        sys.path.pop(0)


def _declarations(options: CheckOptions) -> dict[str, tuple[bool, bool]]:
    """(idempotent, has a lookup) of each kind of the user's deliverers config."""
    if options.config is None:
        return {}
    from deliverers.registry import build_registry, load_config

    registry = build_registry(load_config(options.config))
    try:
        return {kind: (d.idempotent, d.has_lookup) for kind, d in registry.items()}
    finally:
        for deliverer in registry.values():
            deliverer.close()


class _Check:
    def __init__(
        self,
        options: CheckOptions,
        ctx: TrialContext,
        progress: Progress | None,
        phase: Callable[[str], None] = lambda _: None,
    ) -> None:
        from deliverers.record import RecordingSink

        self.options = options
        self.ctx = ctx
        self.progress = progress
        self.phase = phase
        self.sink_factory = RecordingSink
        self.planned = 1

    def trial(self, plan: TrialPlan, reference: Reference | None) -> TrialResult:
        result = run_trial(self.ctx, plan, reference, sink_factory=self.sink_factory)
        if self.progress is not None:
            self.progress(result, self.planned)
        return result

    def many(self, plans: Sequence[TrialPlan], reference: Reference | None) -> list[TrialResult]:
        """Trials ``jobs`` at a time; a hand-over (a reference of its own) is compared with none."""

        def one(plan: TrialPlan) -> TrialResult:
            return self.trial(plan, None if plan.role == "handover" else reference)

        pool = ThreadPoolExecutor(self.options.jobs, thread_name_prefix="outbox-check")
        try:
            return list(pool.map(one, plans))
        except BaseException:
            self.ctx.cancelled.set()  # an interrupt: the running trials stop at their next tick
            raise
        finally:
            # On an interrupt, trials not started yet are dropped; running ones end soon
            # (their processes are killed as they unwind).
            pool.shutdown(wait=True, cancel_futures=True)

    def isolate(self, chain: TrialResult, reference: Reference) -> list[TrialResult]:
        """Single crashes of a failing chain, in order, until a batch has one that fails."""
        found: list[TrialResult] = []
        singles = chain.plan.singles()
        self.planned += len(singles)
        for start in range(0, len(singles), self.options.jobs):
            batch = self.many(singles[start : start + self.options.jobs], reference)
            found += batch
            if any(not r.ok for r in batch):
                break
        self.planned -= len(singles) - len(found)
        return found

    def run(self, report: CheckReport) -> None:
        self.phase("baseline: one run of your agent, uninterrupted")
        baseline = self.trial(BASELINE, None)
        report.baseline = baseline
        report.warnings += _baseline_warnings(baseline)
        if not baseline.ok:
            return
        reference = Reference.build(baseline.intents, baseline.applied, baseline.outcomes)
        report.warnings += reference.warnings
        report.results_compared = reference.outcome is not None
        first_run = next(iter(baseline.outcomes), None)
        report.planned = plan_trials(baseline.events, first_run, self.options)
        plans = select(report.planned, self.options.only)
        unknown = [o for o in self.options.only if o not in {p.id for p in plans}]
        if unknown:
            report.warnings.append(
                f"--only {', '.join(unknown)}: no such trial (ids are the crash points, "
                "or point@step, of the table)"
            )
        self.planned = 1 + len(plans)
        self.phase(f"trials: a crash at each of {len(plans)} point(s), compared with the baseline")
        first_wave = [p for p in plans if p.role != "upgrade"]
        results = self.many(first_wave, reference)
        handover = next((r for r in results if r.plan.role == "handover"), None)
        upgrades = [p for p in plans if p.role == "upgrade"]
        if upgrades and handover is not None and handover.ok:
            upgraded = Reference.build(handover.intents, handover.applied, handover.outcomes)
            report.warnings += [f"hand-over: {w}" for w in upgraded.warnings]
            results += self.many(upgrades, upgraded)
        # The first failing chain is split into single crashes, to name the first that
        # fails alone (and a command that reproduces it); the others show as chains.
        chain = next((r for r in results if r.plan.chain and not r.ok and r.error is None), None)
        if chain is not None:
            results += self.isolate(chain, reference)
        report.results = results


def _baseline_warnings(baseline: TrialResult) -> list[str]:
    keyless = sorted({a.operation for a in baseline.applied if a.key is None and a.operation})
    if not keyless:
        return []
    masked = sorted({split(op)[1] for op in keyless})
    shown = ", ".join(masked[:3]) + (" ..." if len(masked) > 3 else "")
    return [
        f"{len(masked)} operation(s) reached the sink outside the outbox (no key, no intent): "
        f"{shown}; a crash can repeat them"
    ]


def check_agent(
    options: CheckOptions,
    *,
    server_dsn: str | None = None,
    progress: Progress | None = None,
    keep_logs: bool = False,
    phase: Callable[[str], None] = lambda _: None,
) -> CheckReport:
    """Check an agent: every crash point in turn, compared with an uninterrupted run.

    ``server_dsn`` makes the scratch databases on a server the caller already
    runs (default: ``options.dsn``, else a temporary embedded server).
    ``progress`` is told of each finished trial, ``phase`` of what is under way
    (starting the server, the baseline, the crash trials). Raises
    :class:`~outbox.errors.ConfigurationError` when the handler or the setup
    cannot be imported, or the deliverers config is invalid.
    """
    _importable(options.handler, "handler")
    for path, name in ((options.setup, "setup"), (options.upgrade_handler, "upgrade_handler")):
        if path is not None:
            _importable(path, name)
    if options.sink == "real" and options.config is not None and not options.config.exists():
        raise ConfigurationError(f"config={str(options.config)!r}: no such file")
    declarations = _declarations(options) if options.sink == "record" else {}
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="outbox-check-logs-"))
    report = CheckReport(options)
    try:
        if not (server_dsn or options.dsn):
            phase("starting a scratch PostgreSQL (thrown away at the end)")
        with scratch_server(server_dsn or options.dsn) as dsn:
            databases = ScratchDatabases(dsn)
            try:
                ctx = TrialContext(options, databases, workdir, declarations=declarations)
                _Check(options, ctx, progress, phase).run(report)
            finally:
                if server_dsn or options.dsn:  # a temporary server goes whole
                    databases.drop_all()
    finally:
        report.seconds = time.monotonic() - started
        if report.ok and not keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)
    return report
