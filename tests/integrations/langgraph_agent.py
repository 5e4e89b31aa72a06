"""A LangGraph refund graph run by real ``outbox worker`` processes in the integration tests.

The model is langchain-core's ``FakeMessagesListChatModel`` (offline), told to
answer by the conversation's position rather than by its own counter (a
counter would restart in the resumed process) and to append one line per
call to ``run.inputs["model_log"]``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import tool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode

from outbox import AsyncRun
from outbox.integrations.langgraph import RecordedModel, effect, record_tool_call, run_graph

USAGE = {"input_tokens": 40, "output_tokens": 10, "total_tokens": 50}


class ScriptedChatModel(FakeMessagesListChatModel):
    """``responses[n]`` after ``n`` tool results; each call is logged to ``log``."""

    log: str

    def _generate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> ChatResult:
        done = sum(isinstance(m, ToolMessage) for m in messages)
        with Path(self.log).open("a") as handle:
            handle.write(f"request {done + 1}\n")
        return ChatResult(generations=[ChatGeneration(message=self.responses[done])])

    def bind_tools(self, tools: Any, **kwargs: Any) -> ScriptedChatModel:
        return self


def build_graph(model_log: str, sink_url: str) -> Any:
    """agent -> tools -> agent -> ... -> receipt: a tool effect and a node effect."""

    @tool
    def lookup_order(order_id: str) -> dict[str, Any]:
        """Look an order up."""
        return {"id": order_id, "cents": 1250}

    @tool
    async def refund(order_id: str, cents: int) -> dict[str, Any]:
        """Refund an order (an effect, delivered with its idempotency key)."""
        reply = await effect(
            "http.request",
            {
                "url": f"{sink_url}/refunds",
                "json": {"operation": f"refund:{order_id}", "cents": cents},
            },
        )
        return {"status": reply["status"]}

    chat = ScriptedChatModel(
        log=model_log,
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
            AIMessage("refunded o-17", usage_metadata=USAGE),
        ],
    )
    tools = [lookup_order, refund]
    model = RecordedModel(chat.bind_tools(tools))

    async def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    async def receipt(state: MessagesState) -> dict[str, Any]:
        # A node's own side effect goes through an intent too.
        await effect(
            "http.request",
            {"url": f"{sink_url}/receipts", "json": {"operation": "receipt:o-17"}},
        )
        return {}

    def route(state: MessagesState) -> str:
        last = state["messages"][-1]
        return "tools" if isinstance(last, AIMessage) and last.tool_calls else "receipt"

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(tools, awrap_tool_call=record_tool_call))
    graph.add_node("receipt", receipt)
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", route, ["tools", "receipt"])
    graph.add_edge("tools", "agent")
    graph.add_edge("receipt", END)
    return graph.compile()


async def refunds(run: AsyncRun) -> Any:
    """``outbox worker tests.integrations.langgraph_agent:refunds``."""
    graph = build_graph(run.inputs["model_log"], run.inputs["sink"])
    state = await run_graph(run, graph, {"messages": [("user", "Refund order o-17")]})
    return state["messages"][-1].content
