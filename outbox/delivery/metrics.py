"""Prometheus metrics of a daemon, on a registry of its own (no process-global state)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = ["DeliveryMetrics"]

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 3600)


class DeliveryMetrics:
    """Effects by state and kind, attempt outcomes, delivery latency, oldest pending age."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.effects = Gauge(
            "outbox_effects",
            "Effects not yet finished, by state and kind",
            ["state", "kind"],
            registry=self.registry,
        )
        self.attempts = Counter(
            "outbox_attempts",
            "Attempt outcomes recorded by this daemon",
            ["kind", "outcome"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "outbox_delivery_latency_seconds",
            "Intent commit to recorded completion",
            ["kind"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.oldest_pending = Gauge(
            "outbox_oldest_pending_age_seconds",
            "Seconds the longest-due pending effect has waited",
            registry=self.registry,
        )
        self.leases_lost = Counter(
            "outbox_leases_lost",
            "Attempts whose lease was taken over while running",
            ["kind"],
            registry=self.registry,
        )
        self.unrecorded = Counter(
            "outbox_outcomes_unrecorded",
            "Attempts whose outcome could not be written at all (left to the reconciler)",
            ["kind"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "outbox_in_flight", "Calls this daemon is making now", registry=self.registry
        )
        self._counters: dict[tuple[str, str], Any] = {}
        self._histograms: dict[str, Any] = {}

    def attempt_recorded(self, kind: str, outcome: str, latency: float | None) -> None:
        """Count one recorded attempt (and its commit-to-completion latency when final).

        Label children are cached: looking them up costs more than the increment.
        """
        key = (kind, outcome)
        counter = self._counters.get(key)
        if counter is None:
            counter = self._counters[key] = self.attempts.labels(kind=kind, outcome=outcome)
        counter.inc()
        if latency is not None:
            histogram = self._histograms.get(kind)
            if histogram is None:
                histogram = self._histograms[kind] = self.latency.labels(kind=kind)
            histogram.observe(latency)

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        """Expose ``/metrics`` on ``addr:port`` from a background thread."""
        start_http_server(port, addr=addr, registry=self.registry)

    def set_states(self, counts: dict[tuple[str, str], int]) -> None:
        """Replace the per-(state, kind) gauge with fresh counts."""
        self.effects.clear()
        for (state, kind), n in counts.items():
            self.effects.labels(state=state, kind=kind).set(n)
