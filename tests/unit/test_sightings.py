"""When an owner whose session lock is free counts as gone (deliverers' and relays' reconcilers)."""

from __future__ import annotations

from outbox.delivery.liveness import FORGET_EVERY, Sightings


def test_an_owner_is_gone_once_seen_so_grace_apart_and_a_blink_starts_afresh() -> None:
    sightings = Sightings(grace=0.4)
    assert sightings.seen(["a", "b"], now=10.0) == set(), "not at the first sighting"
    assert sightings.seen(["a", "b"], now=10.3) == set()
    assert sightings.seen(["a"], now=10.5) == {"a"}, "b's lock was held again"
    assert sightings.seen(["a", "b"], now=10.6) == {"a"}, "b starts afresh"
    assert sightings.seen(["a", "b"], now=11.0) == {"a", "b"}


def test_gone_owners_are_forgotten_at_most_every_forget_interval() -> None:
    sightings = Sightings(grace=0.0)
    assert sightings.forget_due(FORGET_EVERY)
    assert not sightings.forget_due(FORGET_EVERY + 1)
    assert sightings.forget_due(2 * FORGET_EVERY)
