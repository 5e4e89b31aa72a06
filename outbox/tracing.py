"""OpenTelemetry traces of intents, delivery attempts and run steps (extra ``[otel]``).

The trace context current when an intent is written is stored with it as a W3C
``traceparent`` (:func:`current_traceparent`). Each delivery attempt is a span
whose parent is that stored context, with a link to it as well (so the attempt
is in the intent's trace even when it runs days later in another process), and
the HTTP deliverer sends the attempt's ``traceparent``. A run's start opens
the run's trace; each of its steps is a span of it.

Only the OpenTelemetry *API* is used. Without it installed every function here
is a constant no-op; with it installed but no SDK configured, the API's no-op
tracer makes spans free (no allocation beyond a shared invalid span), and a
stored context still propagates to the sink unchanged. Metrics stay Prometheus.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

__all__ = [
    "SpanHandle",
    "current_traceparent",
    "delivery_span",
    "run_span",
    "step_span",
    "tracing_on",
]

try:  # the extra: pip install 'agent-outbox[otel]'
    from opentelemetry import trace as _trace
    from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags
    from opentelemetry.trace.status import Status, StatusCode
except ImportError:  # pragma: no cover - exercised where the extra is not installed
    _trace = None  # type: ignore[assignment]

TRACER_NAME = "agent-outbox"
_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def current_traceparent() -> str | None:
    """The W3C ``traceparent`` of the span current in this context, or None."""
    if _trace is None:
        return None
    ctx = _trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def _parse(traceparent: str | None) -> Any:
    if _trace is None or not traceparent:
        return None
    match = _TRACEPARENT.match(traceparent)
    if match is None:
        return None
    ctx = SpanContext(
        trace_id=int(match[1], 16),
        span_id=int(match[2], 16),
        is_remote=True,
        trace_flags=TraceFlags(int(match[3], 16)),
    )
    return ctx if ctx.is_valid else None


class SpanHandle:
    """What a caller may do with an open span: name its outcome."""

    __slots__ = ("_span", "traceparent")

    def __init__(self, span: Any) -> None:
        self._span = span
        #: The W3C traceparent an attempt in this span sends to its sink (None: none).
        self.traceparent: str | None = None

    def outcome(self, outcome: str, *, error: str | None = None) -> None:
        """Record how the attempt or step ended (an error marks the span's status)."""
        if self._span is None:
            return
        self._span.set_attribute("outbox.outcome", outcome)
        if error is not None:
            self._span.set_status(Status(StatusCode.ERROR, error[:500]))

    def event(self, name: str, attributes: Mapping[str, Any]) -> None:
        """Add an event (a moment within the span)."""
        if self._span is not None:
            self._span.add_event(name, dict(attributes))


_NOOP = SpanHandle(None)


@contextmanager
def _span(
    name: str,
    parent: str | None,
    attributes: Mapping[str, Any],
    *,
    kind: Any = None,
    link: bool = False,
) -> Iterator[SpanHandle]:
    if _trace is None:
        yield _NOOP
        return
    parent_ctx = _parse(parent)
    context = None
    if parent_ctx is not None:
        context = _trace.set_span_in_context(_trace.NonRecordingSpan(parent_ctx))
    tracer = _trace.get_tracer(TRACER_NAME)
    with tracer.start_as_current_span(
        name,
        context=context,
        kind=SpanKind.INTERNAL if kind is None else kind,
        attributes={k: v for k, v in attributes.items() if v is not None},
        links=[Link(parent_ctx)] if link and parent_ctx is not None else None,
        record_exception=True,
        set_status_on_exception=True,
    ) as span:
        yield SpanHandle(span)


def tracing_on() -> bool:
    """True when an OpenTelemetry SDK records spans (a tracer provider was set)."""
    if _trace is None:
        return False
    provider = _trace.get_tracer_provider()
    return not isinstance(provider, _trace.ProxyTracerProvider | _trace.NoOpTracerProvider)


@contextmanager
def delivery_span(
    *,
    traceparent: str | None,
    kind: str,
    key: str,
    attempt: int,
    effect_id: object,
    run_id: object,
) -> Iterator[SpanHandle]:
    """The span of one delivery attempt: a child of (and linked to) the intent's context.

    The handle's ``traceparent`` is what the attempt sends on. Without an SDK no
    span is recorded, so none is made: the intent's own context is sent on as
    it was stored, as the API's non-recording span would have sent it, at a
    twentieth of the cost per attempt (ids are not even formatted).
    """
    if not tracing_on():
        parsed = _parse(traceparent)
        handle = SpanHandle(None)
        handle.traceparent = traceparent if parsed is not None else None
        yield handle
        return
    with _span(
        f"outbox.deliver {kind}",
        traceparent,
        {
            "outbox.effect.kind": kind,
            "outbox.effect.key": key,
            "outbox.effect.id": str(effect_id),
            "outbox.run.id": None if run_id is None else str(run_id),
            "outbox.attempt": attempt,
        },
        kind=SpanKind.CONSUMER,
        link=True,
    ) as handle:
        handle.traceparent = current_traceparent()
        yield handle


def run_span(*, agent: str, version: str) -> Any:
    """The span that starts a run's trace (a child of the caller's span, if any)."""
    return _span(
        f"outbox.run {agent}", None, {"outbox.agent": agent, "outbox.agent_version": version}
    )


def step_span(*, traceparent: str | None, run_id: str, step_id: str, kind: str) -> Any:
    """The span of one step of a run, in the run's trace (whichever process runs it)."""
    return _span(
        f"outbox.step {step_id}",
        traceparent,
        {"outbox.run.id": run_id, "outbox.step.id": step_id, "outbox.step.kind": kind},
    )
