"""The HTTP API's handlers: each request is parsed, then served by the sync ``Outbox``.

Every write goes through the Python client (``Outbox.start_run``,
``Run.transaction``, ``Outbox.signal``, ``Run.complete``), so validation,
idempotency keys, replay, fencing and wake-ups are the client's, unchanged.
The client is the sync one, called in Starlette's thread pool as the rest of
``outbox serve`` does: the server keeps one engine and one set of wake-up
throttles, and each call is one short transaction. Only the long poll waits,
and it waits on the event loop (:mod:`outbox.serve.api.watch`), never in a
thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from outbox.client_core import new_run
from outbox.errors import IdempotencyConflict, OutboxError, RunNotFound, RunTerminal
from outbox.ids import uuid7
from outbox.models import Effect, EffectStatus, RunRecord, RunStatus
from outbox.runs.steps import StepTransaction
from outbox.serve.api.errors import (
    ApiRefusal,
    parse_body,
    parse_query,
    path_uuid,
    refusal_of,
    within,
)
from outbox.serve.api.models import (
    CompleteRequest,
    EffectList,
    EffectOutcome,
    EffectQuery,
    EffectView,
    FailRequest,
    RunAnswer,
    RunList,
    RunQuery,
    RunView,
    SignalReceipt,
    SignalRequest,
    StartRunRequest,
    StepRecorded,
    StepRequest,
    WaitQuery,
)
from outbox.serve.api.watch import EffectWatch, TooManyWaiters
from outbox.serve.settings import ServeSettings

if TYPE_CHECKING:
    from outbox.client import Outbox
    from outbox.runs.run import Run

__all__ = ["ApiHandlers"]

log = logging.getLogger("outbox.serve")

Handler = Callable[[Request], Awaitable[Response]]


def _answer(status: int, model: BaseModel) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json"), status_code=status)


def refusals(handler: Callable[[Any, Request], Awaitable[Response]]) -> Any:
    """Answer a refusal raised anywhere in ``handler`` (parsing, the client) as JSON."""

    async def guarded(self: Any, request: Request) -> Response:
        try:
            return await handler(self, request)
        except ApiRefusal as refusal:
            return refusal.response()
        except OutboxError as exc:
            return refusal_of(exc).response()

    guarded.__name__ = handler.__name__
    guarded.__doc__ = handler.__doc__
    return guarded


@contextlib.contextmanager
def _part(prefix: str) -> Iterator[None]:
    """Errors about one part of a step's request name it (``intents[2].payload``)."""
    try:
        yield
    except OutboxError as exc:
        raise within(prefix, exc) from None


class ApiHandlers:
    """The handlers of one server, on one ``Outbox``."""

    def __init__(self, outbox: Outbox, settings: ServeSettings) -> None:
        self.outbox = outbox
        self.settings = settings
        self.watch = EffectWatch(
            outbox.store.finished_effects,
            interval=settings.wait_poll,
            # Long polls may take half the server's request slots, never all.
            max_waiters=max(1, settings.max_concurrency // 2),
        )

    # -- runs -----------------------------------------------------------------------

    @refusals
    async def start_run(self, request: Request) -> Response:
        """``POST /runs``."""
        body = parse_body(request, StartRunRequest)
        return await run_in_threadpool(self._start_run, body)

    def _start_run(self, body: StartRunRequest) -> Response:
        run_id = body.run_id or uuid7()
        try:
            run = self.outbox.start_run(
                body.agent,
                body.version,
                body.inputs,
                budget=body.budget,
                run_id=run_id,
                key=body.key,
                on_conflict=body.on_conflict.value,
                priority=body.priority,
                fairness_key=body.fairness_key,
                mode=body.mode.value,
            )
            # The same id, or a business key, names a run started before: a repeat.
            repeated = not run.started
            return _answer(200 if repeated else 201, RunAnswer(run=run.record, replayed=repeated))
        except OutboxError as exc:
            if body.run_id is None or getattr(exc, "field", None) != "run_id":
                raise
            try:  # the id is taken: a retry of this start, or another run's id?
                existing = self.outbox.run(body.run_id).record
            except RunNotFound:
                raise exc from None
        differs = self._differs(existing, body)
        if differs is not None:
            raise ApiRefusal(
                "run_conflict",
                f"run_id={str(body.run_id)!r} names a run started with another {differs}",
                field=differs,
            )
        return _answer(200, RunAnswer(run=existing, replayed=True))

    def _differs(self, existing: RunRecord, body: StartRunRequest) -> str | None:
        """The first argument of a repeated start that differs from the run's, if any."""
        new = new_run(
            self.outbox.settings,
            body.agent,
            body.version,
            body.inputs,
            budget=body.budget,
            run_id=body.run_id,
            mode=body.mode.value,
        )
        if existing.agent != new.start.agent:
            return "agent"
        if existing.agent_version != new.start.version:
            return "version"
        if existing.inputs_hash != new.inputs.hash and existing.inputs != new.inputs.value():
            return "inputs"
        budget = new.start.budget
        if (existing.budget is None) != (budget is None) or (
            budget is not None and existing.budget != budget
        ):
            return "budget"
        if existing.mode != body.mode:
            return "mode"
        return None

    @refusals
    async def list_runs(self, request: Request) -> Response:
        """``GET /runs``."""
        query = parse_query(request, RunQuery)
        runs = await run_in_threadpool(
            self.outbox.runs,
            status=None if query.status is None else query.status.value,
            agent=query.agent,
            limit=query.limit,
        )
        return _answer(200, RunList(runs=runs))

    @refusals
    async def get_run(self, request: Request) -> Response:
        """``GET /runs/{run_id}``."""
        run_id = path_uuid(request, "run_id")
        run = await run_in_threadpool(self.outbox.run, run_id)
        steps = [run.step(s) for s in run.completed_steps]
        return _answer(200, RunView(run=run.record, steps=[s for s in steps if s is not None]))

    # -- steps ----------------------------------------------------------------------

    @refusals
    async def record_step(self, request: Request) -> Response:
        """``POST /runs/{run_id}/steps``."""
        run_id = path_uuid(request, "run_id")
        body = parse_body(request, StepRequest)
        return await run_in_threadpool(self._record_step, run_id, body)

    def _record_step(self, run_id: uuid.UUID, body: StepRequest) -> Response:
        # Only this step of the run's history: a request per step must not read them all.
        run = self.outbox.run(run_id, step_id=body.step_id)
        written: list[Effect] = []

        def step(tx: StepTransaction) -> Any:
            if "state" in body.model_fields_set:
                with _part("state"):
                    tx.set_state(body.state)
            if "plan" in body.model_fields_set:
                with _part("plan"):
                    tx.set_plan(body.plan)
            for i, spend in enumerate(body.spend):
                with _part(f"spend[{i}]"):
                    tx.spend(spend.amount, spend.reason)
            for i, intent in enumerate(body.intents):
                compensate = intent.compensate
                with _part(f"intents[{i}]"):
                    written.append(
                        # Every field of the intent, so that one added to EffectIntent
                        # cannot be dropped here without a word (priority and approval were).
                        tx.intend(
                            intent.kind,
                            intent.payload,
                            compensate=None
                            if compensate is None
                            else (compensate.kind, compensate.payload),
                            **intent.model_dump(
                                exclude={"kind", "payload", "compensate"}, exclude_none=True
                            ),
                        )
                    )
            return body.result

        try:
            run.transaction(body.step_id, step)
        except IdempotencyConflict as exc:
            # Raised at commit: another transaction took one of our keys meanwhile.
            at = next((i for i, e in enumerate(written) if e.idempotency_key == exc.key), None)
            raise ApiRefusal(
                "idempotency_conflict",
                str(exc),
                field="intents" if at is None else f"intents[{at}].key",
                key=exc.key,
            ) from None
        return self._recorded(run, body.step_id, written)

    def _recorded(self, run: Run, step_id: str, written: list[Effect]) -> Response:
        record = run.step(step_id)
        assert record is not None
        replayed = run.last_replayed
        effects = self.outbox.effects(
            run_id=run.id, step_id=step_id, limit=self.outbox.settings.max_step_intents
        )
        if not replayed:
            # An intent whose key named an earlier intent of this run answers with that one.
            mine = {e.id for e in effects}
            effects += [e for e in written if e.id not in mine and e.step_id != step_id]
        return _answer(
            200 if replayed else 201,
            StepRecorded(step=record, replayed=replayed, effects=effects),
        )

    # -- signals and the end of a run -------------------------------------------------

    @refusals
    async def send_signal(self, request: Request) -> Response:
        """``POST /runs/{run_id}/signals``."""
        run_id = path_uuid(request, "run_id")
        body = parse_body(request, SignalRequest)
        receipt = await run_in_threadpool(
            self.outbox.signal, run_id, body.name, body.payload, dedup_key=body.dedup_key
        )
        return _answer(
            202,
            SignalReceipt(
                signal_id=receipt.signal_id, duplicate=receipt.duplicate, woke_run=receipt.woke_run
            ),
        )

    @refusals
    async def complete_run(self, request: Request) -> Response:
        """``POST /runs/{run_id}/complete``."""
        run_id = path_uuid(request, "run_id")
        body = parse_body(request, CompleteRequest)
        return await run_in_threadpool(self._finish, run_id, RunStatus.COMPLETED, body.result)

    @refusals
    async def fail_run(self, request: Request) -> Response:
        """``POST /runs/{run_id}/fail``."""
        run_id = path_uuid(request, "run_id")
        body = parse_body(request, FailRequest)
        return await run_in_threadpool(self._finish, run_id, RunStatus.FAILED, body.error)

    def _finish(self, run_id: uuid.UUID, status: RunStatus, value: Any) -> Response:
        run = self.outbox.run(run_id)
        try:
            if status == RunStatus.COMPLETED:
                run.complete(value)
            else:
                run.fail(value)
        except RunTerminal as exc:
            if exc.status != status.value:
                raise
            return _answer(200, RunAnswer(run=run.refresh().record, replayed=True))
        return _answer(200, RunAnswer(run=run.refresh().record, replayed=False))

    # -- effects --------------------------------------------------------------------

    @refusals
    async def list_effects(self, request: Request) -> Response:
        """``GET /effects``."""
        query = parse_query(request, EffectQuery)
        effects = await run_in_threadpool(
            self.outbox.effects,
            run_id=query.run_id,
            step_id=query.step_id,
            status=None if query.status is None else query.status.value,
            kind=query.kind,
            limit=query.limit,
        )
        return _answer(200, EffectList(effects=effects))

    @refusals
    async def get_effect(self, request: Request) -> Response:
        """``GET /effects/{effect_id}``."""
        effect_id = path_uuid(request, "effect_id")
        effect = await run_in_threadpool(self.outbox.effect, effect_id)
        attempts = await run_in_threadpool(self.outbox.store.attempts, effect.id)
        return _answer(200, EffectView(effect=effect, attempts=attempts))

    @refusals
    async def await_effect(self, request: Request) -> Response:
        """``GET /effects/{effect_id}/outcome?wait=S``: a long poll, bounded and cancel-safe."""
        effect_id = path_uuid(request, "effect_id")
        wait = min(parse_query(request, WaitQuery).wait, self.settings.max_wait)
        effect = await run_in_threadpool(self.outbox.effect, effect_id)
        if not effect.terminal and wait > 0:
            try:
                left, ended = await _unless_gone(request, self.watch.wait(effect.id, wait))
            except TooManyWaiters as exc:
                retry = {"Retry-After": "1"}
                raise ApiRefusal("too_many_waiters", str(exc), headers=retry) from None
            if left:
                return Response(status_code=499)  # nobody reads it: the client went away
            # None: the wait ran out; answer with where the effect is now.
            if ended is None:
                ended = await run_in_threadpool(self.outbox.effect, effect_id)
            effect = ended
        return _answer(
            200,
            EffectOutcome(
                done=effect.terminal,
                status=effect.status,
                result=effect.result,
                error=None if effect.status == EffectStatus.SUCCEEDED else effect.last_error,
                effect=effect,
            ),
        )


async def _unless_gone(
    request: Request, waiting: Awaitable[Effect | None]
) -> tuple[bool, Effect | None]:
    """(False, ``waiting``'s value), or (True, None) as soon as the client disconnects.

    Either way the other task is cancelled before this returns, so a client that
    leaves takes its waiter with it.
    """
    wait = asyncio.ensure_future(waiting)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({wait, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (wait, gone):
            task.cancel()
        await asyncio.gather(wait, gone, return_exceptions=True)
    if wait.cancelled():
        return True, None
    return False, wait.result()


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
