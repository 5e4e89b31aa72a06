"""Over budget, a worker stops paying: no model call the budget cannot cover, no step retries.

Real agents on the frameworks' offline models (Pydantic AI's ``FunctionModel``,
LangGraph on langchain-core's fake chat model, the OpenAI Agents SDK on a scripted
``Model``) and plain handlers, run by real
sync and async workers on a real PostgreSQL; the tests count model calls and
handler entries.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from outbox import AsyncRun, Outbox, Run, RunStatus
from tests.integrations.processes import lines
from tests.support import WorkerThread, wait_for

#: One model request's tokens (input + output = 50 budget units by default).
USAGE = {"input_tokens": 40, "output_tokens": 10}
COST = USAGE["input_tokens"] + USAGE["output_tokens"]


def failed(ob: Outbox, run_id: Any) -> Any:
    """The run once it has failed (its recorded error is ``.record.error``)."""
    wait_for(lambda: ob.run(run_id).status == RunStatus.FAILED, timeout=30)
    return ob.run(run_id)


def test_a_spent_budget_refuses_the_next_model_request_and_ends_the_run(ob: Outbox) -> None:
    """An agent that keeps asking gets exactly the two requests its budget pays for."""
    from pydantic_ai import Agent, ModelResponse, ToolCallPart
    from pydantic_ai.models.function import FunctionModel
    from pydantic_ai.usage import RequestUsage

    from outbox.integrations.pydantic_ai import OutboxDurability, run_agent

    model_calls: list[int] = []
    entries: list[str] = []

    def script(messages: list[Any], info: Any) -> ModelResponse:
        model_calls.append(len(messages))
        return ModelResponse(
            parts=[ToolCallPart("lookup_order", {"order_id": f"o-{len(model_calls)}"})],
            usage=RequestUsage(
                input_tokens=USAGE["input_tokens"], output_tokens=USAGE["output_tokens"]
            ),
        )

    agent = Agent(FunctionModel(script), name="spender", capabilities=[OutboxDurability()])

    @agent.tool_plain
    def lookup_order(order_id: str) -> str:
        """Look an order up."""
        return f"{order_id}: open"

    async def handler(run: AsyncRun) -> Any:
        entries.append(str(run.id))
        return (await run_agent(run, agent, "look everything up")).output

    run = ob.start_run("spender", "1", {}, budget=2 * COST)
    with WorkerThread(ob, "spender", "1", handler, retry_base_seconds=0.01, poll_seconds=0.05):
        done = failed(ob, run.id)
    # the third request was refused before the model was called, and not retried
    assert len(model_calls) == 2
    assert len(entries) == 1
    assert done.record.spent == 2 * COST
    assert done.record.error["type"] == "BudgetExceeded"
    assert done.record.error["step"] == "agent:spender__model.request#3"
    assert done.record.error["failures"] == 1
    assert "model request" in done.record.error["message"]
    assert done.record.step_retries == {"agent:spender__model.request#3": 1}


def test_a_model_request_the_budget_cannot_cover_ends_the_run_without_retries(
    ob: Outbox, tmp_path: Path
) -> None:
    """Half a request left: the request is made once, refused at commit, never made again."""
    from langchain_core.messages import AIMessage
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    from outbox.integrations.langgraph import RecordedModel, record_tool_call, run_graph
    from tests.integrations.langgraph_agent import ScriptedChatModel

    def lookup_order(order_id: str) -> str:
        """Look an order up."""
        return f"{order_id}: open"

    asks = [
        AIMessage(
            "",
            tool_calls=[{"name": "lookup_order", "args": {"order_id": f"o-{n}"}, "id": f"c{n}"}],
            usage_metadata={**USAGE, "total_tokens": COST},
        )
        for n in range(5)
    ]
    model_log = tmp_path / "model.log"
    model = RecordedModel(ScriptedChatModel(log=str(model_log), responses=asks))

    async def agent_node(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent_node)
    builder.add_node("tools", ToolNode([lookup_order], awrap_tool_call=record_tool_call))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    graph = builder.compile()
    entries: list[str] = []

    async def handler(run: AsyncRun) -> Any:
        entries.append(str(run.id))
        return await run_graph(run, graph, {"messages": [("user", "look everything up")]})

    run = ob.start_run("graph-spender", "1", {}, budget=1.5 * COST)
    with WorkerThread(ob, "graph-spender", "1", handler, retry_base_seconds=0.01):
        done = failed(ob, run.id)
    assert lines(model_log) == ["request 1", "request 2"]
    assert len(entries) == 1
    assert done.record.spent == COST
    assert done.record.error["type"] == "BudgetExceeded"
    assert done.record.error["step"].startswith("graph:model:")
    assert done.record.error["failures"] == 1


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_worker_fails_an_over_budget_run_without_retrying_its_step(ob: Outbox, kind: str) -> None:
    """Both workers; the async handler's step runs in a task group, which wraps the error."""
    tries: list[str] = []

    def pay(tx: Any) -> None:
        tries.append("pay")
        tx.spend(10, "tokens")

    def sync_handler(run: Run) -> None:
        run.transaction("pay", pay)

    async def async_handler(run: AsyncRun) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(run.transaction("pay", pay))

    handler = sync_handler if kind == "sync" else async_handler
    run = ob.start_run("payer", "1", {}, budget=5)
    with WorkerThread(ob, "payer", "1", handler, retry_base_seconds=0.01, poll_seconds=0.05):
        done = failed(ob, run.id)
    assert tries == ["pay"]
    assert done.record.error["type"] == "BudgetExceeded"
    assert done.record.error["step"] == "pay"
    assert done.record.error["failures"] == 1
    assert done.record.spent == 0


def test_an_openai_agent_over_budget_is_not_retried_even_by_a_retry_everything_policy(
    ob: Outbox, tmp_path: Path
) -> None:
    """Half a request left: the SDK's retry policy says retry, the run's refusal says no."""
    from agents import Agent, ModelSettings, function_tool
    from agents.retry import ModelRetrySettings
    from agents.testing import function_call

    from outbox.integrations.openai_agents import run_agent
    from tests.integrations.openai_agent import ScriptedModel, offline

    @function_tool
    def lookup_order(order_id: str) -> str:
        """Look an order up."""
        return f"{order_id}: open"

    def script(done: list[Any]) -> list[Any]:
        n = len(done) + 1
        return [function_call("lookup_order", {"order_id": f"o-{n}"}, call_id=f"c{n}")]

    model_log = tmp_path / "model.log"
    retry = ModelRetrySettings(max_retries=3, backoff={"initial_delay": 0}, policy=lambda c: True)
    agent = Agent(
        name="oa-spender",
        model="scripted",
        tools=[lookup_order],
        model_settings=ModelSettings(retry=retry),
    )
    entries: list[str] = []

    async def handler(run: AsyncRun) -> Any:
        entries.append(str(run.id))
        model = ScriptedModel(script, str(model_log))
        return (await run_agent(run, agent, "look up", run_config=offline(model))).final_output

    run = ob.start_run("oa-spender", "1", {}, budget=1.5 * COST)
    with WorkerThread(ob, "oa-spender", "1", handler, retry_base_seconds=0.01, poll_seconds=0.05):
        done = failed(ob, run.id)
    # the second request was made once and refused at commit; neither the SDK nor the worker
    # paid for it again
    assert lines(model_log) == ["request 1", "request 2"]
    assert len(entries) == 1
    assert done.record.spent == COST
    assert done.record.error["type"] == "BudgetExceeded"
    assert done.record.error["step"] == "agent:model#2"
    assert done.record.error["failures"] == 1
