"""The deliverer's gauges follow its own deliveries, not only the ``stats_seconds`` round."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry

from deliverers.testing import RecordingDeliverer
from outbox import Outbox
from outbox.delivery import Delivery, Outcome, Succeeded
from tests.support import DaemonThread, wait_for


def _open(registry: CollectorRegistry) -> float:
    """Effects of the kind the gauge counts as not finished (pending or in flight)."""
    return sum(
        registry.get_sample_value("outbox_effects", {"state": state, "kind": "test.record"}) or 0
        for state in ("pending", "in_flight")
    )


def test_a_delivery_clears_the_effect_gauges_within_seconds(ob: Outbox, dsn: str) -> None:
    with ob.transaction() as tx:
        tx.intend("test.record", {"n": 1})
    release = threading.Event()

    def held(delivery: Delivery) -> Outcome:
        release.wait(30)
        return Succeeded({"ok": True})

    recorder = RecordingDeliverer(outcome=held)
    # One scheduled round an hour: only a count after the change can clear the gauge.
    with DaemonThread(dsn, {"test.record": recorder}, stats_seconds=3600) as running:
        assert running.daemon is not None
        registry = running.daemon.metrics.registry
        wait_for(lambda: _open(registry) == 1, message="the gauges count the open effect")
        release.set()
        wait_for(lambda: len(recorder.keys) == 1, message="delivered")
        wait_for(
            lambda: (
                _open(registry) == 0
                and registry.get_sample_value("outbox_oldest_pending_age_seconds") == 0
            ),
            timeout=10,
            message="the gauges counted again after the delivery",
        )
