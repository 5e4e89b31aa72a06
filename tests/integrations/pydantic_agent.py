"""A Pydantic AI refund agent run by real ``outbox worker`` processes in the integration tests.

The model is Pydantic AI's ``FunctionModel`` (offline): it plays a fixed
script (look the order up, refund it, answer) and appends one line per call
to ``run.inputs["model_log"]``, so a test counts model calls across processes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic_ai import Agent, ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from outbox import AsyncRun
from outbox.integrations.pydantic_ai import OutboxDurability, effect, run_agent


def _returns(messages: list[ModelMessage]) -> list[ToolReturnPart]:
    return [
        part for message in messages for part in message.parts if isinstance(part, ToolReturnPart)
    ]


def build_agent(model_log: str, sink_url: str) -> Agent[None, str]:
    """The agent: a scripted model, a lookup tool, and a refund tool that is an effect."""

    def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        done = _returns(messages)
        with Path(model_log).open("a") as log:
            log.write(f"request {len(done) + 1}\n")
        if len(done) == 0:
            return ModelResponse(parts=[ToolCallPart("lookup_order", {"order_id": "o-17"})])
        if len(done) == 1:
            order = done[0].content
            assert isinstance(order, dict), order
            return ModelResponse(
                parts=[ToolCallPart("refund", {"order_id": order["id"], "cents": order["cents"]})]
            )
        return ModelResponse(parts=[TextPart(f"refunded: {done[1].content}")])

    agent: Agent[None, str] = Agent(
        FunctionModel(script), name="refunds", capabilities=[OutboxDurability()]
    )

    @agent.tool_plain
    def lookup_order(order_id: str) -> dict[str, Any]:
        """Look an order up."""
        return {"id": order_id, "cents": 1250}

    @agent.tool_plain
    async def refund(order_id: str, cents: int) -> Any:
        """Refund an order: an effect delivered with its idempotency key."""
        reply = await effect(
            "http.request",
            {
                "url": f"{sink_url}/refunds",
                "json": {"operation": f"refund:{order_id}", "cents": cents},
            },
        )
        return {"status": reply["status"]}

    return agent


async def refunds(run: AsyncRun) -> Any:
    """``outbox worker tests.integrations.pydantic_agent:refunds``."""
    agent = build_agent(run.inputs["model_log"], run.inputs["sink"])
    result = await run_agent(run, agent, f"Refund order o-17 for {run.inputs['customer']}")
    return result.output
