"""The duty probe paces itself by its cost, on the in-memory store.

On one server the probe takes about 2 ms and runs every half second. Over the
32 shards of a Citus cluster it is 160 shard reads, about 85 ms: twice a second
that kept a sixth of a coordinator busy, idle or not. A probe waits at least
``PROBE_COST_FACTOR`` times the last one's duration.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from outbox.delivery.leases import Leases
from outbox.delivery.maintenance import PROBE_COST_FACTOR, Maintenance
from outbox.delivery.memory import InMemoryStore
from outbox.delivery.metrics import DeliveryMetrics
from outbox.delivery.settings import DeliverySettings
from outbox.storage.attempts import DutyAsk, DutyFindings

pytestmark = pytest.mark.timeout(30)


class TimedProbes(InMemoryStore):
    """The in-memory store, its probe taking ``cost`` seconds; when each probe was sent."""

    def __init__(self, cost: float) -> None:
        super().__init__()
        self.cost = cost
        self.sent: list[float] = []

    async def probe_duties(self, ask: DutyAsk) -> DutyFindings:
        self.sent.append(time.monotonic())
        await asyncio.sleep(self.cost)
        return await super().probe_duties(ask)


def probes_sent(cost: float, seconds: float) -> list[float]:
    """When the probes of duty rounds run back to back for ``seconds`` were sent."""
    store = TimedProbes(cost)
    metrics = DeliveryMetrics()
    settings = DeliverySettings(reconcile_seconds=0.1, gone_check_seconds=0.1)
    maintenance = Maintenance(store, {}, settings, Leases({}, 1, metrics), metrics, lambda: None)

    async def rounds() -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            await maintenance.duties()
            await asyncio.sleep(0.01)

    asyncio.run(rounds())
    return store.sent


def test_a_cheap_probe_runs_at_the_reconcile_interval() -> None:
    sent = probes_sent(cost=0.001, seconds=1.0)
    gaps = [b - a for a, b in itertools.pairwise(sent)]
    assert len(sent) >= 4, sent  # every 0.1 s (fewer on a loaded machine)
    # (an upper bound loose enough for a busy CI machine: the pace is the interval's)
    assert all(0.09 <= gap < 0.35 for gap in gaps), gaps


def test_a_slow_probe_spaces_out_the_next() -> None:
    cost = 0.04  # Citus-like: ten times the interval's share
    sent = probes_sent(cost=cost, seconds=1.5)
    gaps = [b - a for a, b in itertools.pairwise(sent)]
    assert gaps, sent
    # (the probe's own measure of its cost is at least the sleep)
    assert all(gap >= PROBE_COST_FACTOR * cost for gap in gaps), gaps
    assert len(sent) <= 1.5 / (PROBE_COST_FACTOR * cost) + 1, sent
