"""The claim / lease / complete / reconcile protocol as a Hypothesis state machine.

Every rule runs the real statements of :mod:`outbox.storage.sql.queue`, through the
deliverers' own :class:`~outbox.storage.async_store.AsyncStore` (claim,
heartbeat, complete) and :func:`outbox.delivery.reconcile.reconcile`, against the real
database (rows are read and leases expired with the sync engine). The
machine keeps the tickets each owner holds (effect, attempt) and checks,
after every step:

- at most one live holder per effect: an ``in_flight`` row is held by exactly
  one outstanding ticket (its owner and attempt), and no (effect, attempt) was
  ever handed out twice;
- a completion for a stale attempt never changes the row (it is logged
  ``stale``), and a fresh one sets exactly what it reported;
- terminal rows never change status; attempt numbers never decrease;
- every effect is in a known, self-consistent state (a lease only while in
  flight, a completion time once terminal) and its log never runs ahead of it.

Each example starts from empty tables (TRUNCATE).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar
from uuid import UUID

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import Engine, select, text

from deliverers.testing import RecordingDeliverer
from outbox import Outbox
from outbox.delivery.reconcile import reconcile
from outbox.storage.async_store import AsyncStore, Completion
from outbox.storage.engine import make_async_engine
from outbox.storage.schema import EFFECT_STATUSES, effect_attempts, effects
from outbox.storage.sql.queue import EFFECT_QUEUE

IDEMPOTENT, BLIND = "sm.idempotent", "sm.blind"
OWNERS = ("A", "B")
TERMINAL = frozenset({"succeeded", "failed", "cancelled", "compensated"})
LEASE = 30.0  # leases run out only when a rule says so


@dataclass(frozen=True)
class Ticket:
    """What a claim handed to an owner: the right to report on one attempt."""

    effect_id: UUID
    attempt: int
    owner: str


def rows(conn: Any) -> dict[UUID, Any]:
    """Every effect by id, in intent order (so a replayed example draws the same ones)."""
    return {r.id: r for r in conn.execute(select(effects).order_by(effects.c.seq))}


class ProtocolMachine(RuleBasedStateMachine):
    ob: ClassVar[Outbox]
    store: ClassVar[AsyncStore]
    loop: ClassVar[asyncio.AbstractEventLoop]

    def __init__(self) -> None:
        super().__init__()
        self.engine: Engine = self.ob.engine
        with self.engine.begin() as conn:
            conn.execute(
                text("TRUNCATE outbox_effect_attempts, outbox_effects RESTART IDENTITY CASCADE")
            )
        self.tickets: list[Ticket] = []
        self.issued: set[tuple[UUID, int]] = set()
        self.last_attempt: dict[UUID, int] = {}
        self.terminal: dict[UUID, str] = {}
        self.stale_completions = 0
        self.reconciled: list[str] = []

    def run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(coroutine)

    def snapshot(self) -> dict[UUID, Any]:
        with self.engine.connect() as conn:
            return rows(conn)

    @initialize(max_attempts=st.sampled_from([None, 2]))
    def some_effects(self, max_attempts: int | None) -> None:
        self.intend(IDEMPOTENT, 3, max_attempts)
        self.intend(BLIND, 2, max_attempts)

    # -- rules ----------------------------------------------------------------------------

    @rule(
        kind=st.sampled_from([IDEMPOTENT, BLIND]),
        n=st.integers(1, 3),
        max_attempts=st.sampled_from([None, 2]),
    )
    def intend(self, kind: str, n: int, max_attempts: int | None) -> None:
        with self.ob.transaction() as tx:
            for i in range(n):
                tx.intend(kind, {"n": i}, max_attempts=max_attempts)

    @precondition(lambda self: any(r.status == "pending" for r in self.snapshot().values()))
    @rule(owner=st.sampled_from(OWNERS), data=st.data(), limit=st.integers(1, 3))
    def claim_some(self, owner: str, data: st.DataObject, limit: int) -> None:
        kinds = sorted({r.kind for r in self.snapshot().values() if r.status == "pending"})
        self.claim(owner, data.draw(st.sampled_from(kinds), label="kind"), limit)

    def claim(self, owner: str, kind: str, limit: int) -> None:
        before = self.snapshot()
        claimed = self.run(
            self.store.claim_many(
                EFFECT_QUEUE, [({"kind": kind}, limit)], owner=owner, lease_seconds=LEASE
            )
        )
        assert len(claimed) <= limit
        after = self.snapshot()
        for row in claimed:
            was = before[row.id]
            assert was.status == "pending" and was.kind == kind, (was.status, was.kind)
            assert was.available_at <= row.attempt_started_at, "claimed before it was due"
            assert row.attempt == was.attempt + 1, "a claim is a new attempt"
            assert row.lease_owner == owner
            assert (after[row.id].status, after[row.id].lease_owner) == ("in_flight", owner)
            ticket = Ticket(row.id, row.attempt, owner)
            assert (ticket.effect_id, ticket.attempt) not in self.issued, "handed out twice"
            self.issued.add((ticket.effect_id, ticket.attempt))
            self.tickets.append(ticket)

    @precondition(lambda self: any(r.status == "in_flight" for r in self.snapshot().values()))
    @rule(data=st.data())
    def let_a_lease_expire(self, data: st.DataObject) -> None:
        in_flight = [i for i, r in self.snapshot().items() if r.status == "in_flight"]
        self.expire(data.draw(st.sampled_from(in_flight), label="expire"))

    @precondition(lambda self: any(r.status == "in_flight" for r in self.snapshot().values()))
    @rule(data=st.data())
    def a_holder_stalls_and_the_other_takes_over(self, data: st.DataObject) -> None:
        """Its lease runs out, a reconciler puts the effect back, the other owner claims."""
        current = self.snapshot()
        in_flight = [i for i, r in current.items() if r.status == "in_flight"]
        victim = data.draw(st.sampled_from(in_flight), label="stalls")
        self.expire(victim)
        self.reconcile()
        other = next(o for o in OWNERS if o != current[victim].lease_owner)
        self.claim(other, current[victim].kind, 3)

    def expire(self, victim: UUID) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                text(
                    "UPDATE outbox_effects SET lease_expires_at = now() - interval '1 second'"
                    " WHERE id = :id"
                ),
                {"id": victim},
            )

    @rule(owner=st.sampled_from(OWNERS))
    def heartbeat(self, owner: str) -> None:
        held = [(t.effect_id, t.attempt) for t in self.tickets if t.owner == owner]
        if not held:
            return
        before = self.snapshot()
        kept = self.run(self.store.extend(EFFECT_QUEUE, held, owner=owner, lease_seconds=LEASE))
        after = self.snapshot()
        for effect_id in {effect_id for effect_id, _ in held}:
            was = before[effect_id]
            # one of this owner's tickets for it may be live (an older one is not)
            live = was.status == "in_flight" and was.lease_owner == owner
            live = live and (effect_id, was.attempt) in held
            assert (effect_id in kept) == live, (was.status, was.lease_owner, was.attempt)
            if not live:
                assert after[effect_id] == was, "a lost lease was extended"

    @precondition(lambda self: self.tickets)
    @rule(
        data=st.data(),
        status=st.sampled_from(["succeeded", "pending", "failed", "unknown"]),
    )
    def complete(self, data: st.DataObject, status: str) -> None:
        self.complete_ticket(data.draw(st.sampled_from(self.tickets), label="ticket"), status)

    def complete_ticket(self, ticket: Ticket, status: str) -> bool:
        """Report ``status`` for ``ticket``; True when it was fresh (changed the row)."""
        self.tickets.remove(ticket)
        outcome = {"succeeded": "succeeded", "pending": "retry"}.get(status, status)
        completion = Completion(
            ticket.effect_id,
            ticket.attempt,
            status,
            outcome,
            result_json=json.dumps({"by": ticket.owner}) if status == "succeeded" else None,
            error=None if status == "succeeded" else f"{outcome} by {ticket.owner}",
            delay=0.0,
        )
        was = self.snapshot()[ticket.effect_id]
        logged = self.run(self.store.complete(ticket.owner, [completion]))
        now = self.snapshot()[ticket.effect_id]
        holds = was.attempt == ticket.attempt and (
            (was.status == "in_flight" and was.lease_owner == ticket.owner)
            or was.status in ("unknown", "pending")
        )
        if holds:
            assert [tuple(r) for r in logged] == [(ticket.effect_id, outcome)]
            assert (now.status, now.attempt, now.lease_owner) == (status, ticket.attempt, None)
            if status == "succeeded":
                assert now.result == {"by": ticket.owner}
        else:
            assert [tuple(r) for r in logged] == [(ticket.effect_id, "stale")]
            assert now == was, "a stale completion changed the row"
            self.stale_completions += 1
        return holds

    @rule()
    def reconcile(self) -> None:
        before = self.snapshot()
        deliverers = {
            IDEMPOTENT: RecordingDeliverer(IDEMPOTENT, idempotent=True),
            BLIND: RecordingDeliverer(BLIND, idempotent=False),
        }

        report = self.run(reconcile(self.store, deliverers, worker="sm-reconciler"))
        after = self.snapshot()
        self.reconciled = [item.action for item in report.items]
        touched = {item.effect_id for item in report.items}
        for effect_id, was in before.items():
            now = after[effect_id]
            if effect_id not in touched:
                assert now == was, "reconcile changed a row it did not report"
                continue
            item = next(i for i in report.items if i.effect_id == effect_id)
            assert was.status == "in_flight" and item.attempt == was.attempt == now.attempt
            limit = was.max_attempts or 10
            if was.kind == BLIND:
                expected = "unknown"
            else:
                expected = "failed" if was.attempt >= limit else "pending"
            assert (now.status, now.lease_owner) == (expected, None), item

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def the_protocol_holds(self) -> None:
        with self.engine.connect() as conn:
            current = rows(conn)
            log = conn.execute(select(effect_attempts.c.effect_id, effect_attempts.c.attempt))
            log_rows = log.all()
        for effect_id, row in current.items():
            assert row.status in EFFECT_STATUSES, row.status
            # a known, self-consistent state
            if row.status == "in_flight":
                assert row.lease_owner is not None and row.lease_expires_at is not None
                holders = [
                    t
                    for t in self.tickets
                    if (t.effect_id, t.attempt, t.owner)
                    == (effect_id, row.attempt, row.lease_owner)
                ]
                assert len(holders) == 1, f"in flight without exactly one live holder: {holders}"
            else:
                assert row.lease_owner is None, (row.status, row.lease_owner)
            if row.status in TERMINAL:
                assert row.completed_at is not None
            # attempt numbers never decrease
            assert row.attempt >= self.last_attempt.get(effect_id, 0), "attempt went back"
            self.last_attempt[effect_id] = row.attempt
            # terminal rows never change status
            if effect_id in self.terminal:
                assert row.status == self.terminal[effect_id], (self.terminal[effect_id], row)
            elif row.status in TERMINAL:
                self.terminal[effect_id] = row.status
        for effect_id, attempt in log_rows:
            assert attempt <= current[effect_id].attempt, "the log ran ahead of its row"
        # no (effect, attempt) is held by two tickets
        assert len({(t.effect_id, t.attempt) for t in self.tickets}) == len(self.tickets)


@pytest.fixture
def machine(dsn: str) -> Iterator[type[ProtocolMachine]]:
    """The machine's class, wired to this test's database, one event loop and one store."""
    loop = asyncio.new_event_loop()
    ProtocolMachine.ob = Outbox.connect(dsn)
    ProtocolMachine.loop = loop
    ProtocolMachine.store = AsyncStore(make_async_engine(dsn, pool_size=2))
    try:
        yield ProtocolMachine
    finally:
        loop.run_until_complete(ProtocolMachine.store.dispose())
        loop.close()
        ProtocolMachine.ob.close()


def test_claim_lease_complete_reconcile_protocol(machine: type[ProtocolMachine]) -> None:
    """Expected: no sequence of claims, expiries, heartbeats, (stale) completions and
    reconciles breaks the invariants above."""
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=30,
            stateful_step_count=40,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


def test_the_takeover_path_step_by_step(machine: type[ProtocolMachine]) -> None:
    """Expected: the path the machine must be able to reach, spelled out once: A holds an
    attempt, stalls past its lease, the reconciler puts the effect back, B claims it
    (attempt 2) and succeeds; A's late report for attempt 1 is stale and changes nothing."""
    m = machine()
    m.intend(IDEMPOTENT, 1, None)
    m.claim("A", IDEMPOTENT, 1)
    m.the_protocol_holds()
    (a,) = m.tickets
    m.expire(a.effect_id)
    m.heartbeat("B")  # B holds nothing: a no-op
    m.reconcile()
    assert m.reconciled == ["redeliver"]
    m.the_protocol_holds()
    m.claim("B", IDEMPOTENT, 1)
    b = m.tickets[-1]
    assert (b.effect_id, b.attempt) == (a.effect_id, 2)
    m.heartbeat("A")  # A's lease is lost: not extended
    m.the_protocol_holds()
    assert m.complete_ticket(b, "succeeded") is True
    assert m.complete_ticket(a, "failed") is False
    m.the_protocol_holds()
    assert m.stale_completions == 1
    assert (m.snapshot()[a.effect_id].status, m.terminal) == (
        "succeeded",
        {a.effect_id: "succeeded"},
    )
    m.teardown()
