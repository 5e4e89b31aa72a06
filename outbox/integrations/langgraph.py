"""LangGraph on agent-outbox: a compiled graph's model calls and tool calls as recorded steps.

A graph run becomes part of an agent-outbox run with :func:`run_graph`; two
wrappers make its outside calls steps of that run::

    model = RecordedModel(chat_model.bind_tools(tools))          # model calls recorded
    tool_node = ToolNode(tools, awrap_tool_call=record_tool_call) # tool calls recorded

    async def handler(run: AsyncRun) -> Any:                    # outbox worker app:handler
        state = await run_graph(run, graph, {"messages": [("user", run.inputs["ask"])]})
        return state["messages"][-1].content

Inside a run:

- a model call is a step named by a digest of its input messages: replaying
  returns the recorded ``AIMessage`` without calling the model; its token
  usage (``usage_metadata``) is debited from the run's budget;
- a tool call is a step named by its tool-call id (which comes from a recorded
  model response, so it is the same on every replay);
- a tool or a node that changes the outside world calls :func:`effect`: an
  intent delivered by a deliverer with its idempotency key, the run parked
  until the result is known. :func:`wait_for_signal` waits for a person.

After ``kill -9`` an agent-outbox worker re-invokes the graph from its input;
recorded calls replay in microseconds and the graph continues where it
stopped. LangGraph's own checkpointer (``langgraph-checkpoint-postgres``) can
stay: it records graph state per super-step, not whether an effect happened,
so it does not make tools or nodes safe to repeat; see docs/howto/async-and-frameworks.md.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from outbox.errors import MissingExtra, ValidationError

try:
    from langchain_core.messages import (
        AIMessage,
        BaseMessage,
        ToolMessage,
        convert_to_messages,
        message_to_dict,
        messages_from_dict,
    )
    from langchain_core.prompt_values import PromptValue
    from langchain_core.runnables import Runnable, RunnableConfig
    from langgraph.prebuilt.tool_node import ToolCallRequest
    from langgraph.types import Command
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

__all__ = [
    "RecordedModel",
    "TokenPrice",
    "current_run",
    "effect",
    "in_run",
    "record_tool_call",
    "run_graph",
    "wait_for_signal",
]


async def run_graph(
    run: AsyncRun,
    graph: Any,
    graph_input: Any,
    config: RunnableConfig | None = None,
    *,
    prefix: str = "graph:",
    price: TokenPrice = tokens,
    **kwargs: Any,
) -> Any:
    """``await graph.ainvoke(graph_input, config)``, its model and tool calls steps of ``run``.

    Returns what ``ainvoke`` returns. A graph compiled with a checkpointer
    (LangGraph's Postgres saver, say) gets ``thread_id`` = the run's id unless
    ``config`` names one, and a thread that already has a checkpoint is
    resumed from it (``ainvoke(None, ...)``) instead of being given its input
    again; a finished thread returns its final state.
    """
    merged = RunnableConfig(**(config or {}))
    async with in_run(run, prefix=prefix, price=price):
        if getattr(graph, "checkpointer", None):
            configurable = dict(merged.get("configurable") or {})
            configurable.setdefault("thread_id", str(run.id))
            merged["configurable"] = configurable
            snapshot = await graph.aget_state(merged)
            if snapshot.values and not snapshot.next:
                return snapshot.values  # the graph finished before the interruption
            if snapshot.next:
                graph_input = None  # continue from the last checkpoint
        return await graph.ainvoke(graph_input, merged, **kwargs)


def _messages(model_input: Any) -> list[BaseMessage]:
    if isinstance(model_input, PromptValue):
        return model_input.to_messages()
    if isinstance(model_input, str):
        return convert_to_messages([("user", model_input)])
    return convert_to_messages(model_input)


def _digest(messages: Sequence[BaseMessage], kwargs: Mapping[str, Any]) -> str:
    """A name for a model call that a replay reproduces: its messages without their random ids."""
    dumped = []
    for message in messages:
        data = message_to_dict(message)
        data["data"] = {k: v for k, v in data["data"].items() if k != "id"}
        dumped.append(data)
    text = json.dumps([dumped, kwargs], sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _usage(recorded: Any) -> Mapping[str, Any]:
    data = recorded.get("data", {}) if isinstance(recorded, dict) else {}
    return data.get("usage_metadata") or {}


class RecordedModel(Runnable[Any, BaseMessage]):
    """A chat model (or ``model.bind_tools(...)``) whose calls inside a run are recorded steps.

    Outside :func:`run_graph` it simply calls the model. Inside, ``ainvoke``
    records the model's message once per distinct input (by digest and
    occurrence) and replays it; call it from ``async`` nodes (``invoke``
    cannot wait for the database there and refuses).
    """

    def __init__(self, model: Runnable[Any, Any]) -> None:
        self.model = model

    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        """Call the model; inside a run use ``await ainvoke`` (refused here)."""
        if _scope._SCOPE.get() is not None:
            raise ValidationError(
                "invoke", type(self.model).__name__, "inside a run, call `await model.ainvoke`"
            )
        return self.model.invoke(input, config, **kwargs)

    async def ainvoke(
        self, input: Any, config: RunnableConfig | None = None, **kwargs: Any
    ) -> BaseMessage:
        """Call the model once per run and input; replay the recorded message after that."""
        scope = _scope._SCOPE.get()
        if scope is None:
            message: BaseMessage = await self.model.ainvoke(input, config, **kwargs)
            return message
        messages = _messages(input)
        step_id = scope.next_step_id(f"model:{_digest(messages, kwargs)}")

        async def call() -> Any:
            reply = await self.model.ainvoke(messages, config, **kwargs)
            if not isinstance(reply, BaseMessage):
                reply = AIMessage(content=str(reply))
            return message_to_dict(reply)

        recorded = await _scope.model_step(scope, step_id, call, _usage)
        return messages_from_dict([recorded])[0]


def _dump_tool_output(output: Any) -> Any:
    if isinstance(output, ToolMessage):
        return message_to_dict(output)
    if isinstance(output, Command):
        raise ValidationError(
            "tool output", "Command", "a recorded tool call must return a ToolMessage"
        )
    raise ValidationError("tool output", type(output).__name__, "expected a ToolMessage")


async def record_tool_call(
    request: ToolCallRequest,
    execute: Callable[[ToolCallRequest], Awaitable[ToolMessage | Command[Any]]],
) -> ToolMessage | Command[Any]:
    """``ToolNode(tools, awrap_tool_call=record_tool_call)``: each tool call once per run.

    The step is named by the tool call's id (from a recorded model message),
    so a replay returns the recorded ``ToolMessage`` without running the tool.
    Effects and signal waits inside the tool are named after this step.
    """
    scope = _scope._SCOPE.get()
    if scope is None:
        return await execute(request)
    call = request.tool_call
    step_id = scope.next_step_id(f"tool:{call['name']}:{call.get('id') or _digest([], call)}")

    async def body() -> Any:
        return _dump_tool_output(await execute(request))

    with _scope.in_step(step_id):
        recorded = await scope.run.call(step_id, body)
    message = messages_from_dict([recorded])[0]
    assert isinstance(message, ToolMessage)
    return message
