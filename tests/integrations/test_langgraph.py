"""LangGraph on agent-outbox: a real compiled graph, a worker killed with SIGKILL, a real sink.

The graph (``langgraph_agent.py``) runs on langchain-core's fake chat model
inside ``outbox worker`` processes; its refund tool and its receipt node are
effects delivered by an ``outbox deliver`` process to an HTTP sink that honours
``Idempotency-Key``.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from deliverers.testing import IdempotentHttpSink
from outbox import Outbox, RunStatus
from outbox.check.processes import start_deliverer
from outbox.check.workload import write_config
from tests.integrations.langgraph_agent import USAGE
from tests.integrations.processes import lines, start_worker, stop
from tests.support import wait_for

pytestmark = pytest.mark.slow


def model_steps(ob: Outbox, run_id: Any) -> list[str]:
    return [s for s in ob.run(run_id).completed_steps if s.startswith("graph:model:")]


@pytest.mark.parametrize(
    "crash_at",
    [
        # killed right after the first model message was recorded
        "after_step:1",
        # killed right after the refund's intent was committed, before the run parked
        "after_step:4",
    ],
)
def test_a_killed_worker_resumes_the_graph_without_calling_the_model_again_or_refunding_twice(
    ob: Outbox, sub_env: dict[str, str], tmp_path: Path, crash_at: str
) -> None:
    model_log = tmp_path / "model.log"
    handler = "tests.integrations.langgraph_agent:refunds"
    with IdempotentHttpSink() as sink:
        run = ob.start_run(
            "graph-refunds", "1", {"model_log": str(model_log), "sink": sink.url}, budget=1000
        )
        deliverer = start_deliverer(sub_env, write_config(tmp_path), tmp_path / "d.log")
        doomed = start_worker(sub_env, handler, "graph-refunds", tmp_path / "w1.log", crash_at)
        try:
            assert doomed.wait(timeout=60) == -signal.SIGKILL
            survivor = start_worker(sub_env, handler, "graph-refunds", tmp_path / "w2.log")
            try:
                wait_for(lambda: ob.run(run.id).status == RunStatus.COMPLETED, timeout=60)
            finally:
                stop(survivor)
        finally:
            stop(deliverer)
        stats = sink.stats()
    done = ob.run(run.id)
    assert done.record.result == "refunded o-17"
    # one model call per recorded request, none repeated by the resumed worker
    assert lines(model_log) == ["request 1", "request 2", "request 3"]
    assert len(model_steps(ob, run.id)) == 3
    # the refund (a tool) and the receipt (a node) were each intended and applied once
    effects = done.effects()
    assert [e.payload["json"]["operation"] for e in effects] == ["refund:o-17", "receipt:o-17"]
    assert {e.status.value for e in effects} == {"succeeded"}
    assert stats["keys_applied"] == 2 and stats["duplicate_keys_applied"] == []
    assert stats["operations_applied"] == 2 and stats["duplicate_operations"] == []
    assert done.record.spent == 3 * (USAGE["input_tokens"] + USAGE["output_tokens"])


def test_run_graph_resumes_a_checkpointed_thread_instead_of_restarting_it(
    dsn: str, tmp_path: Path
) -> None:
    """With LangGraph's checkpointer beside it: the thread continues, its input is not re-added."""
    import asyncio

    from langchain_core.messages import AIMessage
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import END, START, MessagesState, StateGraph

    from outbox import AsyncOutbox
    from outbox.integrations.langgraph import RecordedModel, run_graph
    from tests.integrations.langgraph_agent import ScriptedChatModel

    model_log = tmp_path / "model.log"
    chat = ScriptedChatModel(
        log=str(model_log), responses=[AIMessage("drafted", usage_metadata=USAGE)]
    )
    model = RecordedModel(chat)
    failures = ["the mail server is down"]

    async def draft(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    async def send(state: MessagesState) -> dict[str, Any]:
        if failures:
            raise RuntimeError(failures.pop())
        return {"messages": [AIMessage("sent")]}

    builder = StateGraph(MessagesState)
    builder.add_node("draft", draft)
    builder.add_node("send", send)
    builder.add_edge(START, "draft")
    builder.add_edge("draft", "send")
    builder.add_edge("send", END)
    graph = builder.compile(checkpointer=InMemorySaver())

    async def main() -> tuple[list[str], list[str]]:
        async with await AsyncOutbox.connect(dsn) as ob:
            run = await ob.start_run("drafts", "1", {})
            ask = {"messages": [("user", "write to ACME")]}
            with pytest.raises(RuntimeError, match="mail server"):
                await run_graph(run, graph, ask)
            state = await run_graph(await ob.run(run.id), graph, ask)
            again = await run_graph(await ob.run(run.id), graph, ask)  # finished: its state
            assert again["messages"] == state["messages"]
            return [m.content for m in state["messages"]], (await ob.run(run.id)).completed_steps

    contents, steps = asyncio.run(main())
    assert contents == ["write to ACME", "drafted", "sent"]
    assert lines(model_log) == ["request 1"]
    assert len([s for s in steps if s.startswith("graph:model:")]) == 1
