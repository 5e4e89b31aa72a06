"""The async twin of :class:`~outbox.Run`: the same steps, replay, waits and end, awaited.

Every rule comes from :class:`~outbox.runs.run_base.RunBase` and
:class:`~outbox.runs.steps.StepWrites`; what a step writes is checked and
committed by the same sync code, run on the async connection through
``AsyncConnection.run_sync`` (a greenlet, not a thread). The step function
gets an ``AsyncConnection`` for the caller's own rows.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import uuid
from collections.abc import Awaitable, Callable, Generator
from datetime import datetime, timedelta
from typing import Any

from outbox.errors import RunStateError, ValidationError
from outbox.faults import crash_point
from outbox.governance.gates import ApprovalPolicy
from outbox.models import Effect, RunStatus
from outbox.payloads import Encoded
from outbox.runs.context import AsyncRunContext
from outbox.runs.intents import OutboxTransaction, PreparedIntent, intend_options
from outbox.runs.run_base import AlreadyRecorded, RunBase
from outbox.runs.steps import StepWrites, pending_intents
from outbox.runs.waits import Pending, WaitSpec, wait_until
from outbox.storage import AsyncConnection, Connection
from outbox.storage.run_tx import EffectBusy, RunTx

__all__ = ["AsyncOutboxTransaction", "AsyncRun", "AsyncStepTransaction"]


def _sync_connection(connection: AsyncConnection) -> Connection:
    sync = connection.sync_connection
    assert sync is not None, "the AsyncConnection is not open"
    return sync


class _Intend:
    """The awaitable ``tx.intend(...)`` returns; a step refuses to commit with one not awaited.

    A forgotten ``await`` would otherwise drop the intent with nothing but a
    warning: a lost effect. The coroutine is made only when awaited.
    """

    def __init__(self, pending: set[_Intend], make: Callable[[], Awaitable[Effect]], kind: Any):
        self._pending = pending
        self._make = make
        self.kind = kind
        pending.add(self)

    def __await__(self) -> Generator[Any, None, Effect]:
        self._pending.discard(self)
        return self._make().__await__()


def _check_awaited(pending: set[_Intend], where: str) -> None:
    if pending:
        kinds = sorted(str(p.kind) for p in pending)
        raise ValidationError(
            "intend", kinds[0], f"was not awaited ({len(kinds)} intent(s)); {where} wrote nothing"
        )


async def _lookup(
    connection: AsyncConnection, intents: Any, prepared: PreparedIntent
) -> Effect | None:
    if not prepared.caller_key:
        return None
    found: Effect | None = await connection.run_sync(lambda _: intents.lookup(prepared.key))
    return found


class AsyncStepTransaction(StepWrites):
    """What an async atomic step's function receives: one open transaction.

    ``connection`` is a SQLAlchemy ``AsyncConnection`` in that transaction: rows
    the caller writes on it commit (or roll back) together with the checkpoint
    and the intents. ``await tx.intend(...)`` (it may look a caller's key up);
    ``set_state``, ``set_plan`` and ``spend`` are plain calls, as in the sync twin.
    """

    def __init__(self, run: AsyncRun, connection: AsyncConnection, step_id: str) -> None:
        super().__init__(run, _sync_connection(connection), step_id)
        self.connection = connection
        self._unawaited: set[_Intend] = set()

    def intend(
        self,
        kind: str,
        payload: Any,
        *,
        key: str | None = None,
        ordering_key: str | None = None,
        max_attempts: int | None = None,
        delay_seconds: float = 0.0,
        schema_version: int = 1,
        compensate: tuple[str, Any] | None = None,
        cost: float | None = None,
        priority: int | None = None,
        fairness_key: str | None = None,
        approval: bool | ApprovalPolicy | dict[str, Any] | None = None,
    ) -> Awaitable[Effect]:
        """Record that effect ``kind`` with ``payload`` must happen, once, if this step commits.

        Await it. Same rules as :meth:`outbox.StepTransaction.intend`: a key
        derived from (run, step, index) unless you pass your own, which must be
        unique across runs (same payload: the existing intent; another:
        :class:`~outbox.IdempotencyConflict`); priority and fairness key default
        to the run's.
        """
        options = intend_options(
            key=key,
            ordering_key=ordering_key,
            max_attempts=max_attempts,
            delay_seconds=delay_seconds,
            schema_version=schema_version,
            compensate=compensate,
            cost=cost,
            priority=priority,
            fairness_key=fairness_key,
            approval=approval,
        )

        async def intend() -> Effect:
            prepared, before = self._prepare_intent(kind, payload, options)
            existing = None
            if not isinstance(prepared, Effect):
                existing = await _lookup(self.connection, self._intents, prepared)
            return self._record_intent(prepared, existing, before)

        return _Intend(self._unawaited, intend, kind)


class AsyncOutboxTransaction:
    """Run-less intents inside one async transaction: ``tx.connection`` and ``await tx.intend``."""

    def __init__(self, ctx: AsyncRunContext, connection: AsyncConnection) -> None:
        self.connection = connection
        self._plain = OutboxTransaction(ctx, _sync_connection(connection))
        self._unawaited: set[_Intend] = set()

    def intend(
        self, kind: str, payload: Any, *, key: str | None = None, **options: Any
    ) -> Awaitable[Effect]:
        """Record that effect ``kind`` with ``payload`` must happen once this commits (await it)."""
        intents = self._plain._intents

        async def intend() -> Effect:
            prepared = intents.prepare(
                run_id=None,
                step_id=None,
                kind=kind,
                payload=payload,
                options={"key": key, **options},
            )
            if isinstance(prepared, Effect):
                return prepared
            return intents.record(prepared, await _lookup(self.connection, intents, prepared))

        return _Intend(self._unawaited, intend, kind)

    @property
    def _notified(self) -> float | None:
        return self._plain._notified

    async def _flush(self) -> None:
        _check_awaited(self._unawaited, "the transaction")
        await self.connection.run_sync(self._plain._flush_on)


class AsyncRun(RunBase):
    """A handle on one run for async agents: ``await`` every call that advances it."""

    def __init__(self, ctx: AsyncRunContext, *args: Any, **kwargs: Any) -> None:
        super().__init__(ctx, *args, **kwargs)
        self._actx = ctx

    async def effects(self) -> list[Effect]:
        """Every effect this run intended, in intent order, with its delivery state."""
        store = self._actx.store
        return await self._actx.aio.call(store.list_effects, run_id=self.id, limit=1_000_000)

    async def refresh(self) -> AsyncRun:
        """Re-read the run and its steps from the store."""
        self._reload(await self._actx.aio.call(self._actx.store.load_run, self.id))
        return self

    # -- advancing it -----------------------------------------------------------

    async def call(self, step_id: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ``fn`` once for this run and record its JSON result under ``step_id``.

        ``fn`` may be ``async def`` (awaited) or a plain function (run in a
        thread, so a blocking tool does not stall the other runs on this loop).
        Replay, races and failures as in :meth:`outbox.Run.call`.
        """
        step_id, recorded = self._recorded_or_start(step_id)
        if recorded is not None:
            return self._replay(recorded)
        with self._span(step_id, "call"):
            crash_point("step_start", step_id, run=self.id)
            if inspect.iscoroutinefunction(fn):
                value = await fn(*args, **kwargs)
            else:
                value = await asyncio.to_thread(fn, *args, **kwargs)
                if inspect.isawaitable(value):
                    value = await value
            crash_point("step_end", step_id, run=self.id)
            return await self._commit(step_id, "call", self._encode_result(value), None, None)

    async def transaction(
        self,
        step_id: str,
        fn: Callable[[AsyncStepTransaction], Any],
        *,
        connection: AsyncConnection | None = None,
    ) -> Any:
        """Run ``fn(tx)`` in one transaction; commit its checkpoint, intents and rows together.

        ``fn`` may be ``async def`` or plain (called on the loop: keep it quick,
        it holds the transaction). If it raises, nothing of the step is written
        (G1); a recorded step returns its result without running ``fn`` (G5).
        With ``connection`` (an ``AsyncConnection``), the step joins the caller's
        open transaction.
        """
        step_id, recorded = self._recorded_or_start(step_id)
        if recorded is not None:
            return self._replay(recorded)
        with self._span(step_id, "transaction"):
            return await self._commit(step_id, "transaction", None, fn, connection)

    async def complete(self, result: Any = None) -> None:
        """End the run as ``completed`` with an optional JSON result."""
        await self._finish(RunStatus.COMPLETED, result=result)

    async def fail(self, error: Any) -> None:
        """End the run as ``failed`` with a JSON-able description of why."""
        await self._finish(RunStatus.FAILED, error=error)

    # -- waiting (G8) -------------------------------------------------------------

    async def sleep(self, step_id: str, duration: timedelta | float) -> None:
        """Wait ``duration`` from the first time this step is met (parked in a worker)."""
        await self._wait(step_id, self._sleep_spec(duration))

    async def sleep_until(self, step_id: str, when: datetime) -> None:
        """Wait until ``when`` (timezone-aware)."""
        await self._wait(step_id, self._sleep_until_spec(when))

    async def wait_signal(
        self, step_id: str, *, name: str, timeout: timedelta | float | None = None
    ) -> Any:
        """Wait for signal ``name`` and return its payload (see :meth:`outbox.Run.wait_signal`)."""
        return await self._wait(step_id, self._signal_spec(name, timeout))

    async def await_effect(
        self,
        effect: Effect | uuid.UUID | str,
        *,
        timeout: timedelta | float | None = None,
        step_id: str | None = None,
    ) -> Any:
        """Wait until ``effect`` succeeded; return its result (:meth:`outbox.Run.await_effect`)."""
        return await self._wait(*self._effect_spec(effect, timeout, step_id))

    async def _wait(self, step_id: str, spec: WaitSpec) -> Any:
        step_id, recorded = self._wait_recorded(step_id)
        if recorded is not None:
            return self._replay(recorded)
        with self._span(step_id, f"wait.{spec.kind}"):
            return await self._wait_loop(step_id, spec)

    async def _wait_loop(self, step_id: str, spec: WaitSpec) -> Any:
        while True:
            try:
                outcome = await self._actx.aio.run_tx(
                    lambda tx: self._check_wait(tx, step_id, spec)
                )
            except EffectBusy as busy:
                await self._actx.aio.run_tx(functools.partial(RunTx.settle_effect, busy=busy))
                continue
            done, result = self._wait_done(step_id, outcome)
            if done:
                return result
            assert isinstance(outcome, Pending)
            await wait_until(self._ctx.dsn, spec, outcome.seconds_left, self.id)

    # -- internals --------------------------------------------------------------

    async def _commit(
        self,
        step_id: str,
        kind: str,
        result: Encoded | None,
        fn: Callable[[AsyncStepTransaction], Any] | None,
        connection: AsyncConnection | None,
    ) -> Any:
        aio = self._actx.aio
        wakeup = self._ctx.effects_wakeup
        try:
            async with aio.begin(connection) as conn:
                tx = AsyncStepTransaction(self, conn, step_id)
                if fn is not None:
                    crash_point("step_start", step_id, run=self.id)
                    value = fn(tx)
                    if inspect.isawaitable(value):
                        value = await value
                    crash_point("step_end", step_id, run=self.id)
                    _check_awaited(tx._unawaited, f"step {step_id!r}")
                    result = self._encode_result(value)
                assert result is not None
                has_intents = pending_intents(tx) > 0
                notified = wakeup.inline() if has_intents else None
                outcome = await conn.run_sync(
                    self._close_step, tx, step_id, kind, result, notified, connection is None
                )
        except AlreadyRecorded:
            recorded = await aio.call(self._ctx.store.step_record, self.id, step_id)
            return self._adopt(step_id, recorded)
        except RunStateError as exc:
            self._refused(exc)
            raise
        if connection is None:
            # Committed; a wake-up owed to the deliverers is not sent yet.
            crash_point("after_commit", step_id, run=self.id)
        if has_intents and connection is None:
            wakeup.committed(notified)
        return self._recorded(step_id, kind, tx, result, outcome)

    async def _finish(self, status: RunStatus, *, result: Any = None, error: Any = None) -> None:
        values = self._finish_values(result, error)
        try:
            async with self._actx.aio.begin(None) as conn:
                await conn.run_sync(self._finish_on, status, values)
        except RunStateError as exc:
            self._refused(exc)
            raise
        self._finished(status, values)
