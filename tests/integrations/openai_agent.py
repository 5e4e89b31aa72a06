"""An OpenAI Agents SDK refund agent run by real ``outbox worker`` processes in the tests.

The model is :class:`ScriptedModel`, an offline ``Model`` behind a
``ModelProvider`` (as a real model name is looked up): it answers by the
conversation's position (how many tool results its input holds) rather than by
a counter of its own, which would restart in a resumed process, and appends
one line per call to a log file, so a test counts model calls across processes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

from agents import Agent, Model, ModelProvider, ModelResponse, RunConfig, Usage, function_tool
from agents.testing import assistant_message, function_call

from outbox import AsyncRun
from outbox.integrations.openai_agents import effect, run_agent

#: One model request's tokens (input + output = 50 budget units by default).
USAGE = {"input_tokens": 40, "output_tokens": 10}
COST = USAGE["input_tokens"] + USAGE["output_tokens"]

#: ``script(tool_results)`` -> the model's output items for that turn.
Script = Callable[[list[Any]], Sequence[Any]]


def tool_results(items: str | list[Any]) -> list[Any]:
    """The tool outputs in a model request's input, oldest first."""
    if isinstance(items, str):
        return []
    return [i.get("output") for i in items if i.get("type") == "function_call_output"]


class ScriptedModel(Model):
    """Plays ``script`` offline, one logged line per request, each costing :data:`USAGE`."""

    def __init__(self, script: Script, log: str | None = None) -> None:
        self.script = script
        self.log = log

    async def get_response(
        self, system_instructions: Any, input: Any, *args: Any, **kwargs: Any
    ) -> ModelResponse:
        done = tool_results(input)
        if self.log is not None:
            with Path(self.log).open("a") as handle:
                handle.write(f"request {len(done) + 1}\n")
        return ModelResponse(
            output=list(self.script(done)),
            usage=Usage(
                requests=1,
                input_tokens=USAGE["input_tokens"],
                output_tokens=USAGE["output_tokens"],
                total_tokens=COST,
            ),
            response_id=None,
        )

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise NotImplementedError("the scripted model does not stream")


class ScriptedProvider(ModelProvider):
    """Resolves every model name to one :class:`ScriptedModel`."""

    def __init__(self, model: ScriptedModel) -> None:
        self.model = model

    def get_model(self, model_name: str | None) -> Model:
        return self.model


def refund_script(done: list[Any]) -> Sequence[Any]:
    """Look the order up, refund it, answer."""
    if len(done) == 0:
        return [function_call("lookup_order", {"order_id": "o-17"}, call_id="call-1")]
    if len(done) == 1:
        return [function_call("refund", {"order_id": "o-17", "cents": 1250}, call_id="call-2")]
    return [assistant_message(f"refunded: {done[1]}")]


def build_agent(sink_url: str) -> Agent[Any]:
    """The agent: a lookup tool (run inline, recorded) and a refund tool (an effect)."""

    @function_tool
    def lookup_order(order_id: str) -> dict[str, Any]:
        """Look an order up."""
        return {"id": order_id, "cents": 1250}

    @function_tool
    async def refund(order_id: str, cents: int) -> str:
        """Refund an order: an effect delivered with its idempotency key."""
        reply = await effect(
            "http.request",
            {
                "url": f"{sink_url}/refunds",
                "json": {"operation": f"refund:{order_id}", "cents": cents},
            },
        )
        return f"HTTP {reply['status']}"

    # A model *name*, resolved by the run config's provider as a real one would be.
    return Agent(name="refunds", model="scripted", tools=[lookup_order, refund])


def offline(model: ScriptedModel) -> RunConfig:
    """A run config on the scripted model, with the SDK's trace export off (no network)."""
    return RunConfig(model_provider=ScriptedProvider(model), tracing_disabled=True)


async def refunds(run: AsyncRun) -> Any:
    """``outbox worker tests.integrations.openai_agent:refunds``."""
    agent = build_agent(run.inputs["sink"])
    model = ScriptedModel(refund_script, run.inputs["model_log"])
    result = await run_agent(run, agent, "Refund order o-17", run_config=offline(model))
    return result.final_output
