"""Kafka for tests: the Tansu broker (deliverers.testing.TansuBroker) and client tuning."""

from __future__ import annotations

from deliverers.testing import TansuBroker

__all__ = ["CONSUMER_TUNING", "TansuBroker"]

# Tansu takes tens of seconds to settle a consumer group with Kafka's default
# timeouts; these keep a join to a few seconds.
CONSUMER_TUNING = {
    "session_timeout_ms": 6000,
    "heartbeat_interval_ms": 500,
    "max_poll_interval_ms": 6000,
}
