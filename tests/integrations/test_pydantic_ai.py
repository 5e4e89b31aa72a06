"""Pydantic AI on agent-outbox: a real agent, a real worker killed with SIGKILL, a real sink.

The agent (``pydantic_agent.py``) runs on Pydantic AI's offline ``FunctionModel``
inside ``outbox worker`` processes; its refund tool is an effect delivered by
an ``outbox deliver`` process to an HTTP sink that honours ``Idempotency-Key``.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import pytest

from deliverers.testing import IdempotentHttpSink
from outbox import AsyncOutbox, Outbox, RunStatus, SignalTimeout
from outbox.check.processes import start_deliverer
from outbox.check.workload import write_config
from tests.integrations.processes import lines, start_worker, stop
from tests.support import wait_for

pytestmark = pytest.mark.slow

MODEL_STEP = "agent:refunds__model.request"
TOOL_STEP = "agent:refunds__function_toolset__<agent>.call_tool"
#: The steps the agent records, in order, up to the refund's intent.
STEPS = [
    f"{MODEL_STEP}#1",
    f"{TOOL_STEP}:lookup_order#1",
    f"{MODEL_STEP}#2",
    f"{TOOL_STEP}:refund#1:effect#1:intend",
]


def model_steps(ob: Outbox, run_id: Any) -> list[str]:
    return [s for s in ob.run(run_id).completed_steps if s.startswith(MODEL_STEP)]


@pytest.mark.parametrize(
    ("crash_at", "recorded_at_kill"),
    [
        # killed right after the first model response was recorded
        ("after_step:1", STEPS[:1]),
        # killed right after the refund's intent was committed, before the run parked
        ("after_step:4", STEPS),
    ],
)
def test_a_killed_worker_resumes_without_calling_the_model_again_or_refunding_twice(
    ob: Outbox,
    sub_env: dict[str, str],
    tmp_path: Path,
    crash_at: str,
    recorded_at_kill: list[str],
) -> None:
    model_log = tmp_path / "model.log"
    handler = "tests.integrations.pydantic_agent:refunds"
    with IdempotentHttpSink() as sink:
        run = ob.start_run(
            "refunds",
            "1",
            {"model_log": str(model_log), "sink": sink.url, "customer": "ACME"},
            budget=100_000,
        )
        deliverer = start_deliverer(sub_env, write_config(tmp_path), tmp_path / "d.log")
        doomed = start_worker(sub_env, handler, "refunds", tmp_path / "w1.log", crash_at)
        try:
            assert doomed.wait(timeout=60) == -signal.SIGKILL
            # the worker died where the test means: these steps, and no later one, committed
            assert ob.run(run.id).completed_steps == recorded_at_kill
            survivor = start_worker(sub_env, handler, "refunds", tmp_path / "w2.log")
            try:
                wait_for(lambda: ob.run(run.id).status == RunStatus.COMPLETED, timeout=60)
            finally:
                stop(survivor)
        finally:
            stop(deliverer)
        stats = sink.stats()
    done = ob.run(run.id)
    assert done.record.result == "refunded: {'status': 200}"
    # one model call per recorded request, none repeated by the resumed worker
    assert lines(model_log) == ["request 1", "request 2", "request 3"]
    assert model_steps(ob, run.id) == [f"{MODEL_STEP}#{n}" for n in (1, 2, 3)]
    # the refund was intended once and applied once, with its key
    (refund,) = done.effects()
    assert refund.status.value == "succeeded"
    assert stats["keys_applied"] == 1 and stats["duplicate_keys_applied"] == []
    assert stats["operations_applied"] == 1 and stats["duplicate_operations"] == []
    # token usage was debited from the budget once per request
    usage = sum(
        s.result["usage"]["input_tokens"] + s.result["usage"]["output_tokens"]
        for s in (done.step(n) for n in model_steps(ob, run.id))
        if s is not None
    )
    assert done.record.spent == usage > 0


def test_an_approval_tool_waits_for_a_signal_with_a_deadline(dsn: str, tmp_path: Path) -> None:
    from pydantic_ai import Agent, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
    from pydantic_ai.models.function import FunctionModel

    from outbox.integrations.pydantic_ai import OutboxDurability, run_agent, wait_for_signal

    def script(messages: list[Any], info: Any) -> ModelResponse:
        returns = [p for m in messages for p in m.parts if isinstance(p, ToolReturnPart)]
        if not returns:
            return ModelResponse(parts=[ToolCallPart("ask_approval", {"amount": 900})])
        return ModelResponse(parts=[TextPart(f"approved by {returns[0].content}")])

    agent = Agent(FunctionModel(script), name="approvals", capabilities=[OutboxDurability()])

    @agent.tool_plain
    async def ask_approval(amount: int) -> str:
        """A person approves large refunds."""
        reply = await wait_for_signal("approval", timeout=2)
        return str(reply["by"])

    async def main() -> tuple[str, Any]:
        async with await AsyncOutbox.connect(dsn) as ob:
            run = await ob.start_run("approvals", "1", {})
            waiting = asyncio.create_task(run_agent(run, agent, "refund 900"))
            await asyncio.sleep(0.3)
            await ob.signal(run.id, "approval", {"by": "ops"})
            approved = (await waiting).output
            late = await ob.start_run("approvals", "1", {})
            with pytest.raises(SignalTimeout):
                await run_agent(late, agent, "refund 900")
            return approved, (await ob.run(late.id)).completed_steps

    approved, late_steps = asyncio.run(main())
    assert approved == "approved by ops"
    assert "agent:approvals__model.request#1" in late_steps


def test_a_replayed_agent_run_with_test_model_calls_neither_model_nor_tools(dsn: str) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.test import TestModel

    from outbox.integrations.pydantic_ai import OutboxDurability, run_agent

    class CountingTestModel(TestModel):
        requests = 0

        async def request(self, *args: Any, **kwargs: Any) -> Any:
            CountingTestModel.requests += 1
            return await super().request(*args, **kwargs)

    agent = Agent(CountingTestModel(), name="lookup", capabilities=[OutboxDurability()])
    lookups: list[str] = []

    @agent.tool_plain
    def lookup_order(order_id: str) -> str:
        """Look an order up."""
        lookups.append(order_id)
        return f"order {order_id}: 12.50"

    async def main() -> tuple[Any, Any, list[str], Any]:
        async with await AsyncOutbox.connect(dsn) as ob:
            run = await ob.start_run("lookup", "1", {}, budget=100_000)
            first = await run_agent(run, agent, "look up o-17")
            calls = (CountingTestModel.requests, list(lookups))
            replayed = await run_agent(await ob.run(run.id), agent, "look up o-17")
            assert (CountingTestModel.requests, lookups) == calls
            done = await ob.run(run.id)
            return first.output, replayed.output, done.completed_steps, done.record.spent

    first, replayed, steps, spent = asyncio.run(main())
    assert first == replayed and lookups == ["a"]
    assert CountingTestModel.requests == 2 == len([s for s in steps if "model.request" in s])
    assert spent > 0
