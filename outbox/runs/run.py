"""A handle on one run: replay of recorded steps, atomic steps, waits, and its end.

The sync twin; :mod:`outbox.runs.async_run` is the async one. Both take every
rule from :class:`~outbox.runs.run_base.RunBase` and differ only in waiting.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, TypeVar

from outbox.errors import RunStateError
from outbox.faults import crash_point
from outbox.models import Effect, RunStatus
from outbox.payloads import Encoded
from outbox.runs.run_base import AlreadyRecorded, RunBase, Suspended
from outbox.runs.steps import StepTransaction, pending_intents
from outbox.runs.waits import Pending, WaitSpec, block_until
from outbox.storage import Connection
from outbox.storage.run_tx import EffectBusy

__all__ = ["Run", "Suspended"]

T = TypeVar("T")


class Run(RunBase):
    """A handle on one run: its recorded steps, state and plan, and the calls that advance it."""

    def effects(self) -> list[Effect]:
        """Every effect this run intended, in intent order, with its delivery state."""
        return self._ctx.store.list_effects(run_id=self.id, limit=1_000_000)

    def refresh(self) -> Run:
        """Re-read the run and its steps from the store."""
        self._reload(self._ctx.store.load_run(self.id))
        return self

    # -- advancing it -----------------------------------------------------------

    def call(self, step_id: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Any:
        """Call ``fn`` once for this run and record its JSON result under ``step_id``.

        ``fn`` runs outside any transaction (it may take minutes). On replay the
        recorded result is returned and ``fn`` is not called. If two processes
        race, the first recorded result wins and both return it. If ``fn``
        raises, nothing is recorded.
        """
        step_id, recorded = self._recorded_or_start(step_id)
        if recorded is not None:
            return self._replay(recorded)
        with self._span(step_id, "call"):
            crash_point("step_start", step_id, run=self.id)
            value = fn(*args, **kwargs)
            crash_point("step_end", step_id, run=self.id)
            return self._commit(step_id, "call", self._encode_result(value), None, None)

    def transaction(
        self,
        step_id: str,
        fn: Callable[[StepTransaction], Any],
        *,
        connection: Connection | None = None,
    ) -> Any:
        """Run ``fn`` in one transaction and commit its checkpoint, intents and rows together.

        If ``fn`` raises, nothing of the step is written (G1). If the step was
        already recorded, its result is returned and ``fn`` does not run (G5).
        With ``connection``, the step joins the caller's open transaction.
        """
        step_id, recorded = self._recorded_or_start(step_id)
        if recorded is not None:
            return self._replay(recorded)
        with self._span(step_id, "transaction"):
            return self._commit(step_id, "transaction", None, fn, connection)

    def complete(self, result: Any = None) -> None:
        """End the run as ``completed`` with an optional JSON result."""
        self._finish(RunStatus.COMPLETED, result=result)

    def fail(self, error: Any) -> None:
        """End the run as ``failed`` with a JSON-able description of why."""
        self._finish(RunStatus.FAILED, error=error)

    # -- waiting (G8) -------------------------------------------------------------

    def sleep(self, step_id: str, duration: timedelta | float) -> None:
        """Wait ``duration`` (a timedelta or seconds) from the first time this step is met.

        In a worker the run is parked (no process, connection or lease held)
        and resumed by its timer; in a plain script this call blocks.
        """
        self._wait(step_id, self._sleep_spec(duration))

    def sleep_until(self, step_id: str, when: datetime) -> None:
        """Wait until ``when`` (timezone-aware)."""
        self._wait(step_id, self._sleep_until_spec(when))

    def wait_signal(
        self, step_id: str, *, name: str, timeout: timedelta | float | None = None
    ) -> Any:
        """Wait for signal ``name`` (``Outbox.signal``) and return its payload.

        A signal sent before the run reaches this step is kept and consumed
        here. If ``timeout`` passes first, :class:`~outbox.SignalTimeout` is
        recorded at this step and raised now and on every replay.
        """
        return self._wait(step_id, self._signal_spec(name, timeout))

    def await_effect(
        self,
        effect: Effect | uuid.UUID | str,
        *,
        timeout: timedelta | float | None = None,
        step_id: str | None = None,
    ) -> Any:
        """Wait until ``effect`` succeeded and return its result.

        Raises :class:`~outbox.EffectFailed` if it failed or was cancelled, and
        :class:`~outbox.EffectTimeout` if ``timeout`` passes first (both
        recorded, so replays raise them too). The step id defaults to
        ``await:<effect id>``.
        """
        return self._wait(*self._effect_spec(effect, timeout, step_id))

    def _wait(self, step_id: str, spec: WaitSpec) -> Any:
        step_id, recorded = self._wait_recorded(step_id)
        if recorded is not None:
            return self._replay(recorded)
        with self._span(step_id, f"wait.{spec.kind}"):
            return self._wait_loop(step_id, spec)

    def _wait_loop(self, step_id: str, spec: WaitSpec) -> Any:
        while True:
            try:
                with self._ctx.store.run_tx() as tx:
                    outcome = self._check_wait(tx, step_id, spec)
            except EffectBusy as busy:
                with self._ctx.store.run_tx() as tx:
                    tx.settle_effect(busy)
                continue
            done, result = self._wait_done(step_id, outcome)
            if done:
                return result
            assert isinstance(outcome, Pending)
            block_until(self._ctx.dsn, spec, outcome.seconds_left, self.id)

    # -- internals --------------------------------------------------------------

    def _commit(
        self,
        step_id: str,
        kind: str,
        result: Encoded | None,
        fn: Callable[[StepTransaction], Any] | None,
        connection: Connection | None,
    ) -> Any:
        store = self._ctx.store
        wakeup = self._ctx.effects_wakeup
        try:
            with store.begin(connection) as conn:
                tx = StepTransaction(self, conn, step_id)
                if fn is not None:
                    crash_point("step_start", step_id, run=self.id)
                    value = fn(tx)
                    crash_point("step_end", step_id, run=self.id)
                    result = self._encode_result(value)
                assert result is not None
                has_intents = pending_intents(tx) > 0
                notified = wakeup.inline() if has_intents else None
                outcome = self._close_step(
                    conn, tx, step_id, kind, result, notified, connection is None
                )
        except AlreadyRecorded:
            return self._adopt(step_id, store.step_record(self.id, step_id))
        except RunStateError as exc:
            self._refused(exc)
            raise
        if connection is None:
            # Committed; a wake-up owed to the deliverers is not sent yet.
            crash_point("after_commit", step_id, run=self.id)
        if has_intents and connection is None:
            wakeup.committed(notified)
        return self._recorded(step_id, kind, tx, result, outcome)

    def _finish(self, status: RunStatus, *, result: Any = None, error: Any = None) -> None:
        values = self._finish_values(result, error)
        try:
            with self._ctx.store.begin() as conn:
                self._finish_on(conn, status, values)
        except RunStateError as exc:
            self._refused(exc)
            raise
        self._finished(status, values)
