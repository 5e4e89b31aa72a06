"""The JSON shape of every ``--json`` report, as pydantic models.

A command declares its report with ``@json_option(Model)`` and prints through
:func:`~outbox.cli._common.emit`, which accepts only an instance of that model:
what ``--json`` prints is ``Model.model_dump_json()``, and ``outbox schemas
export`` writes ``Model``'s JSON Schema to ``schemas/report.<command>.json``, so
the two cannot drift. A report that is one of the core records (an effect, a
run) uses that record's model.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any
from uuid import UUID

from pydantic import BaseModel, ConfigDict, RootModel

from outbox.governance.gates import Gate
from outbox.models import Effect, EffectAttempt, RunMode, RunRecord, RunStatus, StepRecord

__all__ = [
    "ArchiveSummaryReport",
    "AuditVerifyReport",
    "CancelReport",
    "CheckReport",
    "DbStatusReport",
    "DbStopReport",
    "DemoReport",
    "EffectDetailReport",
    "EffectListReport",
    "ForkReport",
    "GateListReport",
    "GatesApplyReport",
    "GatesRemoveReport",
    "GcReport",
    "GoneDeliverer",
    "MigrateReport",
    "PauseReport",
    "ReconcileReport",
    "ResumeReport",
    "RolesReport",
    "RunDetailReport",
    "RunDiffReport",
    "RunListReport",
    "SchemasCheckReport",
    "SchemasExportReport",
    "VersionsReport",
    "report_models",
]


class Report(BaseModel):
    """Base of the report models: frozen, every field required to be declared."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class MigrateReport(Report):
    """``outbox migrate --json``."""

    #: Migrations applied by this call (``0004_name``), oldest first; empty when none was pending.
    applied: list[str]
    #: The database's schema version after the call.
    schema_version: int
    #: The newest version this code ships.
    known: int
    #: With ``--distribute`` (Citus): the tables distributed by this call.
    distributed: list[str] = []


class DbStatusReport(Report):
    """``outbox db status --json`` and ``outbox db start --json``: the embedded server."""

    home: str
    initialized: bool
    running: bool
    pid: int | None
    #: How to reach it (a Unix-socket DSN), while it runs.
    dsn: str | None
    #: PostgreSQL's version.
    version: str | None


class DbStopReport(Report):
    """``outbox db stop --json``."""

    #: False when it was not running.
    stopped: bool


class GcReport(Report):
    """``outbox gc --json``."""

    older_than: str
    dry_run: bool
    #: Rows deleted (in a dry run: counted in the first batch of each phase) per table.
    deleted: dict[str, int]
    #: Transactions used.
    batches: int
    #: The archive file written, if any.
    archive: str | None
    #: On Citus: the shards left for the next gc because their node did not answer
    #: (shard -> the error), the rest collected; gc then exits 1.
    unreachable_shards: dict[int, str] = {}
    #: Large values were left for a gc by a login that may delete them (this one is
    #: confined to a namespace: values are shared by every namespace).
    values_left: bool = False


class ArchiveHeader(BaseModel):
    """The first line of each ``gc`` run in an archive."""

    model_config = ConfigDict(frozen=True, extra="allow")

    #: Always ``agent-outbox``: what wrote the file.
    archive: str
    #: The archive format's version (1).
    format: int
    #: When this gc run started (ISO 8601).
    written_at: str
    #: Its horizon: rows finished longer ago than this were archived and deleted.
    older_than_seconds: float
    #: The database's schema version then (the columns the rows have).
    schema_version: int


class ArchiveSummaryReport(Report):
    """``outbox archive read FILE --json``."""

    #: One header per ``gc`` run that wrote to the file.
    gc_runs: list[ArchiveHeader]
    #: Rows per table.
    rows: dict[str, int]
    #: Lines a crash tore while writing (skipped).
    torn_lines_skipped: int


class ReconcileItem(Report):
    """One expired attempt and what was (or, in a dry run, would be) done with it."""

    #: The effect.
    effect_id: UUID
    #: The effect's kind (its deliverer's declaration decided the action).
    kind: str
    #: The attempt that started and never ended.
    attempt: int
    #: ``redeliver``, ``failed``, ``lookup``, ``looked_up_succeeded``,
    #: ``looked_up_redeliver``, ``lookup_failed``, ``unknown`` or ``skipped``.
    action: str
    #: Why (what a lookup answered, say).
    note: str


class UnknownEffect(Report):
    """An effect in ``unknown``, waiting for an operator."""

    #: The effect (``outbox effects resolve ID --as ...``).
    id: UUID
    #: Its kind.
    kind: str
    #: Its run (null: intended outside any run).
    run_id: UUID | None
    #: The attempt whose outcome is unknown.
    attempt: int
    #: Its idempotency key: search the sink's own log for it.
    key: str
    #: Why it is unknown.
    last_error: str | None


class GoneDeliverer(Report):
    """A deliverer (or Kafka relay) that died holding work whose leases have not ended yet."""

    #: Its lease owner (``host:pid:suffix``; a relay's starts with ``relay:``).
    owner: str
    #: Attempts it holds in flight.
    in_flight: int
    #: Effects it dispatched to Kafka (a relay) that no deliverer has taken yet.
    dispatched: int = 0
    #: When the first of their leases ends (then they are reconciled as expired).
    lease_ends: datetime


class ReconcileReport(Report):
    """``outbox reconcile --json``."""

    dry_run: bool
    #: Items per action.
    counts: dict[str, int]
    items: list[ReconcileItem]
    #: Every effect now in ``unknown`` (up to ``--max-rows``).
    unknown: list[UnknownEffect]
    #: Deliverers that are gone (their session lock is free: killed, crashed) but
    #: still hold attempts whose leases have not ended, so nothing above counts them.
    held_by_gone_deliverers: list[GoneDeliverer]


class DemoReport(Report):
    """``outbox demo --json``: the tally of the demo's story (printed when it fails, too)."""

    #: False when the demo stopped before its runs and effects were done (see ``error``).
    finished: bool
    #: Why it stopped early (the line printed on stderr), else null.
    error: str | None
    #: What its runs and effects were still waiting for (empty when finished).
    waiting_for: list[str]
    runs: int
    runs_completed: int
    runs_compensated: int
    effects_intended: int
    effects_delivered: int
    attempts_retried: int
    attempts_recovered_after_crash: int
    redeliveries_seen_by_sink: int
    duplicates_applied_at_sink: int
    lost: int
    phantom: int
    #: Lease owners (``host:pid:suffix``) of deliverers the demo did not start that
    #: served its database when it began or delivered some of its effects.
    other_deliverers: list[str]
    #: The demo's effects those deliverers delivered.
    delivered_by_other_deliverers: int
    seconds: float
    #: What happened, in order (kills, restarts, the approval, the cancellation).
    events: list[str]


class EffectListReport(RootModel[list[Effect]]):
    """``outbox effects list --json``: effects, newest first (``--oldest-first``: intent order)."""


class EffectDetailReport(Report):
    """``outbox effects show ID --json``."""

    effect: Effect
    #: The attempt log, oldest first.
    attempts: list[EffectAttempt]


class RoleLine(Report):
    """One role ``outbox roles`` created or updated."""

    #: The PostgreSQL role's name.
    role: str
    #: Who logs in as it and what it may do.
    purpose: str


class RolesReport(Report):
    """``outbox roles --json``."""

    roles: list[RoleLine]
    #: The namespace the roles are confined to (``--namespace``); None: every namespace.
    namespace: str | None = None


class RunListReport(RootModel[list[RunRecord]]):
    """``outbox runs list --json``: runs, newest first."""


class Budget(Report):
    """A run's budget: ``remaining`` is budget - spent - reserved (None: no budget)."""

    #: What the run may spend (null: no budget).
    budget: Decimal | None
    #: Debited by its steps so far.
    spent: Decimal
    #: Held by steps under way (model requests not yet answered).
    reserved: Decimal
    #: What is left (null: no budget).
    remaining: Decimal | None


class RunDetailReport(Report):
    """``outbox runs show RUN --json``."""

    run: RunRecord
    budget: Budget
    #: Its completed steps, in the order they were recorded.
    steps: list[StepRecord]
    #: Its effects, in intent order.
    effects: list[Effect]
    #: ``dry_run``: its effects went to a recording deliverer, never to a sink.
    mode: RunMode


class CancelReport(Report):
    """``outbox runs cancel RUN --json``: the run's status after the cancellation (and --wait)."""

    run_id: UUID
    status: RunStatus


class PauseReport(Report):
    """``outbox runs pause RUN --json``: ``paused``, or ``running`` while its step finishes."""

    run_id: UUID
    status: RunStatus
    reason: str


class ResumeReport(Report):
    """``outbox runs resume RUN --json``: the run's status after the resume."""

    run_id: UUID
    status: RunStatus


class ForkReport(Report):
    """``outbox runs fork RUN --from STEP --json``: the new run."""

    run_id: UUID
    forked_from: UUID
    from_step: str
    version: str
    #: The original's steps the fork replays (their functions are not called again).
    replayed_steps: list[str]
    status: RunStatus


class VersionLine(Report):
    """Unfinished runs of one agent version in one status."""

    #: The agent's name.
    agent: str
    #: The version its runs are pinned to.
    version: str
    #: A status that is not terminal (runnable, running, waiting, paused, ...).
    status: RunStatus
    #: How many runs of that version are in that status.
    runs: int


class VersionsReport(RootModel[list[VersionLine]]):
    """``outbox runs versions --json``: a version with no line left can retire."""


class DiffChange(Report):
    """Where two runs differ: ``added`` (only in B), ``removed`` (only in A), ``changed``."""

    #: The step that intended the effect (null: outside a step).
    step_id: str | None
    #: Its index among the step's intents.
    index: int | None
    #: ``added`` (only in run B), ``removed`` (only in run A) or ``changed``.
    change: str
    #: What differs of a changed effect (kind, payload, compensate, ordering_key, key).
    fields: list[str]
    #: The effect in run A and in run B, each run's own id written ``{run}``.
    a: dict[str, Any] | None
    #: (``a``'s counterpart in run B; null when ``removed``.)
    b: dict[str, Any] | None


class RunDiffReport(Report):
    """``outbox runs diff RUN_A RUN_B --json``: the effects two runs intended, compared."""

    run_a: UUID
    run_b: UUID
    #: Effects compared (matched by step and index).
    compared: int
    identical: bool
    changes: list[DiffChange]


class AuditVerifyReport(Report):
    """``outbox audit verify [RUN] --json``: the hash chains checked, and where they break."""

    runs_checked: int
    intact: bool
    #: Run id (or "(no run)" for effects written outside any run) → its breaks, the first first.
    broken: dict[str, list[str]]


class GatesApplyReport(Report):
    """``outbox gates apply --json``: the gates stored."""

    applied: list[str]
    #: Whether gates the file does not declare were removed (``--prune``).
    pruned: bool


class GateListReport(RootModel[list[Gate]]):
    """``outbox gates list --json``: the gates in force."""


class GatesRemoveReport(Report):
    """``outbox gates remove NAME... --json``: the gates removed."""

    removed: list[str]


class SchemasExportReport(RootModel[list[str]]):
    """``outbox schemas export --json``: the files written."""


class SchemasCheckReport(Report):
    """``outbox schemas check --json``: files missing, different, or left over."""

    drift: list[str]
    #: Files not checked: their model needs an optional extra that is not installed.
    skipped: list[str]


class CheckTrial(Report):
    """One trial of ``outbox check``: the baseline, one crash, or a chain of crashes."""

    #: The trial's id (``uninterrupted``, a crash point, ``point@step``): ``--only`` takes it.
    id: str
    #: Whether nothing was lost, applied twice, regressed or left different.
    ok: bool
    #: How long it took.
    seconds: float
    #: ``point@where`` of every process killed in this trial.
    crashes: list[str]


class CheckRow(Report):
    """One line of ``outbox check``'s table: a crash point, where, and what came of it."""

    #: The crash point (``after_step``, ``after_call``, ...).
    point: str
    #: ``worker``, ``deliverer`` or ``upgrade``.
    role: str
    #: Where it was reached (a step, a kind).
    where: str
    #: ``ok``, ``VIOLATION``, ``error``, ``not reached``, ``skipped``, ``chain failed``.
    outcome: str
    #: What came of it, in a sentence.
    detail: str
    #: The trial that crashed there.
    trial: str


class CheckViolation(Report):
    """The first violation ``outbox check`` found, explained, with the command to reproduce it."""

    #: The trial that showed it.
    trial: str
    #: Its crash point (``no crash`` for the baseline).
    point: str
    #: Where the crash was (null: several places, a chain).
    where: str | None
    #: ``lost``, ``duplicate_operations``, ``phantom``, ``regressed``, ``error``, ...
    kind: str
    #: What was seen, with what was killed.
    detail: str
    #: Why it happens and how agents usually fix it.
    explanation: str
    #: The command that runs this trial alone.
    reproduce: str
    #: Where the trial's process logs were kept (null: none).
    logs: str | None
    #: What a failed process wrote last (for an ``error``).
    output: str | None


class CheckReport(Report):
    """``outbox check MODULE:FUNCTION --json``: crash point x outcome, and the first violation."""

    ok: bool
    handler: str
    agent: str
    version: str
    runs_per_trial: int
    sink: str
    seconds: float
    trials: list[CheckTrial]
    #: Processes killed over all trials.
    crashes: int
    rows: list[CheckRow]
    first_violation: CheckViolation | None
    #: Trial id → violation kind → count, for the trials that failed.
    violations: dict[str, dict[str, int]]
    warnings: list[str]
    #: The command that runs this check again.
    command: str


def report_models() -> dict[str, type[BaseModel]]:
    """``report.<command path>`` → the model of that command's ``--json`` output."""
    from outbox.cli import commands
    from outbox.cli._common import JsonOption

    found: dict[str, type[BaseModel]] = {}
    for path, command in commands():  # every command, loaded
        for param in command.params:
            if isinstance(param, JsonOption):
                found["report." + ".".join(path)] = param.report
    return dict(sorted(found.items()))
