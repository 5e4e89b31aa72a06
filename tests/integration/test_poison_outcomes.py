"""A poison outcome costs one effect, never the deliverer (issue 11, C1), against a real PostgreSQL.

What a deliverer returns is made storable (escaped, finite, capped); a
completion PostgreSQL still refuses (here: a trigger the role may not run, a
value that slipped past) is isolated to its row while the rest of the batch is
recorded; a role that can record nothing makes the daemon pause and let leases
run out instead of spinning and heartbeating for ever; stopping keeps to the
grace period. The real subprocess versions are in tests/chaos/test_poison_outcomes.py.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg

from deliverers.python_call import PythonCallConfig, PythonCallDeliverer
from deliverers.testing import RecordingDeliverer
from outbox import Outbox
from outbox.delivery import Deliverer, Succeeded
from outbox.delivery.recording import OutcomeWriter
from outbox.models import AttemptOutcome, EffectStatus
from outbox.storage.async_store import AsyncStore, Completion
from outbox.storage.engine import make_async_engine
from outbox.storage.sql.queue import EFFECT_QUEUE
from tests.support import DaemonThread, as_superuser, limited_role, wait_for


def intend(ob: Outbox, kinds: list[str], **options: Any) -> None:
    run = ob.start_run("agent", "1")

    def step(tx: Any) -> None:
        for i, kind in enumerate(kinds):
            tx.intend(kind, {"n": i}, **options.get(kind, {}))

    run.transaction("s", step)


def by_kind(ob: Outbox) -> dict[str, list[str]]:
    seen: dict[str, list[str]] = {}
    for effect in ob.effects(limit=1000):
        seen.setdefault(effect.kind, []).append(effect.status.value)
    return {kind: sorted(states) for kind, states in seen.items()}


def fn(kind: str, function: str, **config: Any) -> PythonCallDeliverer:
    return PythonCallDeliverer(
        kind, PythonCallConfig(function=f"tests.fixtures_callables:{function}", **config)
    )


def test_python_call_errors_with_a_nul_or_an_infinite_retry_after_cost_one_effect_each(
    ob: Outbox, dsn: str
) -> None:
    deliverers: dict[str, Deliverer] = {
        "fn.nul": fn("fn.nul", "raises_nul", max_attempts=1),
        "fn.forever": fn("fn.forever", "retry_forever", max_attempts=1),
        "fn.odd": fn("fn.odd", "odd_result"),
        "fn.echo": fn("fn.echo", "echo"),
    }
    intend(ob, ["fn.nul", "fn.forever", "fn.odd"] + ["fn.echo"] * 10)
    with DaemonThread(dsn, deliverers, batch_size=50, poll_seconds=0.1) as daemon:
        wait_for(
            lambda: (
                by_kind(ob)
                == {
                    "fn.nul": ["failed"],
                    "fn.forever": ["failed"],
                    "fn.odd": ["succeeded"],
                    "fn.echo": ["succeeded"] * 10,
                }
            ),
            timeout=20,
            message="every effect recorded",
        )
        started = time.monotonic()
        daemon.stop(timeout=15)
        assert time.monotonic() - started < 5
    effects = {e.kind: e for e in ob.effects(limit=100)}
    assert effects["fn.nul"].last_error == (
        "gave up after 1 attempts: ValueError: bad\\x00news from \\udcff the sink"
    )
    assert "retry_after=inf: must be a finite number of seconds" in (
        effects["fn.forever"].last_error or ""
    )
    assert effects["fn.odd"].result == {
        "ratio": "nan",
        "big": "inf",
        "text": "a\\x00b",
        "raw": "\\xff\\xfe",
        "nested": {"1": ["x\\x00"]},
    }


def test_a_completion_postgresql_refuses_is_isolated_to_its_row(ob: Outbox, dsn: str) -> None:
    """Values that slipped past the boundary (built by hand here) fail alone, in one write."""
    intend(ob, ["k"] * 8)

    async def scenario() -> tuple[dict[Any, str], dict[Any, str]]:
        store = AsyncStore(make_async_engine(dsn))
        try:
            claimed = await store.claim_many(
                EFFECT_QUEUE, [({"kind": "k"}, 8)], owner="me", lease_seconds=30
            )
            batch = [
                Completion(c.id, c.attempt, EffectStatus.SUCCEEDED, AttemptOutcome.SUCCEEDED)
                for c in claimed
            ]
            # a NUL in a text column, and a non-finite delay: each refused
            batch[2] = Completion(
                claimed[2].id, 1, EffectStatus.FAILED, AttemptOutcome.FAILED, error="a\x00b"
            )
            batch[5] = Completion(
                claimed[5].id, 1, EffectStatus.PENDING, AttemptOutcome.RETRY, delay=float("inf")
            )
            written = await OutcomeWriter(store, "me").write(batch)
            assert not written.left and not written.abandoned
            poisoned = {claimed[2].id: "failed", claimed[5].id: "unknown"}
            return written.substituted, poisoned
        finally:
            await store.dispose()

    substituted, poisoned = asyncio.run(scenario())
    assert set(substituted) == set(poisoned)
    for effect in ob.effects(limit=100):
        if effect.id in poisoned:
            assert effect.status.value == poisoned[effect.id]
            assert "could not be recorded" in (effect.last_error or "")
            [logged] = ob.store.attempts(effect.id)
            assert logged.detail["unrecordable"] == substituted[effect.id]
        else:
            assert effect.status.value == "succeeded"
    assert (
        "untranslatable" in substituted[next(iter(poisoned))]
        or "0000" in (substituted[next(iter(poisoned))])
    )


def test_a_role_that_may_not_settle_costs_loses_only_the_costly_effect(
    ob: Outbox, dsn: str
) -> None:
    """A real row-level failure: the cost trigger needs INSERT on the budget ledger."""
    run = ob.start_run("agent", "1", budget=100)

    def step(tx: Any) -> None:
        for i in range(12):
            tx.intend("k", {"n": i}, cost=5 if i == 6 else None)

    run.transaction("s", step)
    costly = next(e.id for e in ob.effects(limit=100) if e.cost is not None)
    with limited_role(dsn, "INSERT ON outbox_budget_ledger"):
        deliverer = RecordingDeliverer("k")
        with DaemonThread(dsn, {"k": deliverer}, batch_size=50, concurrency=50) as daemon:
            wait_for(
                lambda: sorted(by_kind(ob)["k"]) == ["succeeded"] * 11 + ["unknown"],
                timeout=20,
                message="all but the costly effect succeeded",
            )
            daemon.stop(timeout=15)
    effect = ob.effect(costly)
    assert effect.status.value == "unknown"
    assert "permission denied for table outbox_budget_ledger" in (effect.last_error or "")
    assert "SQLSTATE 42501" in (effect.last_error or "")
    assert "reported succeeded" in (effect.last_error or "")
    assert len(deliverer.deliveries) == 12, "no effect was called twice"


def test_a_role_that_can_record_nothing_pauses_lets_leases_lapse_and_stops_on_time(
    ob: Outbox, dsn: str
) -> None:
    """Completion needs UPDATE on outbox_runs (it wakes awaiting runs): every write fails."""
    intend(ob, ["k"] * 3)
    deliverer = RecordingDeliverer("k")
    with limited_role(dsn, "UPDATE ON outbox_runs"):
        daemon = DaemonThread(
            dsn, {"k": deliverer}, lease_seconds=1.0, reconcile_seconds=0.2, grace_seconds=2.0
        )
        with daemon:

            def expired_by_the_reconciler() -> bool:
                rows = as_superuser(
                    dsn,
                    "SELECT count(DISTINCT effect_id) FROM outbox_effect_attempts "
                    "WHERE outcome = 'expired'",
                )
                return bool(rows[0][0] == 3)

            # Abandoned leases are no longer renewed: the reconciler finds them expired.
            wait_for(expired_by_the_reconciler, timeout=20, message="leases left to lapse")
            time.sleep(3)
            calls = len(deliverer.deliveries)
            started = time.monotonic()
            daemon.stop(timeout=15)
            assert time.monotonic() - started < 4, "stop keeps to the grace period"
    # A kind that cannot record is paused (1 s, 2 s, 4 s, ...): no loop of calls.
    assert calls <= 12, f"{calls} calls in a few seconds: the deliverer spins"
    assert all(e.status.value in ("pending", "in_flight") for e in ob.effects(limit=10))


def test_a_write_that_hangs_at_shutdown_is_given_up_when_the_grace_runs_out(
    ob: Outbox, dsn: str
) -> None:
    """The attempt log is locked (by a migration, say): outcomes cannot be written in time.

    One batch's write is already waiting on the lock when the stop comes, the
    other calls finish after it: both kinds of write end with the grace period.
    """
    intend(ob, ["k"] * 4)
    calls: list[float] = []

    def slow(delivery: Any) -> Any:
        calls.append(time.monotonic())
        time.sleep(0.2 if len(calls) == 1 else 1.5)
        return Succeeded()

    deliverer = RecordingDeliverer("k", outcome=slow)
    daemon = DaemonThread(dsn, {"k": deliverer}, grace_seconds=3.0)
    with psycopg.connect(dsn) as locker, daemon:
        wait_for(lambda: calls, message="the first call")
        locker.execute("LOCK TABLE outbox_effect_attempts IN ACCESS EXCLUSIVE MODE")
        wait_for(lambda: len(calls) == 4, message="every call started")
        time.sleep(0.5)  # the first outcome's write now waits on the lock
        stopping = time.monotonic()
        daemon.stop(timeout=20)
        took = time.monotonic() - stopping
        locker.rollback()
    assert took < 3.0 + 1.5, f"stop took {took:.1f}s with --grace 3"
    # Nothing was lost: the attempts are in flight, for the reconciler once their leases lapse.
    assert {e.status.value for e in ob.effects(limit=10)} <= {"in_flight", "pending"}
