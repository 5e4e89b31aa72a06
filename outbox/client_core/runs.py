"""A client's operations on runs: start, load, list, compare, fork, pause, signal, cancel."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any

from outbox.blobs import store_value
from outbox.errors import ReplayRefused, RunNotFound, ValidationError
from outbox.governance.effect_diff import RunDiff, diff_effects
from outbox.governance.intent_rules import MAX_KEY_LENGTH
from outbox.ids import uuid7
from outbox.models import RunMode, RunRecord, RunStart, RunStatus
from outbox.payloads import Encoded, encode_value
from outbox.runs.control import fork_run, pause_run, resume_run
from outbox.runs.signals import SignalReceipt, send_signal
from outbox.runs.stopping import advance_stopping_run, cancel_run, canceller
from outbox.settings import Settings
from outbox.shards import key_shard, on_shard, shard_of
from outbox.storage.writes import RunStart as RunStartRow
from outbox.tracing import current_traceparent, run_span
from outbox.validation import as_uuid, name_field, row_limit, validated

from .base import ClientBase, LoadedRun

__all__ = ["NewRun", "RunOperations", "new_run", "run_filters", "started_run"]

log = logging.getLogger("outbox.client")


class RunOperations(ClientBase):
    """Runs, as both clients operate on them (the clients wrap loaded runs in handles)."""

    def _start_run(
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
    ) -> LoadedRun:
        """Start a run of ``agent`` pinned to ``version``, with immutable ``inputs``.

        The run is ``runnable``: drive it from this process with ``run.call``
        and ``run.transaction``, or let a worker of that agent and version
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
            return self._load_run(record.id)
        return LoadedRun(record, [], started=True)

    def _load_run(self, run_id: uuid.UUID | str, *, step_id: str | None = None) -> LoadedRun:
        """Load a run (in any process) to inspect or resume it.

        With ``step_id``, the handle knows only that step of the run's history
        (if it was recorded): it reads two rows, not every step, for a caller
        that records that one step and lets the handle go (the HTTP API does,
        per request). That step replays as always; its ``completed_steps``
        lists at most that step, so use a full handle for anything else.
        """
        rid = as_uuid(run_id, "run_id")
        if step_id is not None:
            name_field(step_id, "step_id", max_length=MAX_KEY_LENGTH)
        loaded = self.store.load_run(rid, step_id)
        if loaded is None:
            raise RunNotFound(rid)
        return LoadedRun(*loaded)

    def _fork(
        self,
        run_id: uuid.UUID | str,
        from_step: str,
        *,
        version: str | None = None,
        fork_id: uuid.UUID | str | None = None,
        allow_unsettled: bool = False,
    ) -> LoadedRun:
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
        original = as_uuid(run_id, "run_id")
        name_field(from_step, "from_step")
        if version is not None:
            name_field(version, "version", max_length=100)
        # on the original's shard: the copy touches one shard
        new_id = (
            on_shard(uuid7(), shard_of(original))
            if fork_id is None
            else as_uuid(fork_id, "fork_id")
        )
        with self.store.run_tx() as tx:
            fork_run(
                tx,
                original,
                from_step,
                fork_id=new_id,
                version=version,
                allow_unsettled=allow_unsettled,
            )
        return self._load_run(new_id)

    def runs(
        self, *, status: str | None = None, agent: str | None = None, limit: int = 100
    ) -> list[RunRecord]:
        """Recent runs, newest first."""
        return self.store.list_runs(**run_filters(status=status, agent=agent, limit=limit))

    def diff_runs(self, run_a: uuid.UUID | str, run_b: uuid.UUID | str) -> RunDiff:
        """Compare the effects two runs intended (a dry run against a real one, say).

        See :mod:`outbox.governance.effect_diff`: effects are matched by step and index and
        compared on kind, payload, compensation, ordering key and key, with each
        run's own id written ``{run}``.
        """
        a, b = as_uuid(run_a, "run_a"), as_uuid(run_b, "run_b")
        found = {rid: self.store.list_effects(run_id=rid, limit=1_000_000) for rid in (a, b)}
        for rid in (a, b):
            if not found[rid] and self.store.load_run(rid) is None:
                raise RunNotFound(rid)
        return diff_effects(a, found[a], b, found[b])

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

    # -- run control ----------------------------------------------------------------

    def pause(self, run_id: uuid.UUID | str, reason: str) -> RunStatus:
        """Pause a run: workers do not claim it, deliverers do not start its effects.

        Returns ``paused``, or ``running`` while the worker holding it finishes
        the step in flight (it records that step, then lets the run go as
        ``paused``). Effects already in flight finish and are recorded. A waiting
        run keeps its deadline, acted on at :meth:`resume` if it passed.
        """
        rid = _reasoned(run_id, reason, "paused")
        with self.store.run_tx() as tx:
            return pause_run(tx, rid, reason)

    def resume(self, run_id: uuid.UUID | str) -> RunStatus:
        """Lift a pause: the run is runnable again and its held effects are delivered."""
        rid = as_uuid(run_id, "run_id")
        with self.store.run_tx() as tx:
            return resume_run(tx, rid)

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
        rid = as_uuid(run_id, "run_id")
        name_field(name, "name")
        if dedup_key is not None:
            name_field(dedup_key, "dedup_key", max_length=MAX_KEY_LENGTH)
        if request_id is not None:
            name_field(request_id, "request_id", max_length=MAX_KEY_LENGTH)
        stored = store_value(payload, field="payload", limits=self.settings.value_limits)
        with self.store.run_tx() as tx:
            if request_id is not None and not tx.mark_replay(request_id):
                raise ReplayRefused("request_id", request_id)
            return send_signal(
                tx, rid, name, stored.json, dedup_key or uuid.uuid4().hex, stored.blob
            )

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
        rid = _reasoned(run_id, reason, "cancelled")
        who, where = canceller(by, via)
        with self.store.run_tx() as tx:
            cancel_run(tx, rid, reason, by=who, via=where)
        with self.store.run_tx() as tx:
            status = advance_stopping_run(tx, rid)
        self._effects_wakeup.committed(None)
        return status

    def advance_stopping_runs(self) -> dict[str, int]:
        """Move a page of cancelling and compensating runs on, after the last call's page.

        Workers and deliverers do this on a timer. Returns how many runs the
        page left in each state.
        """
        with self.store.run_tx() as tx:
            return self._stopping(tx)


def _reasoned(run_id: uuid.UUID | str, reason: str, done: str) -> uuid.UUID:
    """Validate an operator's action on a run that must say why (cancel, pause)."""
    rid = as_uuid(run_id, "run_id")
    if not isinstance(reason, str) or not reason.strip():
        raise ValidationError("reason", reason, f"say why the run is {done}")
    name_field(reason, "reason", max_length=2000)
    return rid


@dataclass(frozen=True)
class NewRun:
    """A validated new run: what ``outbox_begin_run`` takes, and its inputs encoded."""

    start: RunStartRow
    inputs: Encoded


def new_run(
    settings: Settings,
    agent: str,
    version: str,
    inputs: Any,
    *,
    budget: float | None,
    run_id: uuid.UUID | str | None,
    key: str | None = None,
    on_conflict: str = "return_existing",
    priority: int = 0,
    fairness_key: str = "",
    mode: str = "live",
) -> NewRun:
    """The validated row of a new run (``start_run``, and the HTTP API's start)."""
    start = validated(
        RunStart,
        agent=agent,
        version=version,
        inputs=inputs,
        budget=budget,
        key=key,
        on_conflict=on_conflict,
        priority=priority,
        fairness_key=fairness_key,
        mode=mode,
    )
    encoded = encode_value(start.inputs, field="inputs", max_bytes=settings.max_payload_bytes)
    if run_id is not None:
        chosen = as_uuid(run_id, "run_id")
    elif start.key is not None:  # on its key's shard: the start touches one shard
        chosen = on_shard(uuid7(), key_shard(settings.namespace, start.key))
    else:
        chosen = uuid7()
    row = RunStartRow(
        id=chosen,
        namespace=settings.namespace,
        agent=start.agent,
        version=start.version,
        inputs_json=encoded.json,
        budget=None if start.budget is None else Decimal(str(start.budget)),
        key=start.key,
        priority=start.priority,
        fairness_key=start.fairness_key,
        dry_run=start.mode == RunMode.DRY_RUN,
        on_conflict=start.on_conflict.value,
    )
    return NewRun(row, encoded)


def started_run(new: NewRun, record: RunRecord, created: bool) -> RunRecord:
    """The run ``start_run`` returns, with its inputs as given (a large one is stored apart)."""
    if created:
        return record.model_copy(update={"inputs": new.inputs.value()})
    return record


def run_filters(*, status: str | None, agent: str | None, limit: int) -> dict[str, Any]:
    """Validated filters of ``runs()``."""
    if status is not None and status not in RunStatus.__members__.values():
        raise ValidationError("status", status, f"not one of {[s.value for s in RunStatus]}")
    if agent is not None:
        name_field(agent, "agent")
    return {"status": status, "agent": agent, "limit": row_limit(limit)}
