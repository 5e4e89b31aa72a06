"""Pydantic AI on agent-outbox: model requests and tool calls as recorded steps of a run.

Attach :class:`OutboxDurability` to an ``Agent`` (it is a Pydantic AI
durable-execution capability, built on ``pydantic_ai.durable_exec`` the way the
Temporal, DBOS and Prefect integrations are) and run the agent inside a run
with :func:`run_agent`::

    durability = OutboxDurability()
    agent = Agent(model, name="refunds", capabilities=[durability])

    async def handler(run: AsyncRun) -> str:           # outbox worker app:handler
        result = await run_agent(run, agent, run.inputs["prompt"])
        return result.output

Inside a run:

- each model request is a step: its response is recorded with its token usage
  debited from the run's budget in the same transaction, and a replay returns
  the recorded response without calling the model again;
- each tool call is a step (``run.call``): a replay returns its recorded result;
- a tool that changes the outside world calls :func:`effect` instead of doing
  it: the effect is intended (a deliverer performs it with its idempotency
  key) and the tool returns once its result is known, the run parked at zero
  compute meanwhile;
- a human approval is :func:`wait_for_signal` with a deadline.

Outside a run the capability is transparent: the agent runs as usual.
"""

from __future__ import annotations

import contextvars
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.durable_exec import (
    JSON_CODEC,
    BaseDurabilityCapability,
    DurabilityEngineSpec,
    DurableOperationId,
    JournalCallableOperationBackend,
    ModelRequestId,
    RoleBasedOperationConfig,
)
from pydantic_ai.models import Model

from outbox.errors import ValidationError
from outbox.runs.async_run import AsyncRun
from outbox.runs.run_base import Suspended

__all__ = [
    "OutboxDurability",
    "TokenPrice",
    "current_run",
    "effect",
    "in_run",
    "run_agent",
    "wait_for_signal",
]

#: Budget units one model request costs, from its usage (default: its total tokens).
TokenPrice = Callable[[Mapping[str, Any]], float]


def tokens(usage: Mapping[str, Any]) -> float:
    """Input plus output tokens of one recorded model response."""
    return float(usage.get("input_tokens", 0) or 0) + float(usage.get("output_tokens", 0) or 0)


@dataclass
class _Scope:
    """One agent run inside one agent-outbox run: step ids are counted per name."""

    run: AsyncRun
    prefix: str
    price: TokenPrice
    counts: dict[str, int] = field(default_factory=dict)
    step: str | None = None

    def next_step_id(self, name: str) -> str:
        n = self.counts.get(name, 0) + 1
        self.counts[name] = n
        return f"{self.prefix}{name}#{n}"


_scope: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar(
    "outbox_pydantic_ai_scope", default=None
)


def _current() -> _Scope:
    scope = _scope.get()
    if scope is None:
        raise ValidationError(
            "run", None, "no agent-outbox run here: call this inside run_agent() or in_run()"
        )
    return scope


def current_run() -> AsyncRun:
    """The run the current agent step belongs to (inside :func:`run_agent`)."""
    return _current().run


@asynccontextmanager
async def in_run(
    run: AsyncRun, *, prefix: str = "agent:", price: TokenPrice = tokens
) -> AsyncIterator[AsyncRun]:
    """Make agent runs inside this block steps of ``run``, their ids starting with ``prefix``.

    Step ids are counted per operation in the order the agent reaches them, so
    the agent's own control flow must be deterministic given recorded results
    (as in every durable-execution engine). Use distinct prefixes for several
    agent runs in one agent-outbox run.
    """
    token = _scope.set(_Scope(run, prefix, price))
    try:
        yield run
    finally:
        _scope.reset(token)


async def run_agent(
    run: AsyncRun,
    agent: Agent[Any, Any],
    *args: Any,
    prefix: str = "agent:",
    price: TokenPrice = tokens,
    **kwargs: Any,
) -> Any:
    """``await agent.run(*args, **kwargs)`` as steps of ``run`` (see :func:`in_run`)."""
    async with in_run(run, prefix=prefix, price=price):
        return await agent.run(*args, **kwargs)


async def effect(
    kind: str,
    payload: Any,
    *,
    timeout: timedelta | float | None = None,
    **options: Any,
) -> Any:
    """Inside a tool: intend effect ``kind`` and return its result once a deliverer has it.

    The intent commits in its own step with a key derived from the run and the
    tool call, so every redelivery and every replay carries the same key. The
    run is parked while the effect is under way (no process or connection
    held) and the tool resumes with the deliverer's result; a failed effect
    raises :class:`~outbox.EffectFailed`. ``options`` are those of
    ``tx.intend`` (``compensate``, ``cost``, ``ordering_key``, ...).
    """
    scope = _current()
    base = scope.step or scope.next_step_id("effect")
    run = scope.run

    async def intend(tx: Any) -> str:
        return str((await tx.intend(kind, payload, **options)).id)

    effect_id = await run.transaction(f"{base}:intend", intend)
    return await run.await_effect(uuid.UUID(effect_id), timeout=timeout, step_id=f"{base}:done")


async def wait_for_signal(name: str, *, timeout: timedelta | float | None = None) -> Any:
    """Inside a tool: wait for signal ``name`` (a human's approval) and return its payload.

    Raises :class:`~outbox.SignalTimeout` when ``timeout`` passes first (and on
    every replay). The run is parked while it waits.
    """
    scope = _current()
    base = scope.step or scope.next_step_id("signal")
    return await scope.run.wait_signal(f"{base}:{name}", name=name, timeout=timeout)


class _Backend(JournalCallableOperationBackend[None]):
    """Runs each durable unit as a step of the current run."""

    def __init__(self, agent_name: str, default_model_id: str | None) -> None:
        super().__init__(
            agent_name=agent_name,
            default_model_id=default_model_id,
            config=RoleBasedOperationConfig(model=None, event=None, capability=None, tool=None),
        )

    async def execute(
        self,
        *,
        operation_id: DurableOperationId,
        name: str,
        body: Callable[[], Awaitable[object]],
        cache_key: tuple[object, ...],
        config: None,
    ) -> object:
        scope = _current()
        step_id = scope.next_step_id(name)
        run = scope.run
        if isinstance(operation_id, ModelRequestId):
            return await _model_step(scope, step_id, body)
        outer = scope.step
        scope.step = step_id
        try:
            return await run.call(step_id, body)
        finally:
            scope.step = outer


async def _model_step(scope: _Scope, step_id: str, body: Callable[[], Awaitable[object]]) -> Any:
    """A model request: called once, recorded with its usage debited from the budget."""
    run = scope.run
    recorded = run.step(step_id)
    if recorded is not None:
        return await run.transaction(step_id, _unreachable)  # replays (or raises) as recorded
    response: Any = await body()
    usage = response.get("usage") or {} if isinstance(response, dict) else {}
    cost = scope.price(usage)

    def record(tx: Any) -> Any:
        if cost > 0:
            tx.spend(cost, "model tokens")
        return response

    return await run.transaction(step_id, record)


def _unreachable(tx: Any) -> Any:  # pragma: no cover - a recorded step never runs its function
    raise AssertionError("a recorded step ran its function")


class OutboxDurability(BaseDurabilityCapability[Any]):
    """A Pydantic AI capability that records an agent's model requests and tool calls as steps.

    Pass it in ``Agent(..., capabilities=[OutboxDurability()])`` and run the
    agent with :func:`run_agent` inside an agent-outbox run. The agent needs a
    ``name`` (or pass ``name=``): it prefixes the recorded step names.
    """

    engine_spec = DurabilityEngineSpec(
        engine_name="agent-outbox",
        durable_unit_noun="step",
        durable_container_noun="run",
        # Steps are JSON in PostgreSQL: responses and tool results are reduced to JSON.
        codec=JSON_CODEC,
        wrapped_toolset_kinds=frozenset({"function", "dynamic"}),
        toolset_lifecycles={"function": "enter-always", "dynamic": "enter-never"},
        journal_discovery=True,
        # Step ids are counted in the order operations are reached: tool calls
        # one after another keep that order the same on every replay.
        sequential_tools_in_durable_context=True,
        cancellation_error_types=(Suspended,),
    )

    def __init__(self, *, models: Mapping[str, Model] | None = None, name: str | None = None):
        super().__init__(models=models, name=name)

    @property
    def in_durable_context(self) -> bool:
        """Inside :func:`run_agent` / :func:`in_run`."""
        return _scope.get() is not None

    def get_default_run_id(self) -> str | None:
        """A run id the same on every replay (the agent-outbox run id and a counter)."""
        scope = _scope.get()
        if scope is None:
            return None
        n = scope.counts.get("agent-run", 0) + 1
        scope.counts["agent-run"] = n
        return f"{scope.run.id}:{scope.prefix}{n}"

    def get_durable_operation_backend(self) -> _Backend:
        """Each unit is a step of the current run."""
        return _Backend(self.name, self.default_model_id)
