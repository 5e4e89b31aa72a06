"""An effect held back by its ordering key says what holds it (issue 11, L9).

Order per key spans kinds (a compensation shares its original's key), so an
undeliverable kind, an ``unknown`` effect or a long retry delay at the head of
a key holds every later effect of that key. The order is kept; what changes is
that the held effects' ``last_error`` names the effect holding them and its
state, written by the maintenance round, never by a claim.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import psycopg

from deliverers.testing import RecordingDeliverer
from outbox import Outbox
from outbox.delivery import Delivery, Outcome, Retry, Succeeded, Unknown
from outbox.shards import shard_of
from outbox.storage.async_store import AsyncStore
from outbox.storage.engine import make_async_engine
from tests.support import DaemonThread, wait_for

HOLD = re.compile(
    r"waiting behind effect (?P<id>[0-9a-f-]{36}) \(kind (?P<kind>[^,]+), (?P<state>[a-z_]+)"
    r"(?P<rest>.*)\): effects sharing an ordering_key are delivered one at a time, "
    r"in intent order"
)

FAST_NOTES: dict[str, Any] = {"reconcile_seconds": 0.1, "blocked_note_grace_seconds": 0}


def intend(ob: Outbox, *effects: tuple[str, str | None]) -> list[Any]:
    """Intend (kind, ordering key) pairs in order; return the effects."""
    run = ob.start_run("agent", "1")
    made: list[Any] = []

    def step(tx: Any) -> None:
        for n, (kind, key) in enumerate(effects):
            made.append(tx.intend(kind, {"n": n}, ordering_key=key))

    run.transaction("s", step)
    return made


def note(ob: Outbox, effect: Any) -> re.Match[str] | None:
    return HOLD.fullmatch(ob.effect(effect.id).last_error or "")


def test_an_undeliverable_kind_holds_its_key_and_the_held_effects_say_so(
    ob: Outbox, dsn: str
) -> None:
    head, held, other = intend(ob, ("crm.update", "acct-1"), ("k.o", "acct-1"), ("k.o", "acct-2"))
    recorder = RecordingDeliverer("k.o")
    with DaemonThread(dsn, {"k.o": recorder}, unknown_kind_grace_seconds=0, **FAST_NOTES):
        wait_for(lambda: note(ob, held), timeout=20, message="a note on the held effect")
        # The note can be written while the other key's delivery is still being recorded.
        wait_for(
            lambda: ob.effect(other.id).status.value == "succeeded",
            timeout=20,
            message="another key is not held",
        )
    found = note(ob, held)
    assert found is not None
    assert (found["id"], found["kind"], found["state"]) == (str(head.id), "crm.update", "pending")
    assert found["rest"] == ": no deliverer is registered for kind crm.update"
    assert ob.effect(held.id).status.value == "pending" and ob.effect(held.id).attempt == 0
    assert [d.effect_id for d in recorder.deliveries] == [other.id], "order across kinds kept"

    # A deploy that knows the kind: the head goes, then the held effect, note gone.
    both = {"k.o": RecordingDeliverer("k.o"), "crm.update": RecordingDeliverer("crm.update")}
    with DaemonThread(dsn, both):
        wait_for(lambda: ob.effect(held.id).status.value == "succeeded", timeout=20)
    assert ob.effect(held.id).last_error is None


def test_a_head_in_another_run_on_another_shard_is_named_too(ob: Outbox, dsn: str) -> None:
    (head,) = intend(ob, ("crm.update", "acct-9"))
    while True:  # a second run, on another logical shard than the first
        (held,) = intend(ob, ("k.o", "acct-9"))
        if shard_of(held.run_id) != shard_of(head.run_id):
            break
        ob.cancel(held.run_id, "same shard: try another")
    with DaemonThread(dsn, {"k.o": RecordingDeliverer("k.o")}, **FAST_NOTES):
        wait_for(lambda: note(ob, held), timeout=20, message="a note on the held effect")
    found = note(ob, held)
    assert found is not None and found["id"] == str(head.id)


def test_an_unknown_effect_holds_its_key_until_an_operator_resolves_it(
    ob: Outbox, dsn: str
) -> None:
    head, held = intend(ob, ("k.blind", "order-9"), ("k.blind", "order-9"))

    def first_is_ambiguous(delivery: Delivery) -> Outcome:
        if delivery.effect_id == head.id:
            return Unknown("timed out after the request was sent")
        return Succeeded()

    blind = RecordingDeliverer("k.blind", idempotent=False, outcome=first_is_ambiguous)
    with DaemonThread(dsn, {"k.blind": blind}, **FAST_NOTES):
        wait_for(lambda: ob.effect(head.id).status.value == "unknown", timeout=20)
    with DaemonThread(dsn, {"k.blind": blind}, **FAST_NOTES):
        # The first daemon may have noted the head while it was still in flight: the
        # note follows the head's state, so wait for the one that names `unknown`.
        wait_for(
            lambda: (found := note(ob, held)) is not None and found["state"] == "unknown",
            timeout=20,
            message="a note on the held effect naming the unknown head",
        )
        found = note(ob, held)
        assert found is not None
        assert (found["id"], found["state"]) == (str(head.id), "unknown")
        assert found["rest"] == ": timed out after the request was sent"
        ob.resolve_effect(head.id, outcome="failed", note="checked by hand", operator="ops")
        wait_for(lambda: ob.effect(held.id).status.value == "succeeded", timeout=20)
    assert [d.effect_id for d in blind.deliveries] == [head.id, held.id]


def test_a_long_retry_delay_holds_its_key_and_the_note_says_until_when(
    ob: Outbox, dsn: str
) -> None:
    head, held = intend(ob, ("k.o", "acct-7"), ("k.o", "acct-7"))

    def busy(delivery: Delivery) -> Outcome:
        return Retry("HTTP 503", after=3600) if delivery.effect_id == head.id else Succeeded()

    recorder = RecordingDeliverer("k.o", outcome=busy)
    with DaemonThread(dsn, {"k.o": recorder}, **FAST_NOTES):
        wait_for(lambda: recorder.deliveries, message="the first attempt")
    with DaemonThread(dsn, {"k.o": recorder}, **FAST_NOTES):
        # As above: a note written while the head was in flight is followed by this one;
        # so is one written before its first attempt (pending too, with no retry to name).
        wait_for(
            lambda: (
                (found := note(ob, held)) is not None
                and found["state"] == "pending"
                and found["rest"] != ""
            ),
            timeout=20,
            message="a note on the held effect naming the waiting head's retry",
        )
    found = note(ob, held)
    assert found is not None and found["state"] == "pending"
    assert re.fullmatch(
        r", next attempt at \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ: HTTP 503", found["rest"]
    )
    assert len(recorder.deliveries) == 1, "the held effect was never called"


def test_a_note_is_cleared_when_the_block_is_gone(ob: Outbox, dsn: str) -> None:
    head, held = intend(ob, ("nobody.a", "k"), ("nobody.b", "k"))

    async def round_() -> int:
        store = AsyncStore(make_async_engine(dsn))
        try:
            return await store.note_blocked_by_order(grace_seconds=0)
        finally:
            await store.dispose()

    assert asyncio.run(round_()) == 1
    assert note(ob, held) is not None and note(ob, head) is None
    assert asyncio.run(round_()) == 0, "an unchanged note is not written again"
    with psycopg.connect(dsn, autocommit=True) as conn:  # the head ends (as an operator would)
        conn.execute("UPDATE outbox_effects SET status = 'cancelled' WHERE id = %s", (head.id,))
    assert asyncio.run(round_()) == 1
    assert ob.effect(held.id).last_error is None
