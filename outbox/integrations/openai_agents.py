"""OpenAI Agents SDK on agent-outbox: an agent's model calls and tool calls as recorded steps.

Run the agent with :func:`run_agent` inside a run instead of ``Runner.run``::

    agent = Agent(name="refunds", model="gpt-4.1", tools=[lookup_order, refund])

    async def handler(run: AsyncRun) -> str:             # outbox worker app:handler
        result = await run_agent(run, agent, run.inputs["ask"])
        return result.final_output

Inside a run:

- each model request is a step, counted in the order the run makes them: its
  response is recorded with its token usage debited from the run's budget in
  the same transaction, and a replay returns the recorded response without
  calling the model again. A request the SDK retries after a failed attempt
  keeps its step;
- each function tool call is a step (``run.call``) named by its tool call id
  (which comes from a recorded model response): a replay returns its recorded
  result without running the tool;
- a tool that changes the outside world calls :func:`effect` instead of doing
  it: the effect is intended (a deliverer performs it with its idempotency
  key) and the tool returns once its result is known, the run parked at zero
  compute meanwhile;
- a human approval is :func:`wait_for_signal` with a deadline;
- an error of the run escaping a tool (a payload that is not JSON, a spent
  budget) ends :func:`run_agent` with that error, where the SDK would hand
  it to the model as "please try again"; a tool's other errors, a failed
  effect and a signal timeout among them, reach the model as the SDK decides.

:func:`run_agent` records the agent and every agent it hands off to: it runs a
copy of each whose model (a ``Model`` instance, or a name looked up by the run
config's provider) and function tools record. Outside a run nothing changes.
"""

from __future__ import annotations

import contextvars
import dataclasses
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from outbox.errors import MissingExtra

try:
    from agents import (
        Agent,
        FunctionTool,
        Handoff,
        Model,
        ModelProvider,
        ModelResponse,
        ModelSettings,
        ModelTracing,
        RunConfig,
        RunContextWrapper,
        Runner,
        RunResult,
        Tool,
    )
    from agents.agent_output import AgentOutputSchemaBase
    from agents.exceptions import AgentsException
    from agents.items import TResponseInputItem, TResponseStreamEvent
    from agents.retry import ModelRetryAdvice, ModelRetryAdviceRequest, ModelRetryNormalizedError
    from agents.run_config import ToolErrorFormatter, ToolErrorFormatterArgs
    from agents.tool_context import ToolContext
    from openai.types.responses.response_prompt_param import ResponsePromptParam
except ImportError as exc:  # the framework is an optional extra: say which
    raise (MissingExtra.of(exc, __name__) or exc) from exc
from pydantic import TypeAdapter
from pydantic_core import to_jsonable_python

from outbox.errors import EffectFailed, OutboxError, ValidationError, WaitTimeout
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

__all__ = [
    "RecordedModel",
    "RecordedModelProvider",
    "TokenPrice",
    "current_run",
    "effect",
    "in_run",
    "record_tool",
    "run_agent",
    "wait_for_signal",
]

# A response as JSON and back: by alias and only the fields the model set, so the
# replayed response equals the one the model gave.
_RESPONSE: TypeAdapter[ModelResponse] = TypeAdapter(ModelResponse)


def _usage(recorded: Any) -> Mapping[str, Any]:
    usage = recorded.get("usage") if isinstance(recorded, dict) else None
    return usage or {}


def _step_id(scope: _scope.Scope, what: str) -> str:
    """``<prefix><what>#n`` for the agent, ``<tool step>:<what>#n`` inside a tool (nested agent)."""
    step = _scope._STEP.get()
    return scope.next_step_id(what) if step is None else scope.sub_step_id(step, what)


class RecordedModel(Model):
    """A ``Model`` whose responses inside a run are recorded steps, replayed without a call.

    :func:`run_agent` wraps every model the agent uses; use it directly only
    for a model the runner cannot see (an agent run by a tool of your own).
    Outside a run it simply calls ``model``. Streamed responses
    (``Runner.run_streamed``) are refused inside a run: they are not recorded.
    """

    def __init__(self, model: Model) -> None:
        self.model = model

    async def get_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[Tool],
        output_schema: AgentOutputSchemaBase | None,
        handoffs: list[Handoff[Any, Any]],
        tracing: ModelTracing,
        *,
        previous_response_id: str | None,
        conversation_id: str | None,
        prompt: ResponsePromptParam | None,
    ) -> ModelResponse:
        """The model's response: recorded once per run and request, then replayed."""

        async def ask() -> ModelResponse:
            return await self.model.get_response(
                system_instructions,
                input,
                model_settings,
                tools,
                output_schema,
                handoffs,
                tracing,
                previous_response_id=previous_response_id,
                conversation_id=conversation_id,
                prompt=prompt,
            )

        async def call() -> Any:
            response = await ask()
            return _RESPONSE.dump_python(response, mode="json", by_alias=True, exclude_unset=True)

        scope = _scope._SCOPE.get()
        if scope is None:
            return await ask()
        step_id = _step_id(scope, "model")
        try:
            recorded = await _scope.model_step(scope, step_id, call, _usage)
        except BaseException:
            scope.release(step_id)  # the SDK's retry of this request takes the same step
            raise
        return _RESPONSE.validate_python(recorded)

    async def stream_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[Tool],
        output_schema: AgentOutputSchemaBase | None,
        handoffs: list[Handoff[Any, Any]],
        tracing: ModelTracing,
        *,
        previous_response_id: str | None,
        conversation_id: str | None,
        prompt: ResponsePromptParam | None,
    ) -> AsyncIterator[TResponseStreamEvent]:
        """Stream from the model outside a run; inside one, refused (streams are not recorded)."""
        if _scope._SCOPE.get() is not None:
            raise ValidationError(
                "stream_response",
                type(self.model).__name__,
                "streamed runs are not recorded: inside a run use run_agent (Runner.run)",
            )
        async for event in self.model.stream_response(
            system_instructions,
            input,
            model_settings,
            tools,
            output_schema,
            handoffs,
            tracing,
            previous_response_id=previous_response_id,
            conversation_id=conversation_id,
            prompt=prompt,
        ):
            yield event

    def get_retry_advice(self, request: ModelRetryAdviceRequest) -> ModelRetryAdvice | None:
        """Never retry a request the run refused; otherwise the wrapped model's advice."""
        if isinstance(request.error, OutboxError):
            # Budget spent, run ended, lease lost: a retry would be refused again, perhaps
            # after paying for another model call. An abort vetoes any retry policy.
            return ModelRetryAdvice(
                suggested=False,
                reason=str(request.error),
                normalized=ModelRetryNormalizedError(is_abort=True),
            )
        return self.model.get_retry_advice(request)

    async def close(self) -> None:
        """Close the wrapped model."""
        await self.model.close()

    async def _cleanup_on_run_end(self, owner: object) -> None:
        await self.model._cleanup_on_run_end(owner)


class RecordedModelProvider(ModelProvider):
    """A ``ModelProvider`` whose models are :class:`RecordedModel` (``run_agent`` installs it)."""

    def __init__(self, provider: ModelProvider) -> None:
        self.provider = provider

    def get_model(self, model_name: str | None) -> Model:
        """The provider's model for ``model_name``, recorded."""
        return _recorded(self.provider.get_model(model_name))

    async def aclose(self) -> None:
        """Close the wrapped provider."""
        await self.provider.aclose()


def _recorded(model: Model) -> Model:
    return model if isinstance(model, RecordedModel) else RecordedModel(model)


# Marks a tool function as recording, so that wrapping twice wraps once.
_RECORDING = "__outbox_recorded__"
# Errors of the run itself that escaped the tool running in this task (see _run_errors).
_ESCAPED: contextvars.ContextVar[list[Exception] | None] = contextvars.ContextVar(
    "outbox_openai_escaped", default=None
)


def _ends_the_run(error: Exception | None) -> bool:
    """An error of the run (budget, bad payload, ended run, database), not an outcome for the model.

    A failed or timed-out effect and a signal that did not come are outcomes an
    agent can act on; everything else agent-outbox raises is not the model's to fix.
    """
    return isinstance(error, OutboxError) and not isinstance(error, EffectFailed | WaitTimeout)


def _run_errors(formatter: ToolErrorFormatter | None) -> ToolErrorFormatter:
    """A ``tool_error_formatter`` that takes the run's own errors away from the model.

    The SDK hands a tool's exception to the model as a message ("please try
    again") by default. For an error of the run that would only loop: the
    formatter, called with the exception that escaped the tool, notes it, and
    :func:`record_tool` raises it instead of recording the message. Other
    errors go to ``formatter`` (or the SDK's default).
    """

    def format_error(args: ToolErrorFormatterArgs[Any]) -> str | Awaitable[str | None] | None:
        escaped = _ESCAPED.get()
        if escaped is not None and args.kind == "tool_exception" and _ends_the_run(args.error):
            assert args.error is not None
            escaped.append(args.error)
            return None
        return None if formatter is None else formatter(args)

    return format_error


def record_tool(tool: FunctionTool) -> FunctionTool:
    """A copy of ``tool`` whose calls inside a run are steps, named by the tool call id.

    :func:`run_agent` does this to every function tool of the agents it runs;
    call it yourself only for a tool the runner cannot see. The step records
    what the tool returned, as the SDK hands it to the model (its error
    message too, for a tool the SDK lets fail softly); a replay returns that
    without running the tool. Effects and signal waits inside the tool are
    named after its step. An error of the run escaping the tool is raised
    instead of recorded under :func:`run_agent`'s run config.
    """
    invoke = tool.on_invoke_tool
    if getattr(invoke, _RECORDING, False):
        return tool

    # ``ToolContext`` in the annotation: the SDK then passes the tool call's context (its id).
    async def on_invoke_tool(ctx: ToolContext[Any], arguments: str) -> Any:
        scope = _scope._SCOPE.get()
        if scope is None:
            return await invoke(ctx, arguments)
        step_id = _step_id(scope, f"tool:{tool.name}:{ctx.tool_call_id}")

        async def body() -> Any:
            escaped: list[Exception] = []
            token = _ESCAPED.set(escaped)
            try:
                output = await invoke(ctx, arguments)
            finally:
                _ESCAPED.reset(token)
            if escaped:
                raise escaped[0]  # the SDK made it a message; the run must not go on
            # The SDK turns what is not a structured output into str(): so do we, now,
            # so that the first run and every replay give the model the same value.
            return to_jsonable_python(output, fallback=str, by_alias=True)

        with _scope.in_step(step_id):
            return await scope.run.call(step_id, body)

    setattr(on_invoke_tool, _RECORDING, True)
    return dataclasses.replace(tool, on_invoke_tool=on_invoke_tool)


class _Recorder:
    """Copies of an agent graph (handoffs, cycles included) whose models and tools record."""

    def __init__(self) -> None:
        # Originals and their copies (a copy maps to itself), kept alive for the run.
        self.copies: dict[int, Agent[Any]] = {}

    def agent(self, agent: Agent[Any]) -> Agent[Any]:
        known = self.copies.get(id(agent))
        if known is not None:
            return known
        model = _recorded(agent.model) if isinstance(agent.model, Model) else agent.model
        copy = agent.clone(
            model=model,
            model_settings=agent.model_settings,
            tools=[record_tool(t) if isinstance(t, FunctionTool) else t for t in agent.tools],
            handoffs=[],
        )
        self.copies[id(agent)] = self.copies[id(copy)] = copy
        copy.handoffs = [
            self.agent(h) if isinstance(h, Agent) else self.handoff(h) for h in agent.handoffs
        ]
        return copy

    def handoff(self, handoff: Handoff[Any, Any]) -> Handoff[Any, Any]:
        copy = dataclasses.replace(handoff, on_invoke_handoff=self._invoke(handoff))
        target = handoff._agent_ref() if handoff._agent_ref is not None else None
        if isinstance(target, Agent):
            copy._agent_ref = weakref.ref(self.agent(target))
        return copy

    def _invoke(
        self, handoff: Handoff[Any, Any]
    ) -> Callable[[RunContextWrapper[Any], str], Awaitable[Any]]:
        async def on_invoke_handoff(ctx: RunContextWrapper[Any], arguments: str) -> Any:
            target = await handoff.on_invoke_handoff(ctx, arguments)
            return self.agent(target) if isinstance(target, Agent) else target

        return on_invoke_handoff


async def run_agent(
    run: AsyncRun,
    agent: Agent[Any],
    input: str | list[TResponseInputItem],
    *,
    prefix: str = "agent:",
    price: TokenPrice = tokens,
    run_config: RunConfig | None = None,
    **kwargs: Any,
) -> RunResult:
    """``await Runner.run(agent, input, ...)``, its model requests and tool calls steps of ``run``.

    Returns the SDK's ``RunResult`` (its ``last_agent`` is the recorded copy of
    the agent that answered: compare agents by name). ``run_config`` is used
    with its model provider (default: the SDK's) and model wrapped to record;
    other keywords go to ``Runner.run``. See :func:`in_run` for ``prefix`` and
    ``price``. A ``session`` is refused: it would be written again on every
    replay (pass earlier turns in ``input``; the run's steps are its memory).
    """
    if kwargs.get("session") is not None:
        raise ValidationError(
            "session",
            type(kwargs["session"]).__name__,
            "a session would repeat its items on every replay: pass earlier turns as input",
        )
    config = run_config or RunConfig()
    config = dataclasses.replace(
        config,
        model_provider=RecordedModelProvider(config.model_provider),
        model=_recorded(config.model) if isinstance(config.model, Model) else config.model,
        tool_error_formatter=_run_errors(config.tool_error_formatter),
    )
    async with in_run(run, prefix=prefix, price=price):
        try:
            return await Runner.run(_Recorder().agent(agent), input, run_config=config, **kwargs)
        except AgentsException as error:
            # The SDK wraps an exception out of a tool ("Error running tool ..."): raise
            # the run's own error, which a worker judges (a spent budget is not retried).
            if isinstance(error.__cause__, OutboxError):
                raise error.__cause__ from None
            raise
