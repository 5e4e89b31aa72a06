"""OpenAI Agents SDK on agent-outbox: a real agent, a real worker killed with SIGKILL, a real sink.

The agent (``openai_agent.py``) runs on a scripted offline ``Model`` behind a
``ModelProvider`` inside ``outbox worker`` processes; its refund tool is an
effect delivered by an ``outbox deliver`` process to an HTTP sink that honours
``Idempotency-Key``.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import pytest
from agents import FunctionTool

from deliverers.testing import IdempotentHttpSink
from outbox import AsyncOutbox, Outbox, RunStatus, ValidationError
from outbox.check.processes import start_deliverer
from outbox.check.workload import write_config
from tests.integrations.openai_agent import COST
from tests.integrations.processes import lines, start_worker, stop
from tests.support import wait_for

pytestmark = pytest.mark.slow

INTEND = "agent:tool:refund:call-2#1:effect#1:intend"
#: The steps the agent records, in order, up to the refund's intent.
STEPS = ["agent:model#1", "agent:tool:lookup_order:call-1#1", "agent:model#2", INTEND]


def model_steps(ob: Outbox, run_id: Any) -> list[str]:
    return [s for s in ob.run(run_id).completed_steps if s.startswith("agent:model#")]


@pytest.mark.parametrize(
    ("crash_at", "recorded_at_kill"),
    [
        # killed right after the first model response was recorded
        ("after_step:1", STEPS[:1]),
        # killed right after the refund's intent was committed, before the run parked
        (f"after_step@{INTEND}", STEPS),
    ],
)
def test_a_killed_worker_resumes_the_agent_without_calling_the_model_again_or_refunding_twice(
    ob: Outbox,
    sub_env: dict[str, str],
    tmp_path: Path,
    crash_at: str,
    recorded_at_kill: list[str],
) -> None:
    model_log = tmp_path / "model.log"
    handler = "tests.integrations.openai_agent:refunds"
    with IdempotentHttpSink() as sink:
        run = ob.start_run(
            "oa-refunds", "1", {"model_log": str(model_log), "sink": sink.url}, budget=1000
        )
        deliverer = start_deliverer(sub_env, write_config(tmp_path), tmp_path / "d.log")
        doomed = start_worker(sub_env, handler, "oa-refunds", tmp_path / "w1.log", crash_at)
        try:
            assert doomed.wait(timeout=60) == -signal.SIGKILL
            # the worker died where the test means: these steps, and no later one, committed
            assert ob.run(run.id).completed_steps == recorded_at_kill
            calls_at_kill = len(lines(model_log))
            survivor = start_worker(sub_env, handler, "oa-refunds", tmp_path / "w2.log")
            try:
                wait_for(lambda: ob.run(run.id).status == RunStatus.COMPLETED, timeout=60)
            finally:
                stop(survivor)
        finally:
            stop(deliverer)
        stats = sink.stats()
    done = ob.run(run.id)
    assert done.record.result == "refunded: HTTP 200"
    # the resumed worker called the model only for the turns not recorded at the kill
    assert calls_at_kill == len([s for s in recorded_at_kill if s.startswith("agent:model")])
    assert lines(model_log) == ["request 1", "request 2", "request 3"]
    assert model_steps(ob, run.id) == ["agent:model#1", "agent:model#2", "agent:model#3"]
    # the refund was intended once and applied once, with its key
    (refund,) = done.effects()
    assert refund.status.value == "succeeded"
    assert refund.payload["json"] == {"operation": "refund:o-17", "cents": 1250}
    assert stats["keys_applied"] == 1 and stats["duplicate_keys_applied"] == []
    assert stats["operations_applied"] == 1 and stats["duplicate_operations"] == []
    # each request's tokens were debited once
    assert done.record.spent == 3 * COST


def test_a_replayed_run_with_a_handoff_calls_neither_model_nor_tools(
    dsn: str, tmp_path: Path
) -> None:
    """A triage agent (a model name) hands off to an agent holding a ``Model`` instance."""
    from agents import Agent, function_tool
    from agents.testing import assistant_message, function_call

    from outbox.integrations.openai_agents import run_agent
    from tests.integrations.openai_agent import ScriptedModel, offline

    lookups: list[str] = []

    @function_tool
    def lookup_invoice(number: str) -> str:
        """Look an invoice up."""
        lookups.append(number)
        return f"invoice {number}: 12.50, paid"

    def billing_script(done: list[Any]) -> list[Any]:
        # done[0] is the handoff's own output (the triage agent's transfer)
        if len(done) == 1:
            return [function_call("lookup_invoice", {"number": "I-9"}, call_id="b-1")]
        return [assistant_message(f"billing says: {done[-1]}")]

    billing_log = tmp_path / "billing.log"
    billing = Agent(
        name="billing",
        model=ScriptedModel(billing_script, str(billing_log)),
        tools=[lookup_invoice],
    )
    triage_log = tmp_path / "triage.log"
    triage_model = ScriptedModel(
        lambda done: [function_call("transfer_to_billing", {}, call_id="t-1")], str(triage_log)
    )
    triage = Agent(name="triage", model="scripted", handoffs=[billing])

    async def main() -> tuple[str, str, str, list[str], float]:
        async with await AsyncOutbox.connect(dsn) as ob:
            run = await ob.start_run("triage", "1", {}, budget=1000)
            first = await run_agent(run, triage, "is I-9 paid?", run_config=offline(triage_model))
            replayed = await run_agent(
                await ob.run(run.id), triage, "is I-9 paid?", run_config=offline(triage_model)
            )
            with pytest.raises(ValidationError, match="session"):
                await run_agent(run, triage, "again", session=object())
            done = await ob.run(run.id)
            return (
                first.final_output,
                replayed.final_output,
                replayed.last_agent.name,
                done.completed_steps,
                float(done.record.spent),
            )

    first, replayed, last_agent, steps, spent = asyncio.run(main())
    assert first == replayed == "billing says: invoice I-9: 12.50, paid"
    assert last_agent == "billing"
    # one call per request, none on the replay; the tool ran once
    assert lines(triage_log) == ["request 1"]
    assert len(lines(billing_log)) == 2
    assert lookups == ["I-9"]
    assert steps == [
        "agent:model#1",
        "agent:model#2",
        "agent:tool:lookup_invoice:b-1#1",
        "agent:model#3",
    ]
    assert spent == 3 * COST
    # the agents the caller built are untouched: only run_agent's copies record
    assert type(billing.model).__name__ == "ScriptedModel"
    tool = billing.tools[0]
    assert isinstance(tool, FunctionTool)
    assert tool.on_invoke_tool is lookup_invoice.on_invoke_tool


def test_a_model_request_the_sdk_retries_keeps_its_step_and_is_not_made_on_replay(
    dsn: str, tmp_path: Path
) -> None:
    """The first attempt fails; the SDK's retry is recorded as request #1, as a replay expects."""
    from agents import Agent, ModelSettings
    from agents.retry import ModelRetrySettings
    from agents.testing import assistant_message

    from outbox.integrations.openai_agents import run_agent
    from tests.integrations.openai_agent import ScriptedModel, offline

    class FlakyModel(ScriptedModel):
        attempts = 0

        async def get_response(self, *args: Any, **kwargs: Any) -> Any:
            FlakyModel.attempts += 1
            if FlakyModel.attempts == 1:
                raise ConnectionError("the model's endpoint hung up")
            return await super().get_response(*args, **kwargs)

    model = FlakyModel(lambda done: [assistant_message("hello")], str(tmp_path / "model.log"))
    retry = ModelRetrySettings(max_retries=2, backoff={"initial_delay": 0}, policy=lambda c: True)
    agent = Agent(name="greeter", model="scripted", model_settings=ModelSettings(retry=retry))

    async def main() -> tuple[str, str, list[str]]:
        async with await AsyncOutbox.connect(dsn) as ob:
            run = await ob.start_run("greeter", "1", {}, budget=1000)
            first = await run_agent(run, agent, "hi", run_config=offline(model))
            replayed = await run_agent(await ob.run(run.id), agent, "hi", run_config=offline(model))
            return first.final_output, replayed.final_output, (await ob.run(run.id)).completed_steps

    first, replayed, steps = asyncio.run(main())
    assert first == replayed == "hello"
    assert FlakyModel.attempts == 2  # the failed attempt and its retry; nothing on replay
    assert steps == ["agent:model#1"]


def test_a_tools_own_error_goes_to_the_model_and_an_error_of_the_run_ends_it(
    dsn: str, tmp_path: Path
) -> None:
    """The SDK tells the model "please try again" for a failed tool; not for a bad effect."""
    from agents import Agent, function_tool
    from agents.testing import assistant_message, function_call

    from outbox import PayloadError
    from outbox.integrations.openai_agents import effect, run_agent
    from tests.integrations.openai_agent import ScriptedModel, offline

    @function_tool
    def flaky_lookup(order_id: str) -> str:
        """Look an order up (its database is down)."""
        raise ConnectionError("orders database unreachable")

    @function_tool
    async def refund(order_id: str) -> str:
        """Refund, with a payload that is not JSON."""
        await effect("http.request", {"url": "http://127.0.0.1:9/refunds", "cents": float("nan")})
        return "refunded"

    def script(done: list[Any]) -> list[Any]:
        if not done:
            return [function_call("flaky_lookup", {"order_id": "o-1"}, call_id="c-1")]
        if len(done) == 1:
            return [function_call("refund", {"order_id": "o-1"}, call_id="c-2")]
        return [assistant_message(f"gave up: {done}")]

    model_log = tmp_path / "model.log"
    agent = Agent(name="clumsy", model="scripted", tools=[flaky_lookup, refund])

    async def main() -> tuple[list[str], Any]:
        async with await AsyncOutbox.connect(dsn) as ob:
            run = await ob.start_run("clumsy", "1", {}, budget=1000)
            config = offline(ScriptedModel(script, str(model_log)))
            with pytest.raises(PayloadError, match="cents"):
                await run_agent(run, agent, "refund o-1", run_config=config)
            done = await ob.run(run.id)
            return done.completed_steps, done.step("agent:tool:flaky_lookup:c-1#1")

    steps, lookup = asyncio.run(main())
    # the lookup's failure was the model's to handle, recorded as the message it got
    assert lookup is not None and "error occurred" in lookup.result
    # the refund's bad payload ended the run: no tool step, no third model request
    assert steps == ["agent:model#1", "agent:tool:flaky_lookup:c-1#1", "agent:model#2"]
    assert lines(model_log) == ["request 1", "request 2"]


def test_a_streamed_run_is_refused_inside_a_run(dsn: str) -> None:
    from agents import Agent, RunConfig, Runner
    from agents.testing import assistant_message

    from outbox.integrations.openai_agents import RecordedModel, in_run
    from tests.integrations.openai_agent import ScriptedModel

    agent = Agent(name="s", model=RecordedModel(ScriptedModel(lambda d: [assistant_message("x")])))

    async def main() -> None:
        async with await AsyncOutbox.connect(dsn) as ob:
            run = await ob.start_run("streamer", "1", {})
            async with in_run(run):
                streamed = Runner.run_streamed(
                    agent, "hi", run_config=RunConfig(tracing_disabled=True)
                )
                with pytest.raises(ValidationError, match="streamed runs are not recorded"):
                    async for _ in streamed.stream_events():
                        pass

    asyncio.run(main())
