"""A LangGraph refund graph on agent-outbox: recorded model and tool calls, effects, resume.

Run it from a clone (PostgreSQL is the embedded default in ./.outbox):

    pip install -e '.[langgraph]'
    python examples/langgraph_refunds.py

A compiled graph (agent -> tools -> agent -> receipt) runs as an agent-outbox
run in an async worker. `RecordedModel` makes each model call a recorded step
(token usage debited from the run's budget), `record_tool_call` each tool
call; the refund tool and the receipt node change the outside world through
`effect()`, delivered by an `outbox deliver` process to a local HTTP sink with
their idempotency keys. The finished run is then replayed: the graph ends in
the same state and the model is not called again.

The chat model is langchain-core's offline fake; use any chat model
(`ChatOpenAI(...)`, `init_chat_model(...)`) in its place.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import tool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode

from deliverers.testing import IdempotentHttpSink
from outbox import AsyncOutbox, AsyncRun, RunStatus
from outbox.integrations.langgraph import RecordedModel, effect, record_tool_call, run_graph

SINK = IdempotentHttpSink().start()
USAGE = {"input_tokens": 120, "output_tokens": 30, "total_tokens": 150}
model_calls = 0


class StandInModel(FakeMessagesListChatModel):
    """Stands in for an LLM: answers by how far the conversation has got."""

    def _generate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> ChatResult:
        global model_calls
        model_calls += 1
        done = sum(isinstance(m, ToolMessage) for m in messages)
        return ChatResult(generations=[ChatGeneration(message=self.responses[done])])

    def bind_tools(self, tools: Any, **kwargs: Any) -> StandInModel:
        return self


@tool
def lookup_order(order_id: str) -> dict[str, Any]:
    """Look an order up (a recorded step: replayed, never repeated)."""
    return {"id": order_id, "cents": 1250}


@tool
async def refund(order_id: str, cents: int) -> str:
    """Refund an order: an effect delivered once, with its idempotency key."""
    reply = await effect(
        "http.request",
        {"url": f"{SINK.url}/refunds", "json": {"operation": f"refund:{order_id}", "cents": cents}},
    )
    return f"sink answered HTTP {reply['status']}"


chat = StandInModel(
    responses=[
        AIMessage(
            "",
            tool_calls=[{"name": "lookup_order", "args": {"order_id": "o-17"}, "id": "c1"}],
            usage_metadata=USAGE,
        ),
        AIMessage(
            "",
            tool_calls=[
                {"name": "refund", "args": {"order_id": "o-17", "cents": 1250}, "id": "c2"}
            ],
            usage_metadata=USAGE,
        ),
        AIMessage("Refunded o-17 in full.", usage_metadata=USAGE),
    ]
)
TOOLS = [lookup_order, refund]
model = RecordedModel(chat.bind_tools(TOOLS))


async def agent_node(state: MessagesState) -> dict[str, Any]:
    return {"messages": [await model.ainvoke(state["messages"])]}


async def receipt_node(state: MessagesState) -> dict[str, Any]:
    """A node's own side effect goes through an intent as well."""
    await effect(
        "http.request", {"url": f"{SINK.url}/receipts", "json": {"operation": "receipt:o-17"}}
    )
    return {}


def route(state: MessagesState) -> str:
    last = state["messages"][-1]
    return "tools" if isinstance(last, AIMessage) and last.tool_calls else "receipt"


builder = StateGraph(MessagesState)
builder.add_node("agent", agent_node)
builder.add_node("tools", ToolNode(TOOLS, awrap_tool_call=record_tool_call))
builder.add_node("receipt", receipt_node)
builder.add_edge(START, "agent")
builder.add_conditional_edges("agent", route, ["tools", "receipt"])
builder.add_edge("tools", "agent")
builder.add_edge("receipt", END)
graph = builder.compile()


async def handler(run: AsyncRun) -> str:
    """What `outbox worker examples_module:handler` would run for each run."""
    state = await run_graph(run, graph, {"messages": [("user", run.inputs["ask"])]})
    return str(state["messages"][-1].content)


async def main() -> None:
    config = Path(tempfile.mkdtemp()) / "deliverers.toml"
    config.write_text('[kinds."http.request"]\nallow_private = ["127.0.0.1"]\n')
    async with await AsyncOutbox.connect() as ob:  # OUTBOX_DSN, else the embedded PostgreSQL
        deliverer = subprocess.Popen(
            [sys.executable, "-m", "outbox", "deliver", "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        worker = ob.worker("graph-refunds", "1", handler, concurrency=10)
        working = asyncio.create_task(worker.run())
        try:
            run = await ob.start_run(
                "graph-refunds", "1", {"ask": "Refund order o-17"}, budget=10_000
            )
            print(f"run {run.id} started")
            while (run := await ob.run(run.id)).status not in (
                RunStatus.COMPLETED,
                RunStatus.FAILED,
            ):
                await asyncio.sleep(0.1)
        finally:
            worker.stop()
            await working
            deliverer.terminate()
            deliverer.wait()
        print(f"\nresult: {run.record.result!r}  (status {run.status.value})")
        print(f"budget spent (tokens): {run.record.spent}")
        print("recorded steps:")
        for step_id in run.completed_steps:
            print(f"  {step_id}")
        for e in await run.effects():
            print(f"effect {e.payload['json']['operation']} {e.status.value}")
        print(f"sink: {SINK.stats()['operations_applied']} effects applied")

        before = model_calls
        state = await run_graph(
            await ob.run(run.id), graph, {"messages": [("user", run.inputs["ask"])]}
        )
        print(f"\nreplay: {state['messages'][-1].content!r}; model calls: {model_calls - before}")
    SINK.stop()


if __name__ == "__main__":
    asyncio.run(main())
