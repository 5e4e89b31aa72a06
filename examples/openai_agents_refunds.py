"""An OpenAI Agents SDK refund agent on agent-outbox: recorded model calls, an effect, an approval.

Run it from a clone (PostgreSQL is the embedded default in ./.outbox):

    pip install -e '.[openai-agents]'
    python examples/openai_agents_refunds.py

What happens: an async worker runs the agent as an agent-outbox run with
`run_agent` instead of `Runner.run`. Every model request and function tool
call is a recorded step (the model's token usage is debited from the run's
budget). The refund is an *effect*: intended in a step, delivered by an
`outbox deliver` process to a local HTTP sink with its idempotency key, and the
tool returns once it is known; the run is parked at zero compute meanwhile,
and again while it waits for a person's approval. Finally the finished run is
replayed: the agent gets the same answer and the model is not called again.

The model here is a scripted offline `Model` behind a `ModelProvider`, so the
example needs no API key and no network. `--model gpt-4.1` (with
OPENAI_API_KEY set) runs the same agent on a real model through the SDK's own
provider instead.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from agents import (
    Agent,
    Model,
    ModelProvider,
    ModelResponse,
    MultiProvider,
    RunConfig,
    Usage,
    function_tool,
)
from agents.testing import assistant_message, function_call

from deliverers.testing import IdempotentHttpSink
from outbox import AsyncOutbox, AsyncRun, RunStatus
from outbox.integrations.openai_agents import effect, run_agent, wait_for_signal

SINK = IdempotentHttpSink().start()


class ScriptedModel(Model):
    """Stands in for an LLM: look the order up, ask for approval, refund, answer."""

    async def get_response(
        self, system_instructions: Any, input: Any, *args: Any, **kwargs: Any
    ) -> ModelResponse:
        """The next turn of the script, by how many tool results the input holds."""
        # Answer by the conversation's position (a resumed run brings its history).
        done = [i["output"] for i in input if i.get("type") == "function_call_output"]
        if len(done) == 0:
            output = function_call("lookup_order", {"order_id": "o-17"}, call_id="call-1")
        elif len(done) == 1:
            output = function_call("ask_approval", {"cents": 125_000}, call_id="call-2")
        elif len(done) == 2:
            refund_args = {"order_id": "o-17", "cents": 125_000}
            output = function_call("refund", refund_args, call_id="call-3")
        else:
            output = assistant_message(f"Refunded o-17: {done[-1]}")
        usage = Usage(requests=1, input_tokens=120, output_tokens=30, total_tokens=150)
        return ModelResponse(output=[output], usage=usage, response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        """Not needed: run_agent runs the agent with Runner.run."""
        raise NotImplementedError("the scripted model does not stream")


class ScriptedProvider(ModelProvider):
    """Resolves every model name to the scripted model, as the SDK's provider does to a real one."""

    def get_model(self, model_name: str | None) -> Model:
        """The scripted model, whatever the name."""
        return ScriptedModel()


class CountingProvider(ModelProvider):
    """Counts the requests that reach a model (scripted or real), to show what a replay costs."""

    def __init__(self, provider: ModelProvider) -> None:
        self.provider = provider
        self.calls = 0

    def get_model(self, model_name: str | None) -> Model:
        """The provider's model, counted."""
        return Counted(self.provider.get_model(model_name), self)


class Counted(Model):
    """A model whose requests add one to its provider's count."""

    def __init__(self, model: Model, counter: CountingProvider) -> None:
        self.model = model
        self.counter = counter

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        """Count, then ask the model."""
        self.counter.calls += 1
        return await self.model.get_response(*args, **kwargs)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        """Count, then stream from the model."""
        self.counter.calls += 1
        return self.model.stream_response(*args, **kwargs)


@function_tool
def lookup_order(order_id: str) -> dict[str, Any]:
    """Look an order up (a recorded step: replayed, never repeated)."""
    return {"id": order_id, "cents": 125_000, "customer": "ACME"}


@function_tool
async def ask_approval(cents: int) -> str:
    """Refunds over 1000 need a person: wait for the `approval` signal, at most an hour."""
    reply = await wait_for_signal("approval", timeout=3600)
    return f"approved by {reply['by']}"


@function_tool
async def refund(order_id: str, cents: int) -> str:
    """Refund an order: an effect delivered once, with its idempotency key."""
    reply = await effect(
        "http.request",
        {"url": f"{SINK.url}/refunds", "json": {"operation": f"refund:{order_id}", "cents": cents}},
    )
    return f"sink answered HTTP {reply['status']}"


async def main(model: str | None) -> None:
    """Start a deliverer and a worker, run the agent, approve, show the run, replay it."""
    agent = Agent(
        name="refunds",
        instructions="Look the order up, get approval for large refunds, then refund it.",
        model=model or "scripted",
        tools=[lookup_order, ask_approval, refund],
    )
    if model:  # the SDK's own provider (OpenAI models by name)
        models = CountingProvider(MultiProvider())
        run_config = RunConfig(model_provider=models)
    else:  # offline: the scripted provider, and the SDK's trace export (to OpenAI) off
        models = CountingProvider(ScriptedProvider())
        run_config = RunConfig(model_provider=models, tracing_disabled=True)

    async def handler(run: AsyncRun) -> str:
        """What `outbox worker examples_module:handler` would run for each run."""
        result = await run_agent(run, agent, run.inputs["ask"], run_config=run_config)
        return str(result.final_output)

    config = Path(tempfile.mkdtemp()) / "deliverers.toml"
    config.write_text('[kinds."http.request"]\nallow_private = ["127.0.0.1"]\n')
    async with await AsyncOutbox.connect() as ob:  # OUTBOX_DSN, else the embedded PostgreSQL
        deliverer = subprocess.Popen(
            [sys.executable, "-m", "outbox", "deliver", "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        worker = ob.worker("oa-refunds", "1", handler, concurrency=10)
        working = asyncio.create_task(worker.run())
        try:
            run = await ob.start_run(
                "oa-refunds", "1", {"ask": "Refund order o-17 in full"}, budget=10_000
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

        before = models.calls
        replayed = await run_agent(
            await ob.run(run.id), agent, run.inputs["ask"], run_config=run_config
        )
        calls = models.calls - before
        print(f"\nreplay: {replayed.final_output!r}; model calls during replay: {calls}")
    SINK.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a real model (needs OPENAI_API_KEY); default: offline")
    asyncio.run(main(parser.parse_args().model))
