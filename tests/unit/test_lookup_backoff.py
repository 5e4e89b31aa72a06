"""The reconciler's pause between questions to a sink that could not answer."""

from __future__ import annotations

import time
import uuid

import pytest

from outbox.delivery.reconcile import LookupBackoff


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(time, "monotonic", fake)  # the clock reconcile reads
    return fake


def test_each_failure_doubles_the_pause_up_to_the_ceiling(clock: Clock) -> None:
    lookups, effect = LookupBackoff(floor=1.0, ceiling=10.0), uuid.uuid4()
    assert lookups.due(effect), "a sink never asked may be asked"
    assert [lookups.failed(effect) for _ in range(6)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    clock.now += 9.9
    assert not lookups.due(effect)
    clock.now += 0.1
    assert lookups.due(effect)


def test_a_thousand_failures_do_not_overflow(clock: Clock) -> None:
    lookups, effect = LookupBackoff(floor=1.0, ceiling=300.0), uuid.uuid4()
    for _ in range(1000):
        pause = lookups.failed(effect)
    assert pause == 300.0


def test_forget_drops_effects_settled_elsewhere(clock: Clock) -> None:
    lookups = LookupBackoff()
    kept, settled = uuid.uuid4(), uuid.uuid4()
    lookups.failed(kept)
    lookups.failed(settled)
    lookups.forget(keep={kept})
    assert not lookups.due(kept) and lookups.due(settled)
    lookups.forget()
    assert lookups.due(kept)
