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

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from outbox.errors import MissingExtra

try:
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
except ImportError as exc:  # the framework is an optional extra: say which
    raise (MissingExtra.of(exc, __name__) or exc) from exc

from outbox.integrations import _scope
from outbox.integrations._scope import (
    TokenPrice,
    current_run,
    effect,
    in_run,
    tokens,
    wait_for_signal,
)
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


def _usage(response: Any) -> Mapping[str, Any]:
    usage = response.get("usage") if isinstance(response, dict) else None
    return usage or {}


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
        scope = _scope.scope_now()
        step_id = scope.next_step_id(name)
        run = scope.run
        if isinstance(operation_id, ModelRequestId):
            return await _scope.model_step(scope, step_id, body, _usage)
        with _scope.in_step(step_id):
            return await run.call(step_id, body)


async def run_agent(
    run: AsyncRun,
    agent: Agent[Any, Any],
    *args: Any,
    prefix: str = "agent:",
    price: TokenPrice = tokens,
    **kwargs: Any,
) -> Any:
    """``await agent.run(*args, **kwargs)`` with its requests and tool calls as steps of ``run``.

    Returns the agent's result. See :func:`in_run` for ``prefix`` and
    ``price`` (budget units per request from its usage; default: tokens).
    """
    async with in_run(run, prefix=prefix, price=price):
        return await agent.run(*args, **kwargs)


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
        return _scope._SCOPE.get() is not None

    def get_default_run_id(self) -> str | None:
        """A run id the same on every replay (the agent-outbox run id and a counter)."""
        scope = _scope._SCOPE.get()
        if scope is None:
            return None
        n = scope.counts.get("agent-run", 0) + 1
        scope.counts["agent-run"] = n
        return f"{scope.run.id}:{scope.prefix}{n}"

    def get_durable_operation_backend(self) -> _Backend:
        """Each unit is a step of the current run."""
        return _Backend(self.name, self.default_model_id)
