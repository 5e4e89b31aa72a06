"""The client library agents use: start a run, record tool calls, commit atomic steps.

A step's checkpoint, its intents and the caller's own rows are written in one
transaction (G1). Every step id is recorded once: a replayed step returns what
was recorded without running its function again (G5).
"""

from __future__ import annotations

import inspect
import logging
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

from outbox.audit_record import record_from_rows
from outbox.chain import Break, stored_values, value_breaks, verify_record
from outbox.client_args import (
    approval_decider,
    cancel_args,
    connect_settings,
    diff_args,
    effect_filters,
    fork_args,
    new_run,
    not_changed,
    reason_args,
    refused,
    resolve_params,
    retry_params,
    run_args,
    run_filters,
    signal_sender,
    started_run,
)
from outbox.effect_diff import RunDiff, diff_effects
from outbox.errors import (
    EffectNotFound,
    RunNotFound,
)
from outbox.gates import Gate
from outbox.models import (
    Effect,
    RunRecord,
    RunStatus,
)
from outbox.runs.approvals import expire_approvals
from outbox.runs.context import RunContext, VersionUpgrades
from outbox.runs.control import fork_run, pause_run, resume_run
from outbox.runs.intents import OutboxTransaction
from outbox.runs.run import Run
from outbox.runs.signals import SignalReceipt
from outbox.runs.stopping import (
    advance_stopping_run,
    advance_stopping_runs,
    cancel_run,
    canceller,
)
from outbox.runs.worker import Worker, WorkerSettings
from outbox.settings import Settings
from outbox.storage import Connection, Engine
from outbox.storage.engine import open_engine
from outbox.storage.notify import WakeupThrottle
from outbox.storage.sql.common import EFFECTS_CHANNEL, RUNS_CHANNEL
from outbox.storage.store import Store
from outbox.tracing import current_traceparent, run_span
from outbox.validation import as_uuid, name_field, row_limit, validated

if TYPE_CHECKING:
    from outbox.async_client import BlockingAsyncWorker

__all__ = ["Outbox"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class Outbox:
    """Entry point: a connection to the outbox store.

    Use :meth:`connect`; close it (or use it as a context manager) when done.
    """

    def __init__(self, engine: Engine, settings: Settings | None = None) -> None:
        self.settings = settings or Settings()
        self.engine = engine
        self.store = Store(engine)
        window = self.settings.notify_window_ms / 1000
        self._effects_wakeup = WakeupThrottle(
            lambda: self.store.notify(EFFECTS_CHANNEL), window_s=window
        )
        self._runs_wakeup = WakeupThrottle(lambda: self.store.notify(RUNS_CHANNEL), window_s=window)
        #: Agent-version upgrades workers of this Outbox may apply (:meth:`register_upgrade`).
        self.upgrades = VersionUpgrades()
        self._ctx = RunContext(
            self.store, self.settings, self._effects_wakeup, self._runs_wakeup, self.upgrades
        )

    @classmethod
    def connect(
        cls, dsn: str | None = None, *, settings: Settings | None = None, **overrides: Any
    ) -> Outbox:
        """Connect to ``dsn``, else ``OUTBOX_DSN``, else the embedded PostgreSQL in ``./.outbox``.

        Keyword overrides (``home=``, ``max_payload_bytes=``, ...) are
        :class:`~outbox.Settings` fields. The embedded server is started when
        needed and migrated automatically; another database must be migrated
        with ``outbox migrate`` first.
        """
        settings = connect_settings(dsn, settings, overrides)
        return cls(open_engine(settings), settings)

    def close(self) -> None:
        """Send owed wake-ups and release every connection."""
        self._effects_wakeup.close()
        self._runs_wakeup.close()
        self.engine.dispose()

    def __enter__(self) -> Outbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- runs -------------------------------------------------------------------

    def start_run(
        self,
        agent: str,
        version: str,
        inputs: Any = None,
        *,
        budget: float | None = None,
        run_id: uuid.UUID | str | None = None,
        key: str | None = None,
        on_conflict: str = "return_existing",
        priority: int = 0,
        fairness_key: str = "",
        mode: str = "live",
    ) -> Run:
        """Start a run of ``agent`` pinned to ``version``, with immutable ``inputs``.

        The run is ``runnable``: drive it from this process with :meth:`Run.call`
        and :meth:`Run.transaction`, or let a worker of that agent and version
        claim it. ``budget`` caps what its steps may spend (G7).

        ``key`` (a business key) starts one run per key: with the same agent,
        version and inputs a second start returns the existing run
        (``on_conflict="return_existing"``) or raises :class:`~outbox.RunExists`
        (``"reject"``); with others it raises :class:`~outbox.IdempotencyConflict`.
        Workers claim higher ``priority`` first and share their capacity between
        ``fairness_key`` values (a tenant, say); the run's effects inherit both.

        ``mode="dry_run"``: the run executes normally, but its effects go to the
        recording deliverer of ``outbox deliver --dry-run`` and never reach a
        sink; each one's result is the declared stub of its kind (or a recorded
        result). ``outbox runs show`` lists what would have happened and
        ``outbox runs diff`` compares it with another run.
        """
        new = new_run(
            self.settings,
            agent,
            version,
            inputs,
            budget=budget,
            run_id=run_id,
            key=key,
            on_conflict=on_conflict,
            priority=priority,
            fairness_key=fairness_key,
            mode=mode,
        )
        notify = self._runs_wakeup.inline()
        with run_span(agent=new.start.agent, version=new.start.version):
            # The run's trace: its steps are spans of it, in whichever process.
            start = replace(new.start, trace_parent=current_traceparent(), wake=notify is not None)
            record, created = self.store.insert_run(start)
        if created:
            self._runs_wakeup.committed(notify)
        record = started_run(new, record, created)
        log.info("run started", extra={"run_id": str(record.id), "agent": agent})
        if not created:
            return self.run(record.id)
        run = Run(self._ctx, record, [])
        run.started = True
        return run

    def run(self, run_id: uuid.UUID | str, *, step_id: str | None = None) -> Run:
        """Load a run (in any process) to inspect or resume it.

        With ``step_id``, the handle knows only that step of the run's history
        (if it was recorded): it reads two rows, not every step, for a caller
        that records that one step and lets the handle go (the HTTP API does,
        per request). That step replays as always; its ``completed_steps``
        lists at most that step, so use a full handle for anything else.
        """
        rid = run_args(run_id, step_id)
        loaded = self.store.load_run(rid, step_id)
        if loaded is None:
            raise RunNotFound(rid)
        return Run(self._ctx, *loaded)

    def runs(
        self, *, status: str | None = None, agent: str | None = None, limit: int = 100
    ) -> list[RunRecord]:
        """Recent runs, newest first."""
        return self.store.list_runs(**run_filters(status=status, agent=agent, limit=limit))

    def diff_runs(self, run_a: uuid.UUID | str, run_b: uuid.UUID | str) -> RunDiff:
        """Compare the effects two runs intended (a dry run against a real one, say).

        See :mod:`outbox.effect_diff`: effects are matched by step and index and
        compared on kind, payload, compensation, ordering key and key, with each
        run's own id written ``{run}``.
        """
        a, b = diff_args(run_a, run_b)
        found = {rid: self.store.list_effects(run_id=rid, limit=1_000_000) for rid in (a, b)}
        for rid in (a, b):
            if not found[rid] and self.store.load_run(rid) is None:
                raise RunNotFound(rid)
        return diff_effects(a, found[a], b, found[b])

    # -- the tamper-evident record --------------------------------------------------

    def audit_record(self, run_id: uuid.UUID | str) -> dict[str, Any]:
        """A self-contained record of a run: inputs, steps, effects, attempts, approvals (unsigned).

        Read in one snapshot; ``outbox.chain_signing.sign_record`` signs it and
        ``outbox.chain.verify_record`` (or the script in ``docs/reference/audit.md``) checks it.
        """
        return self.checked_record(run_id)[0]

    def checked_record(self, run_id: uuid.UUID | str) -> tuple[dict[str, Any], list[Break]]:
        """A run's record (:meth:`audit_record`) and every break in it, read in one snapshot.

        The breaks are those of its chains and digests (``verify_record``) and of
        its values stored by reference: a blob whose text does not hash to its
        sha256 is a break wherever the run uses it.
        """
        rid = as_uuid(run_id, "run_id")
        rows = self.store.audit_rows(rid)
        if not rows:
            raise RunNotFound(rid)
        record = record_from_rows(rows, exported_at=datetime.now(UTC))
        return record, verify_record(record) + value_breaks(stored_values(rows), rows["blobs"])

    def verify_run(self, run_id: uuid.UUID | str) -> list[Break]:
        """Recompute a run's hash chains and value digests from the database: every break."""
        return self.checked_record(run_id)[1]

    def audited_runs(self, limit: int = 100_000) -> list[uuid.UUID]:
        """Run ids, newest first: what ``outbox audit verify`` checks when no run is named."""
        return self.store.run_ids(row_limit(limit))

    # -- effects ----------------------------------------------------------------

    def effect(self, effect_id: uuid.UUID | str) -> Effect:
        """One effect by id."""
        eid = as_uuid(effect_id, "effect_id")
        found = self.store.get_effect(eid)
        if found is None:
            raise EffectNotFound(eid)
        return found

    def effects(
        self,
        *,
        run_id: uuid.UUID | str | None = None,
        step_id: str | None = None,
        status: str | None = None,
        kind: str | None = None,
        limit: int = 100,
    ) -> list[Effect]:
        """Effects in intent order, filtered by run (and step of that run), status or kind."""
        filters = effect_filters(
            run_id=run_id, step_id=step_id, status=status, kind=kind, limit=limit
        )
        return self.store.list_effects(**filters)

    def resolve_effect(
        self, effect_id: uuid.UUID | str, *, outcome: str, note: str, operator: str
    ) -> Effect:
        """Close an ``unknown`` effect after checking the outside world by hand.

        ``outcome`` is ``succeeded`` (it did happen), ``failed`` (it did not and
        must not be retried) or ``retry`` (it did not: deliver it again, same key).
        Recorded in the attempt log with ``operator`` and ``note``.
        """
        params = resolve_params(outcome=outcome, note=note, operator=operator)
        effect = self.effect(effect_id)
        if not self.store.operator_change("resolve", {"effect_id": effect.id, **params}):
            raise not_changed(effect, "resolve")
        if outcome == "retry":
            self._effects_wakeup.committed(None)
        return self.effect(effect.id)

    def retry_effect(
        self,
        effect_id: uuid.UUID | str,
        *,
        operator: str,
        extra_attempts: int = 3,
        note: str | None = None,
    ) -> Effect:
        """Put a ``failed`` effect back to ``pending`` (same key) with ``extra_attempts`` tries.

        Recorded in the attempt log with ``operator`` and, when given, ``note`` (why).
        """
        params = retry_params(extra_attempts=extra_attempts, operator=operator, note=note)
        effect = self.effect(effect_id)
        if not self.store.operator_change("retry", {"effect_id": effect.id, **params}):
            raise not_changed(effect, "retry")
        self._effects_wakeup.committed(None)
        return self.effect(effect.id)

    # -- approvals ----------------------------------------------------------------

    def approve_effect(
        self,
        effect_id: uuid.UUID | str,
        *,
        digest: str,
        note: str,
        by: str,
        request_id: str | None = None,
        via: str = "api",
    ) -> Effect:
        """Release an effect held for approval, if ``digest`` is its payload's (``Effect.digest``).

        Used once: the effect goes to ``pending`` and deliverers take it now.
        Raises :class:`~outbox.ApprovalRefused` (nothing released) when the
        digest names another payload, the effect is not awaiting approval, or
        its deadline passed (its ``on_timeout`` is applied instead). Approvals
        and refusals are kept in the attempt log with ``by`` and ``note``.
        """
        decide_in = approval_decider(
            effect_id,
            approve=True,
            digest=digest,
            note=note,
            by=by,
            via=via,
            request_id=request_id,
        )
        with self.store.run_tx() as tx:
            decision = decide_in(tx)
        refused(decision)
        self._effects_wakeup.committed(None)
        return self.effect(decision.effect_id)

    def reject_effect(
        self,
        effect_id: uuid.UUID | str,
        *,
        note: str,
        by: str,
        digest: str | None = None,
        request_id: str | None = None,
        via: str = "api",
    ) -> Effect:
        """End an effect held for approval as ``rejected``: it never reaches the sink.

        A run awaiting it raises :class:`~outbox.EffectRejected`. With ``digest``,
        the rejection applies only to that payload. Refusals as in :meth:`approve_effect`.
        """
        decide_in = approval_decider(
            effect_id,
            approve=False,
            digest=digest,
            note=note,
            by=by,
            via=via,
            request_id=request_id,
        )
        with self.store.run_tx() as tx:
            decision = decide_in(tx)
        refused(decision)
        self._runs_wakeup.committed(None)
        return self.effect(decision.effect_id)

    def expire_approvals(self, max_rows: int = 100) -> dict[str, int]:
        """Apply ``on_timeout`` to held effects past their deadline (deliverers do it too)."""
        with self.store.run_tx() as tx:
            return expire_approvals(tx, row_limit(max_rows))

    def apply_gates(self, gates: list[Gate], *, prune: bool = False) -> list[str]:
        """Store approval gates (replacing those of the same name); ``prune`` removes the rest.

        Returns the names stored. Intents written from now on are checked
        against them (``outbox gates apply --config`` does this from a file).
        """
        return self.store.apply_gates([g.row() for g in gates], prune=prune)

    def gates(self) -> list[Gate]:
        """The approval gates in force, by name."""
        return [Gate.from_row(row) for row in self.store.list_gates()]

    def remove_gates(self, names: list[str]) -> list[str]:
        """Remove gates by name; returns those that existed."""
        return self.store.remove_gates(names)

    @contextmanager
    def transaction(self, connection: Connection | None = None) -> Iterator[OutboxTransaction]:
        """Intents that belong to no run, committed with the caller's rows (plain outbox use).

        With ``connection``, the intents join the caller's open transaction (in a
        savepoint) and commit when the caller commits.
        """
        with self.store.begin(connection) as conn:
            tx = OutboxTransaction(self._ctx, conn)
            yield tx
            tx._flush()
        if connection is None:
            self._effects_wakeup.committed(tx._notified)

    # -- run control ----------------------------------------------------------------

    def pause(self, run_id: uuid.UUID | str, reason: str) -> RunStatus:
        """Pause a run: workers do not claim it, deliverers do not start its effects.

        Returns ``paused``, or ``running`` while the worker holding it finishes
        the step in flight (it records that step, then lets the run go as
        ``paused``). Effects already in flight finish and are recorded. A waiting
        run keeps its deadline, acted on at :meth:`resume` if it passed.
        """
        rid = reason_args(run_id, reason, "paused")
        with self.store.run_tx() as tx:
            return pause_run(tx, rid, reason)

    def resume(self, run_id: uuid.UUID | str) -> RunStatus:
        """Lift a pause: the run is runnable again and its held effects are delivered."""
        rid = as_uuid(run_id, "run_id")
        with self.store.run_tx() as tx:
            return resume_run(tx, rid)

    def fork(
        self,
        run_id: uuid.UUID | str,
        from_step: str,
        *,
        version: str | None = None,
        fork_id: uuid.UUID | str | None = None,
        allow_unsettled: bool = False,
    ) -> Run:
        """A new run that replays ``run_id``'s steps before ``from_step`` and runs the rest anew.

        The fork has the original's agent and inputs, pinned to ``version`` (by
        default the original's). Its recorded steps are the original's steps
        before ``from_step`` (results as recorded: they replay without calling
        their functions, and what they intended is not intended again);
        ``from_step`` and the steps after it run for real, with new idempotency
        keys. ``from_step`` may also be the step a failed run failed at. The
        original is not changed; ``run.record.forked_from`` links back to it.

        When an effect of ``from_step`` or a later step may already have taken
        effect (``unknown``, ``in_flight``, ``dispatched``), the fork would
        intend it again under a new key, so the sink could apply it twice: the
        fork is refused with :class:`~outbox.errors.ForkRefused`, which lists
        them, unless ``allow_unsettled=True``.
        """
        original, new_id, step, pinned = fork_args(run_id, from_step, version, fork_id)
        with self.store.run_tx() as tx:
            fork_run(
                tx, original, step, fork_id=new_id, version=pinned, allow_unsettled=allow_unsettled
            )
        return self.run(new_id)

    # -- signals, stopping, versions ----------------------------------------------

    def signal(
        self,
        run_id: uuid.UUID | str,
        name: str,
        payload: Any = None,
        *,
        dedup_key: str | None = None,
        request_id: str | None = None,
    ) -> SignalReceipt:
        """Send signal ``name`` with a JSON ``payload`` to a run (an approval, a webhook).

        A run waiting for it is woken within milliseconds; a run that has not
        reached its ``wait_signal`` yet finds it there. The same ``dedup_key``
        is accepted once. A finished run refuses signals (:class:`RunTerminal`).
        ``request_id`` (a signed request's signature, say) is remembered in the
        same transaction as the signal: a second request with it raises
        :class:`ReplayRefused`, and a request refused for another reason can be
        sent again.
        """
        send = signal_sender(self.settings, run_id, name, payload, dedup_key, request_id)
        with self.store.run_tx() as tx:
            return send(tx)

    def cancel(
        self, run_id: uuid.UUID | str, reason: str, *, by: str | None = None, via: str = "api"
    ) -> RunStatus:
        """Stop a run: pending effects are cancelled, in-flight ones finish, then compensation.

        Each effect the cancel stops gets a row in its attempt log (outcome
        ``cancelled``) naming ``by`` (who; default: the user this process runs
        as) with ``reason`` and ``via`` (where the cancel came from: ``api``,
        ``cli``, ``console``), in the cancel's transaction.

        Returns the run's status after moving it on as far as possible now
        (``cancelled`` when nothing needed undoing; ``cancelling`` or
        ``compensating`` while effects are still under way: workers and
        deliverers finish the job).
        """
        rid = cancel_args(run_id, reason)
        who, where = canceller(by, via)
        with self.store.run_tx() as tx:
            cancel_run(tx, rid, reason, by=who, via=where)
        with self.store.run_tx() as tx:
            status = advance_stopping_run(tx, rid)
        self._effects_wakeup.committed(None)
        return status

    def advance_stopping_runs(self) -> dict[str, int]:
        """Move cancelling and compensating runs on (workers and deliverers do this on a timer)."""
        with self.store.run_tx() as tx:
            return advance_stopping_runs(tx)

    def run_versions(self) -> list[dict[str, Any]]:
        """Unfinished runs per agent, version and status (a version with none may retire)."""
        return self.store.run_versions()

    def register_upgrade(
        self, agent: str, from_version: str, to_version: str, fn: Callable[[Any], Any]
    ) -> None:
        """Let workers of ``to_version`` take runs of ``from_version``, upgrading their state.

        ``fn(state) -> new_state`` runs once per run, when a ``to_version``
        worker claims it; the upgrade is recorded on the run (``record.upgrades``).
        Without a registered upgrade, a worker never executes a run of another
        version (G6).
        """
        self.upgrades.register(agent, from_version, to_version, fn)

    def worker(
        self, agent: str, version: str, handler: Callable[..., Any], **settings: Any
    ) -> Worker | BlockingAsyncWorker:
        """A worker that executes runnable runs of exactly this agent and version.

        ``handler(run)`` is called for each claimed run; steps it already
        recorded replay. Call ``.run()`` to work until ``.stop()``. Settings:
        see :class:`~outbox.WorkerSettings`. An ``async def`` handler gets an
        :class:`~outbox.AsyncRun`, and ``concurrency`` of them run at once on
        one event loop (an :class:`~outbox.AsyncWorker` driven from ``.run()``).
        """
        name_field(agent, "agent")
        name_field(version, "version", max_length=100)
        worker_settings = validated(WorkerSettings, **settings)
        if inspect.iscoroutinefunction(handler):
            from outbox.async_client import BlockingAsyncWorker

            return BlockingAsyncWorker(
                self.settings.model_copy(update={"dsn": self._ctx.dsn}),
                self.upgrades,
                agent,
                version,
                handler,
                worker_settings,
            )
        return Worker(self._ctx, agent, version, handler, worker_settings)
