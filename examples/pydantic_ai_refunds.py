"""A Pydantic AI refund agent on agent-outbox: recorded model calls, an effect, an approval.

Run it from a clone (PostgreSQL is the embedded default in ./.outbox):

    pip install -e '.[pydantic-ai]'
    python examples/pydantic_ai_refunds.py

What happens: an async worker runs the agent as an agent-outbox run. Every
model request and tool call is a recorded step (the model's token usage is
debited from the run's budget). The refund is an *effect*: intended in a step,
delivered by an `outbox deliver` process to a local HTTP sink with its
idempotency key, and the tool returns once it is known; the run is parked at
zero compute meanwhile, and again while it waits for a person's approval.
Finally the finished run is replayed: the agent gets the same answer and the
model is not called again.

The model here is Pydantic AI's offline FunctionModel, so the example needs no
API key; put `Agent("openai:gpt-4o", ...)` (or any model) in its place.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pydantic_ai import Agent, ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from deliverers.testing import IdempotentHttpSink
from outbox import AsyncOutbox, AsyncRun, RunStatus
from outbox.integrations.pydantic_ai import OutboxDurability, effect, run_agent, wait_for_signal

SINK = IdempotentHttpSink().start()
model_calls = 0


def scripted_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Stands in for an LLM: look the order up, ask for approval, refund, answer."""
    global model_calls
    model_calls += 1
    done = [p for m in messages for p in m.parts if isinstance(p, ToolReturnPart)]
    if len(done) == 0:
        return ModelResponse(parts=[ToolCallPart("lookup_order", {"order_id": "o-17"})])
    if len(done) == 1:
        return ModelResponse(parts=[ToolCallPart("ask_approval", {"cents": 125_000})])
    if len(done) == 2:
        return ModelResponse(parts=[ToolCallPart("refund", {"order_id": "o-17", "cents": 125_000})])
    return ModelResponse(parts=[TextPart(f"Refunded o-17: {done[-1].content}")])


agent = Agent(FunctionModel(scripted_model), name="refunds", capabilities=[OutboxDurability()])


@agent.tool_plain
def lookup_order(order_id: str) -> dict[str, Any]:
    """Look an order up (a recorded step: replayed, never repeated)."""
    return {"id": order_id, "cents": 125_000, "customer": "ACME"}


@agent.tool_plain
async def ask_approval(cents: int) -> str:
    """Refunds over 1000 need a person: wait for the `approval` signal, at most an hour."""
    reply = await wait_for_signal("approval", timeout=3600)
    return f"approved by {reply['by']}"


@agent.tool_plain
async def refund(order_id: str, cents: int) -> str:
    """Refund an order: an effect delivered once, with its idempotency key."""
    reply = await effect(
        "http.request",
        {"url": f"{SINK.url}/refunds", "json": {"operation": f"refund:{order_id}", "cents": cents}},
    )
    return f"sink answered HTTP {reply['status']}"


async def handler(run: AsyncRun) -> str:
    """What `outbox worker examples_module:handler` would run for each run."""
    result = await run_agent(run, agent, run.inputs["ask"])
    return str(result.output)


async def main() -> None:
    config = Path(tempfile.mkdtemp()) / "deliverers.toml"
    config.write_text('[kinds."http.request"]\nallow_private = ["127.0.0.1"]\n')
    async with await AsyncOutbox.connect() as ob:  # OUTBOX_DSN, else the embedded PostgreSQL
        deliverer = subprocess.Popen(
            [sys.executable, "-m", "outbox", "deliver", "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        worker = ob.worker("refunds", "1", handler, concurrency=10)
        working = asyncio.create_task(worker.run())
        try:
            run = await ob.start_run(
                "refunds", "1", {"ask": "Refund order o-17 in full"}, budget=10_000
            )
            print(f"run {run.id} started")
            while (await ob.run(run.id)).status != RunStatus.WAITING:
                await asyncio.sleep(0.1)
            print("the run is parked, waiting for approval; a person approves it")
            await ob.signal(run.id, "approval", {"by": "alice"})
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
            print(f"effect {e.kind} {e.status.value} key={e.idempotency_key[:16]}...")
        print(f"sink: {SINK.stats()['operations_applied']} refund applied")

        before = model_calls
        replayed = await run_agent(await ob.run(run.id), agent, run.inputs["ask"])
        print(f"\nreplay: {replayed.output!r}; model calls during replay: {model_calls - before}")
    SINK.stop()


if __name__ == "__main__":
    asyncio.run(main())
