"""OpenTelemetry: one trace from tx.intend through every delivery attempt, to the sink.

The SDK's in-memory exporter collects the spans of this process; the sink logs
the ``traceparent`` header of every request it receives, including the one sent
by a deliverer that was then killed with SIGKILL.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from deliverers.http import HttpDeliverer
from deliverers.testing import Fault, IdempotentHttpSink
from outbox import Outbox
from outbox.check.processes import start_deliverer
from outbox.check.workload import write_config
from tests.support import DaemonThread, wait_for


class _Gate(SpanProcessor):
    """Forwards spans to the exporter only while a test of this module listens."""

    def __init__(self, inner: SpanProcessor) -> None:
        self.inner = inner
        self.open = False

    def on_end(self, span: ReadableSpan) -> None:
        if self.open:
            self.inner.on_end(span)


_EXPORTER = InMemorySpanExporter()
_GATE = _Gate(SimpleSpanProcessor(_EXPORTER))


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """The SDK with an in-memory exporter (installed once per process; gated per test)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        provider.add_span_processor(_GATE)
        trace.set_tracer_provider(provider)
    _EXPORTER.clear()
    _GATE.open = True
    yield _EXPORTER
    _GATE.open = False
    _EXPORTER.clear()


def attrs(span: ReadableSpan) -> Mapping[str, Any]:
    """The span's attributes (every span here has some)."""
    assert span.attributes is not None, span.name
    return span.attributes


def tp(span: ReadableSpan) -> str:
    ctx = span.get_span_context()
    assert ctx is not None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def sink_requests(log: Path, key: str) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    return [e for e in map(json.loads, log.read_text().splitlines()) if e["key"] == key]


@pytest.mark.slow
@pytest.mark.chaos
def test_one_trace_from_intend_through_every_attempt(
    ob: Outbox,
    dsn: str,
    sub_env: dict[str, str],
    tmp_path: Path,
    spans: InMemorySpanExporter,
) -> None:
    log = tmp_path / "sink.jsonl"
    with IdempotentHttpSink(log_path=log, latency=0.05) as sink:
        tracer = trace.get_tracer("agent")
        with tracer.start_as_current_span("handle ticket 42") as agent_span:
            run = ob.start_run("agent", "1")

            def step(tx: Any) -> list[str]:
                a = tx.intend("http.request", {"url": f"{sink.url}/a", "json": {"op": "a"}})
                b = tx.intend("http.request", {"url": f"{sink.url}/b", "json": {"op": "b"}})
                return [a.idempotency_key, b.idempotency_key]

            retried, recovered = run.transaction("notify", step)
        trace_id = agent_span.get_span_context().trace_id

        # The intents carry the step's context; the step is a span of the run's trace.
        stored = {e.idempotency_key: e.trace_parent for e in ob.effects(run_id=run.id)}
        step_span = next(s for s in spans.get_finished_spans() if s.name == "outbox.step notify")
        assert stored[retried] == stored[recovered] == tp(step_span)
        assert ob.run(run.id).record.trace_parent is not None

        # A deliverer takes effect "b" (and maybe "a") and is killed after its call.
        config = write_config(tmp_path)
        doomed = start_deliverer(sub_env, config, tmp_path / "doomed.log", crash_at="after_call")
        assert doomed.wait(timeout=60) == -signal.SIGKILL
        # This process recovers what it held once its 1 s lease runs out; the sink
        # refuses the first request it gets now, so that attempt is retried.
        sink.inject(Fault("500_before", times=1))
        deliverer = HttpDeliverer.from_config("http.request", {"allow_private": ["127.0.0.1"]})
        with DaemonThread(
            dsn, {"http.request": deliverer}, retry_base_seconds=0.05, retry_cap_seconds=0.1
        ):
            wait_for(
                lambda: {e.status.value for e in ob.effects(run_id=run.id)} == {"succeeded"},
                timeout=60,
                message="both effects delivered",
            )

    attempts = [s for s in spans.get_finished_spans() if s.name == "outbox.deliver http.request"]
    outcomes = sorted(str(attrs(s)["outbox.outcome"]) for s in attempts)
    assert "retry" in outcomes and outcomes.count("succeeded") == 2, outcomes
    for span in attempts:
        # every attempt in the agent's trace, a child of (and linked to) the intent's step
        assert span.context.trace_id == trace_id
        assert span.parent is not None and span.parent.span_id == step_span.context.span_id
        assert [link.context.span_id for link in span.links] == [step_span.context.span_id]
        assert attrs(span)["outbox.effect.kind"] == "http.request"
    # An attempt made elsewhere first (the killed deliverer's) shows in the numbering.
    first_here = {
        key: min(
            int(attrs(s)["outbox.attempt"])
            for s in attempts
            if attrs(s)["outbox.effect.key"] == key
        )
        for key in (retried, recovered)
    }
    assert max(first_here.values()) >= 2, first_here

    # The sink saw the same trace on every request: the killed process's too
    # (it had no SDK, so it passed the intent's context on unchanged), and for
    # each attempt of this process exactly that attempt's span.
    ours = {tp(s) for s in attempts}
    for key in (retried, recovered):
        seen = [r["traceparent"] for r in sink_requests(log, key)]
        assert seen and all(t.split("-")[1] == f"{trace_id:032x}" for t in seen), seen
    everything = sink_requests(log, retried) + sink_requests(log, recovered)
    killed = [r for r in everything if r["traceparent"] == stored[recovered]]
    assert killed, "the killed deliverer's request carried the intent's traceparent"
    assert {r["traceparent"] for r in everything} - {stored[recovered]} <= ours


def test_without_an_sdk_nothing_is_recorded_and_nothing_fails(sub_env: dict[str, str]) -> None:
    script = """
import json
from outbox import Outbox
from outbox.tracing import current_traceparent
ob = Outbox.connect()
run = ob.start_run("agent", "1")
effect = run.transaction("s", lambda tx: tx.intend("http.request", {"url": "https://x.example"}))
print(json.dumps([current_traceparent(), ob.effects()[0].trace_parent, run.record.trace_parent]))
ob.close()
"""
    done = subprocess.run(
        [sys.executable, "-c", script], env=sub_env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [None, None, None]


def test_steps_of_a_run_are_spans_of_its_trace_sync_and_async(
    ob: Outbox, dsn: str, spans: InMemorySpanExporter
) -> None:
    import asyncio

    from outbox import AsyncOutbox

    run = ob.start_run("agent", "1")
    run.call("look", lambda: 1)
    run.transaction("write", lambda tx: tx.intend("x.y", {"a": 1}).idempotency_key)

    async def resume() -> None:
        async with await AsyncOutbox.connect(dsn) as aob:
            arun = await aob.run(run.id)

            async def step(tx: Any) -> str:
                return str((await tx.intend("x.y", {"a": 2})).kind)

            await arun.transaction("later", step)

    asyncio.run(resume())
    finished = {s.name: s for s in spans.get_finished_spans()}
    root = finished["outbox.run agent"]
    for name in ("outbox.step look", "outbox.step write", "outbox.step later"):
        step = finished[name]
        assert step.context.trace_id == root.context.trace_id
        assert step.parent is not None and step.parent.span_id == root.context.span_id
    stored = {e.step_id: e.trace_parent for e in ob.effects(run_id=run.id)}
    assert stored == {
        "write": tp(finished["outbox.step write"]),
        "later": tp(finished["outbox.step later"]),
    }


def test_outbox_deliver_under_the_zero_code_launcher_exports_its_spans(
    ob: Outbox, sub_env: dict[str, str], tmp_path: Path
) -> None:
    """docs/howto/traces.md: `opentelemetry-instrument -- outbox deliver ...`, as written."""
    import re
    import shlex
    import shutil

    page = (Path(__file__).resolve().parents[2] / "docs/howto/traces.md").read_text()
    block = page.split("## `outbox deliver` and `outbox worker`", 1)[1].split("```bash\n", 1)[1]
    (line,) = [x for x in block.split("```", 1)[0].splitlines() if " outbox deliver " in x]
    launcher = shlex.split(line)
    assert launcher[:3] == ["opentelemetry-instrument", "--", "outbox"]
    launcher[0] = shutil.which("opentelemetry-instrument") or "opentelemetry-instrument"
    launcher[2:3] = [sys.executable, "-m", "outbox"]
    config = tmp_path / launcher[-1]
    config.write_text('[kinds."http.request"]\nallow_private = ["127.0.0.1"]\n')
    env = {
        **sub_env,
        "OTEL_SERVICE_NAME": "outbox-deliver",
        "OTEL_TRACES_EXPORTER": "console",  # the quick check the page names
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
    }
    with IdempotentHttpSink() as sink:
        with ob.transaction() as tx:
            effect = tx.intend("http.request", {"url": f"{sink.url}/traced", "json": {}})
        daemon = subprocess.Popen(
            launcher, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        try:
            wait_for(
                lambda: ob.effect(effect.id).status.value == "succeeded",
                timeout=60,
                message="delivered under the launcher",
            )
        finally:
            daemon.send_signal(signal.SIGTERM)
            out, err = daemon.communicate(timeout=60)
    assert daemon.returncode == 0, err.decode()[-2000:]
    spans = re.findall(r'"name": "(outbox\.deliver [^"]+)"', out.decode())
    assert spans == ["outbox.deliver http.request"], out.decode()[-2000:]
    assert '"service.name": "outbox-deliver"' in out.decode()
