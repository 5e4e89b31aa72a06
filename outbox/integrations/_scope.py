"""What the framework adapters share: the run an agent works for, step ids, effects and signals.

A framework's agent runs inside :func:`in_run`; its model requests and tool
calls become steps of that run, named by the adapter. Inside a tool step,
:func:`effect` and :func:`wait_for_signal` add steps of their own, named
after the tool step, so a replay finds them again.
"""

from __future__ import annotations

import contextvars
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from outbox.errors import BudgetExceeded, ValidationError
from outbox.runs.async_run import AsyncRun
from outbox.runs.context import AsyncRunContext

__all__ = [
    "Scope",
    "TokenPrice",
    "current_run",
    "effect",
    "in_run",
    "in_step",
    "model_step",
    "scope_now",
    "tokens",
    "wait_for_signal",
]

#: Budget units one model request costs, from its token usage.
TokenPrice = Callable[[Mapping[str, Any]], float]


def tokens(usage: Mapping[str, Any]) -> float:
    """Input plus output tokens (the default price: a run's budget counts tokens)."""
    return float(usage.get("input_tokens", 0) or 0) + float(usage.get("output_tokens", 0) or 0)


@dataclass
class Scope:
    """One framework run inside one agent-outbox run: step ids are counted per name."""

    run: AsyncRun
    prefix: str
    price: TokenPrice
    counts: dict[str, int] = field(default_factory=dict)

    def next_step_id(self, name: str) -> str:
        """``<prefix><name>#<n>``: the n-th time this run reaches ``name``."""
        key = f"{self.prefix}{name}"
        n = self.counts.get(key, 0) + 1
        self.counts[key] = n
        return f"{key}#{n}"

    def sub_step_id(self, step_id: str, what: str) -> str:
        """``<step>:<what>#<n>``: the n-th ``what`` inside one step."""
        key = f"{step_id}:{what}"
        n = self.counts.get(key, 0) + 1
        self.counts[key] = n
        return f"{key}#{n}"

    def release(self, step_id: str) -> None:
        """Give back ``step_id``'s number if it is still the last one taken.

        A framework that retries a failed model request calls the model again
        for the same request: it must get the same step, or a replay would find
        the failed attempt's step empty and call the model once more.
        """
        key, _, n = step_id.rpartition("#")
        if self.counts.get(key) == int(n):
            self.counts[key] = int(n) - 1


_SCOPE: contextvars.ContextVar[Scope | None] = contextvars.ContextVar(
    "outbox_integration_scope", default=None
)
# The tool step running in this task (a context variable: parallel tools each have theirs).
_STEP: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "outbox_integration_step", default=None
)


def scope_now() -> Scope:
    """The scope of the current agent run, or a clear error outside one."""
    scope = _SCOPE.get()
    if scope is None:
        raise ValidationError(
            "run", None, "no agent-outbox run here: call this inside run_agent/run_graph or in_run"
        )
    return scope


def current_run() -> AsyncRun:
    """The agent-outbox run the current agent step belongs to."""
    return scope_now().run


@asynccontextmanager
async def in_run(
    run: AsyncRun, *, prefix: str = "agent:", price: TokenPrice = tokens
) -> AsyncIterator[AsyncRun]:
    """Make framework runs inside this block steps of ``run``, their ids starting with ``prefix``.

    Use distinct prefixes for several agent runs in one agent-outbox run. The
    agent's control flow must be deterministic given recorded results, as in
    every durable-execution engine: steps are found again by name and order.
    """
    token = _SCOPE.set(Scope(run, prefix, price))
    try:
        yield run
    finally:
        _SCOPE.reset(token)


@contextmanager
def in_step(step_id: str) -> Iterator[None]:
    """Mark ``step_id`` as the tool step this task runs (effects and signals are named after it)."""
    token = _STEP.set(step_id)
    try:
        yield
    finally:
        _STEP.reset(token)


def _base(scope: Scope, what: str) -> str:
    step = _STEP.get()
    return scope.next_step_id(what) if step is None else scope.sub_step_id(step, what)


async def effect(
    kind: str,
    payload: Any,
    *,
    timeout: timedelta | float | None = None,
    **options: Any,
) -> Any:
    """Inside a tool: intend effect ``kind`` and return its result once a deliverer has it.

    The intent commits in a step of its own, with a key derived from the run
    and that step, so every redelivery and every replay carries the same key.
    In a worker the run is parked while the effect is under way (no process,
    connection or lease held) and the tool resumes with the deliverer's
    result; a failed effect raises :class:`~outbox.EffectFailed`. ``options``
    are those of ``tx.intend`` (``compensate``, ``cost``, ``ordering_key``, ...).
    """
    scope = scope_now()
    base = _base(scope, "effect")

    async def intend(tx: Any) -> str:
        return str((await tx.intend(kind, payload, **options)).id)

    effect_id = await scope.run.transaction(f"{base}:intend", intend)
    return await scope.run.await_effect(
        uuid.UUID(effect_id), timeout=timeout, step_id=f"{base}:done"
    )


async def wait_for_signal(name: str, *, timeout: timedelta | float | None = None) -> Any:
    """Inside a tool: wait for signal ``name`` (a person's approval) and return its payload.

    Raises :class:`~outbox.SignalTimeout` when ``timeout`` passes first, now and
    on every replay. In a worker the run is parked while it waits.
    """
    scope = scope_now()
    return await scope.run.wait_signal(_base(scope, f"signal:{name}"), name=name, timeout=timeout)


async def model_step(
    scope: Scope,
    step_id: str,
    call: Callable[[], Awaitable[Any]],
    usage: Callable[[Any], Mapping[str, Any]],
) -> Any:
    """A model request as a step: called once, recorded with its usage debited from the budget.

    ``call`` returns the response as JSON data; replaying returns the recorded
    one without calling the model. The debit is keyed by the step, so a
    replay never spends twice. A run whose budget is spent is refused before
    the model is called; a request that costs more than the budget has left
    records nothing. Both raise :class:`~outbox.BudgetExceeded`, which ends
    the run in a worker (a retry would be refused again).
    """
    run = scope.run
    if run.step(step_id) is not None:
        return await run.transaction(step_id, _recorded_already)  # replays as recorded
    # A worker counts a failure of the model call (or the refusal below) against this step.
    run.active_step = step_id
    await _refuse_when_spent(run, step_id)
    response = await call()
    cost = scope.price(usage(response))

    def record(tx: Any) -> Any:
        if cost > 0:
            tx.spend(cost, "model tokens")
        return response

    return await run.transaction(step_id, record)


async def _refuse_when_spent(run: AsyncRun, step_id: str) -> None:
    """Raise :class:`~outbox.BudgetExceeded` before a model request the budget cannot pay for.

    A request's cost is known only once the model has answered, so a run with
    anything left may still make one; one with nothing left must not.
    """
    remaining = run.record.remaining_budget
    if remaining is None or remaining > 0:
        return  # no budget, or something left by the handle's own count (no round trip)
    # The handle counts its own debits and reservations, not what effects gave back
    # since (a failed costly effect releases its reservation): ask the run's row.
    ctx = run.context
    assert isinstance(ctx, AsyncRunContext)
    current = await ctx.aio.run_tx(lambda tx: ctx.store.run_record(tx.connection, run.id))
    remaining = None if current is None else current.remaining_budget
    if remaining is None or remaining > 0:
        return  # no run (the step's commit explains) or something was given back
    raise BudgetExceeded(
        run.id, 0.0, float(remaining), what=f"budget spent, model request {step_id!r} not made"
    )


def _recorded_already(tx: Any) -> Any:  # pragma: no cover - a recorded step never runs it
    raise AssertionError("a recorded step ran its function")
