"""A claim's lease is counted from when the claim was sent, not from its answer.

A batch transaction records outcomes and claims the next effects; their leases
run from its start. Kept waiting on a row lock longer than a lease, it claimed
effects whose leases had already run out: the daemon called them, while the
reconciler took them over, asked the sink ("not applied": the call was still
under way) and sent them again, so a sink that cannot dedup charged twice (G2).
"""

from __future__ import annotations

import threading
import time
from collections import Counter

from sqlalchemy import text

from deliverers.testing import RecordingDeliverer
from outbox import EffectStatus, Outbox
from outbox.delivery import Deliverer, DelivererConfig, Delivery, NotApplied, Outcome, Succeeded
from outbox.storage.engine import make_engine
from tests.support import DaemonThread, wait_for

LEASE = 2.0


class Charge(Deliverer):
    """A sink that cannot dedup but can be asked; the first call's row is held meanwhile."""

    def __init__(self, dsn: str) -> None:
        super().__init__("k.charge", DelivererConfig(idempotent=False))
        self.dsn = dsn
        self.applied: list[str] = []
        self.lock = threading.Lock()

    def deliver(self, delivery: Delivery) -> Outcome:
        if delivery.payload["n"] == 1:
            # someone holds the row its answer must change (a pause or a cancel may)
            taken = threading.Event()
            threading.Thread(target=self._hold, args=(delivery, taken), daemon=True).start()
            taken.wait(10)
        else:
            time.sleep(1.5)
        with self.lock:
            self.applied.append(delivery.idempotency_key)
        return Succeeded({"charged": delivery.payload["n"]})

    def _hold(self, delivery: Delivery, taken: threading.Event) -> None:
        engine = make_engine(self.dsn)
        try:
            with engine.begin() as conn:
                conn.execute(
                    text("SELECT 1 FROM outbox_effects WHERE id = :id FOR UPDATE"),
                    {"id": delivery.effect_id},
                )
                taken.set()
                time.sleep(LEASE + 1.5)
        finally:
            engine.dispose()

    def lookup(self, delivery: Delivery) -> Succeeded | NotApplied:
        with self.lock:
            return Succeeded({}) if delivery.idempotency_key in self.applied else NotApplied()


def test_a_claim_answered_after_its_lease_ran_out_is_not_called(ob: Outbox, dsn: str) -> None:
    with ob.transaction() as tx:
        for n in (1, 2, 3):
            tx.intend("k.charge", {"n": n}, key=f"charge-{n}")
    sink = Charge(dsn)
    with DaemonThread(
        dsn,
        {"k.charge": sink},
        concurrency=2,
        batch_size=1,
        lease_seconds=LEASE,
        reconcile_seconds=0.2,
        poll_seconds=0.1,
    ):
        wait_for(lambda: len(ob.effects(status="succeeded")) == 3, timeout=40)
    twice = {k: n for k, n in Counter(sink.applied).items() if n > 1}
    assert twice == {}, "a sink that cannot dedup charged once per effect"


def test_an_idle_wait_before_a_claim_does_not_count_against_its_lease(ob: Outbox, dsn: str) -> None:
    # the poll backoff (up to poll_seconds, here longer than a lease) comes before
    # the claim: counted in, the attempt was given back unstarted, then redone
    sink = RecordingDeliverer("k")
    with DaemonThread(dsn, {"k": sink}, lease_seconds=1.0, poll_seconds=2.0):
        time.sleep(2.5)  # idle: the backoff reaches its ceiling
        with ob.transaction() as tx:  # due later: no NOTIFY wakes the claim when it is
            tx.intend("k", {"n": 1}, delay_seconds=0.5, max_attempts=1)
        wait_for(lambda: ob.effects()[0].status == EffectStatus.SUCCEEDED, timeout=30)
    (effect,) = ob.effects()
    assert [a.outcome for a in ob.store.attempts(effect.id)] == ["succeeded"]
