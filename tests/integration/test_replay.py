"""G5: recorded steps replay without running again; keys are stable; conflicts are refused."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from sqlalchemy import func, select

from outbox import IdempotencyConflict, Outbox, StepTransaction, derive_key
from outbox.shards import on_shard, shard_of
from outbox.storage.schema import effects, steps


def test_call_records_once_and_replays_without_calling(ob: Outbox) -> None:
    run = ob.start_run("invoice-reconciler", "2.3.1", {"month": "2026-10"})
    calls: list[str] = []

    def fetch_invoices(month: str) -> list[dict[str, object]]:
        calls.append(month)
        return [{"id": "INV-1", "amount": 120.5}]

    first = run.call("fetch-invoices", fetch_invoices, "2026-10")
    assert run.call("fetch-invoices", fetch_invoices, "2026-10") == first
    assert ob.run(run.id).call("fetch-invoices", fetch_invoices, "2026-10") == first
    assert calls == ["2026-10"]


def test_a_call_that_raises_records_nothing(ob: Outbox) -> None:
    run = ob.start_run("invoice-reconciler", "2.3.1")

    def down() -> None:
        raise ConnectionError("tool down")

    with pytest.raises(ConnectionError):
        run.call("fetch", down)
    assert ob.run(run.id).completed_steps == []
    assert run.call("fetch", lambda: 42) == 42


def test_transaction_replays_recorded_result_without_running_fn(ob: Outbox) -> None:
    run = ob.start_run("invoice-reconciler", "2.3.1")
    runs_of_fn: list[int] = []

    def step(tx: StepTransaction) -> dict[str, str]:
        runs_of_fn.append(1)
        effect = tx.intend("email.send", {"to": "ap@example.com"})
        return {"key": effect.idempotency_key}

    first = run.transaction("send-summary", step)
    resumed = ob.run(run.id)
    assert resumed.transaction("send-summary", step) == first
    assert runs_of_fn == [1]
    assert len(resumed.effects()) == 1
    assert first["key"] == derive_key(run.id, "send-summary", 0)


def test_stale_handle_replays_what_another_process_recorded(ob: Outbox) -> None:
    run = ob.start_run("invoice-reconciler", "2.3.1")
    stale = ob.run(run.id)  # loaded before the step was recorded
    run.transaction("send", lambda tx: tx.intend("email.send", {"n": 1}) and "first")
    ran: list[int] = []

    def again(tx: StepTransaction) -> str:
        ran.append(1)
        tx.intend("email.send", {"n": 2})
        return "second"

    # fn runs (the stale handle cannot know), but its whole transaction is
    # rolled back and the recorded result is returned.
    assert stale.transaction("send", again) == "first"
    assert len(ob.effects(run_id=run.id)) == 1
    assert ob.effects(run_id=run.id)[0].payload == {"n": 1}


def test_caller_key_reused_with_same_payload_returns_the_existing_intent(ob: Outbox) -> None:
    run = ob.start_run("billing", "1")
    first = run.transaction(
        "charge", lambda tx: str(tx.intend("payment.charge", {"cents": 500}, key="invoice-42").id)
    )
    again = run.transaction(
        "charge-again",
        lambda tx: str(tx.intend("payment.charge", {"cents": 500}, key="invoice-42").id),
    )
    assert first == again
    assert len(ob.effects()) == 1


def test_caller_key_reused_with_other_payload_is_a_conflict_naming_the_key(ob: Outbox) -> None:
    run_a = ob.start_run("billing", "1")
    run_b = ob.start_run("billing", "1")
    run_a.transaction(
        "charge", lambda tx: tx.intend("payment.charge", {"cents": 500}, key="invoice-42") and None
    )
    with pytest.raises(IdempotencyConflict, match="invoice-42") as info:
        run_b.transaction(
            "charge", lambda tx: tx.intend("payment.charge", {"cents": 999}, key="invoice-42")
        )
    assert info.value.key == "invoice-42"
    assert ob.run(run_b.id).completed_steps == [], "the conflicting step wrote nothing"


@pytest.mark.parametrize("other", ["kind", "run", "no run"])
def test_caller_key_reused_with_same_payload_by_another_kind_or_owner_is_a_conflict(
    ob: Outbox, other: str
) -> None:
    # M3: the key names one intent; the same payload under another kind or owner
    # used to return the existing effect silently, and the new intent was never written.
    run = ob.start_run("billing", "1")
    run.transaction(
        "charge", lambda tx: tx.intend("payment.charge", {"cents": 500}, key="invoice-42") and None
    )
    kind = "payment.refund" if other == "kind" else "payment.charge"
    with pytest.raises(IdempotencyConflict, match="invoice-42") as info:
        if other == "no run":
            with ob.transaction() as tx:
                tx.intend(kind, {"cents": 500}, key="invoice-42")
        else:
            owner = run if other == "kind" else ob.start_run("billing", "1")
            owner.transaction("again", lambda tx: tx.intend(kind, {"cents": 500}, key="invoice-42"))
    assert info.value.key == "invoice-42"
    assert len(ob.effects()) == 1
    assert ob.effects()[0].run_id == run.id


def test_same_key_twice_in_one_step_with_another_kind_is_a_conflict(ob: Outbox) -> None:
    run = ob.start_run("billing", "1")

    def twice(tx: StepTransaction) -> None:
        tx.intend("payment.charge", {"cents": 5}, key="k-1")
        tx.intend("payment.refund", {"cents": 5}, key="k-1")

    with pytest.raises(IdempotencyConflict, match="k-1"):
        run.transaction("s", twice)
    assert ob.effects() == []


def test_run_less_transactions_share_a_caller_key(ob: Outbox) -> None:
    with ob.transaction() as tx:
        first = tx.intend("email.send", {"to": "a"}, key="order-7-confirmation")
    with ob.transaction() as tx:
        again = tx.intend("email.send", {"to": "a"}, key="order-7-confirmation")
    assert first.id == again.id
    assert len(ob.effects()) == 1


def test_same_key_twice_in_one_step_with_other_payload_is_a_conflict(ob: Outbox) -> None:
    run = ob.start_run("billing", "1")

    def twice(tx: StepTransaction) -> None:
        tx.intend("payment.charge", {"cents": 1}, key="k")
        tx.intend("payment.charge", {"cents": 2}, key="k")

    with pytest.raises(IdempotencyConflict):
        run.transaction("s", twice)


def test_keys_are_unique_in_the_table(ob: Outbox) -> None:
    run = ob.start_run("billing", "1")
    run.transaction("s", lambda tx: [tx.intend("k.x", {"i": i}) for i in range(3)] and None)
    with (
        ob.engine.begin() as conn,
        pytest.raises(Exception, match="outbox_effects_idempotency_key"),
    ):
        key = conn.execute(select(effects.c.idempotency_key).limit(1)).scalar_one()
        conn.execute(
            effects.insert().values(
                id=__import__("uuid").uuid4(),
                run_id=run.id,
                shard=shard_of(run.id),
                kind="k.x",
                payload={},
                payload_hash="h",
                idempotency_key=key,
                status="pending",
            )
        )


RACER = textwrap.dedent(
    """
    import sys, time
    from outbox import Outbox
    run_id, step_id, label, go_at = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    ob = Outbox.connect()
    run = ob.run(run_id)

    def step(tx):
        tx.intend("email.send", {"to": "ap@example.com"})
        tx.intend("payment.charge", {"cents": 500}, key="race-" + run_id)
        time.sleep(0.5)  # both transactions are open at once
        return label

    while time.time() < go_at:
        time.sleep(0.001)
    print(run.transaction(step_id, step))
    ob.close()
    """
)


def test_two_processes_racing_on_one_step_make_one_set_of_rows(
    ob: Outbox, sub_env: dict[str, str], tmp_path: Path
) -> None:
    import time

    run = ob.start_run("invoice-reconciler", "2.3.1")
    script = tmp_path / "racer.py"
    script.write_text(RACER)
    go_at = time.time() + 2.0
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(run.id), "send", label, str(go_at)],
            env=sub_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for label in ("A", "B")
    ]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        outputs.append(out.strip())
    assert outputs[0] == outputs[1] and outputs[0] in ("A", "B"), "both return the winner's result"
    with ob.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(steps)).scalar_one() == 1
        assert conn.execute(select(func.count()).select_from(effects)).scalar_one() == 2


def test_a_derived_key_another_row_holds_is_a_conflict_and_the_step_writes_nothing(
    ob: Outbox,
) -> None:
    # The step's intents are plain inserts (no ON CONFLICT): a key already taken
    # (here by a run-less row written beside the client) fails the checkpoint whole.
    run = ob.start_run("keys", "1")
    key = derive_key(run.id, "s", 0)
    with ob.engine.begin() as conn:
        conn.execute(
            effects.insert().values(
                # of no run, on the run's shard (where the key is unique)
                id=on_shard(uuid.uuid4(), shard_of(run.id)),
                shard=shard_of(run.id),
                kind="k.other",
                payload={},
                payload_hash="0" * 64,
                idempotency_key=key,
                status="pending",
            )
        )
    with pytest.raises(IdempotencyConflict, match=key) as info:
        run.transaction("s", lambda tx: tx.intend("k.mine", {"n": 1}))
    assert "intended concurrently" in str(info.value)
    assert ob.run(run.id).completed_steps == []
    with ob.engine.connect() as conn:
        assert conn.scalar(select(func.count()).select_from(steps)) == 0
        assert conn.scalar(select(func.count()).where(effects.c.kind == "k.mine")) == 0


def test_a_step_another_handle_recorded_meanwhile_is_adopted_not_run_twice(
    ob: Outbox,
) -> None:
    run = ob.start_run("race", "1")
    stale = ob.run(run.id)  # loaded before the step exists
    assert run.transaction("s", lambda tx: (tx.intend("k.a", {"n": 1}), "first")[1]) == "first"
    # The stale handle runs its function, then its insert meets the recorded step:
    # its transaction rolls back whole and it returns what was recorded (G5).
    assert stale.transaction("s", lambda tx: (tx.intend("k.a", {"n": 2}), "second")[1]) == "first"
    assert stale.last_replayed
    with ob.engine.connect() as conn:
        assert conn.scalar(select(func.count()).where(effects.c.kind == "k.a")) == 1
