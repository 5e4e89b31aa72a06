"""The contract both clients keep: each body runs against ``Outbox`` and against ``AsyncOutbox``.

Atomic steps (G1), replay (G5), key conflicts, waits and signals (G8), budgets
(G7) and cancellation: one body per rule, in the async client's words, run
against both twins on a real PostgreSQL (see ``twins.py``).
"""

from __future__ import annotations

import threading
import time
import uuid
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import Column, Integer, MetaData, Table, Text, select

from outbox import (
    BudgetExceeded,
    EffectStatus,
    EffectTimeout,
    IdempotencyConflict,
    Outbox,
    PayloadError,
    RunStatus,
    RunTerminal,
    SignalTimeout,
    ValidationError,
)
from tests.contract.twins import Twin

notes = Table(
    "contract_notes",
    MetaData(),
    Column("id", Integer, primary_key=True),
    Column("text", Text, nullable=False),
)


@pytest.fixture(params=["sync", "async"])
def twin(request: pytest.FixtureRequest, dsn: str, ob: Outbox) -> Twin:
    notes.create(ob.engine)
    return Twin(request.param, dsn)


def rows(ob: Outbox) -> list[str]:
    with ob.engine.connect() as conn:
        return list(conn.execute(select(notes.c.text).order_by(notes.c.id)).scalars())


# -- G1: atomic steps -----------------------------------------------------------------


def test_a_step_commits_state_plan_intents_and_caller_rows_together(twin: Twin, ob: Outbox) -> None:
    async def body(client: Any) -> Any:
        run = await client.start_run("contract", "1", {"month": "10"})

        async def step(tx: Any) -> Any:
            await tx.connection.execute(notes.insert().values(text="matched 41"))
            tx.set_state({"cursor": 7})
            tx.set_plan(["match", "send"])
            email = await tx.intend("email.send", {"to": "ap@example.com"})
            return {"key": email.idempotency_key}

        result = await run.transaction("send-summary", step)
        return run.id, result

    run_id, result = twin.run(body)
    loaded = ob.run(run_id)
    (effect,) = loaded.effects()
    assert result == {"key": effect.idempotency_key}
    assert (loaded.state, loaded.plan, loaded.completed_steps) == (
        {"cursor": 7},
        ["match", "send"],
        ["send-summary"],
    )
    assert rows(ob) == ["matched 41"]


def test_a_step_that_raises_writes_nothing(twin: Twin, ob: Outbox) -> None:
    async def body(client: Any) -> Any:
        run = await client.start_run("contract", "1", {})

        async def step(tx: Any) -> None:
            await tx.connection.execute(notes.insert().values(text="never"))
            tx.set_state({"bad": True})
            await tx.intend("email.send", {"to": "x@example.com"})
            await tx.intend("email.send", {"to": "y@example.com"}, key="caller-key-1")
            raise RuntimeError("the model said no")

        with pytest.raises(RuntimeError, match="the model said no"):
            await run.transaction("doomed", step)
        return run.id

    run_id = twin.run(body)
    loaded = ob.run(run_id)
    assert (loaded.state, loaded.completed_steps, loaded.effects(), rows(ob)) == ({}, [], [], [])


def test_plain_transaction_commits_intents_with_caller_rows(twin: Twin, ob: Outbox) -> None:
    async def body(client: Any) -> Any:
        async with client.transaction() as tx:
            await tx.connection.execute(notes.insert().values(text="order 7"))
            effect = await tx.intend("email.send", {"order": 7})
        with pytest.raises(ZeroDivisionError):
            async with client.transaction() as tx:
                await tx.connection.execute(notes.insert().values(text="order 8"))
                await tx.intend("email.send", {"order": 8})
                _ = 1 / 0
        return effect.id

    effect_id = twin.run(body)
    assert rows(ob) == ["order 7"]
    assert [e.id for e in ob.effects()] == [effect_id]


def test_a_json_null_payload_is_stored_as_json_null(twin: Twin, ob: Outbox) -> None:
    # The rules accept null (tests/intent_rule_cases.py) and the SQL API stores
    # 'null'::jsonb; the clients once sent it as SQL NULL and failed at commit.
    async def body(client: Any) -> Any:
        run = await client.start_run("contract", "1")

        async def step(tx: Any) -> Any:
            return str((await tx.intend("email.send", None)).id)

        in_step = uuid.UUID(await run.transaction("s", step))
        async with client.transaction() as tx:
            run_less = await tx.intend("email.send", None)
        return in_step, run_less.id

    ids = twin.run(body)
    stored = {e.id: e for e in ob.effects()}
    assert set(stored) == set(ids)
    assert [stored[i].payload for i in ids] == [None, None]


# -- G5: replay -----------------------------------------------------------------------


def test_call_records_once_and_a_resumed_handle_replays_without_calling(
    twin: Twin, ob: Outbox
) -> None:
    calls: list[str] = []

    def fetch(month: str) -> list[str]:
        calls.append(month)
        return [f"inv-{month}"]

    async def body(client: Any) -> Any:
        run = await client.start_run("contract", "1", {})
        first = await run.call("fetch", fetch, "10")
        again = await run.call("fetch", fetch, "10")
        resumed = await client.run(run.id)
        replayed = await resumed.call("fetch", fetch, "10")
        return first, again, replayed

    assert twin.run(body) == (["inv-10"],) * 3
    assert calls == ["10"]


def test_a_recorded_transaction_replays_its_result_without_running(twin: Twin) -> None:
    ran: list[int] = []

    async def body(client: Any) -> Any:
        run = await client.start_run("contract", "1", {})

        async def step(tx: Any) -> Any:
            ran.append(1)
            return (await tx.intend("k.x", {"n": 1})).idempotency_key

        key = await run.transaction("s", step)
        resumed = await client.run(run.id)
        return key, await resumed.transaction("s", step)

    key, replayed = twin.run(body)
    assert key == replayed and ran == [1]


def test_a_stale_handle_replays_what_another_handle_recorded(twin: Twin, ob: Outbox) -> None:
    async def body(client: Any) -> Any:
        first = await client.start_run("contract", "1", {})
        stale = await client.run(first.id)
        won = await first.transaction("s", lambda tx: "first")

        async def late(tx: Any) -> str:
            await tx.intend("k.x", {"late": True})
            await tx.connection.execute(notes.insert().values(text="late"))
            return "second"

        lost = await stale.transaction("s", late)
        return first.id, won, lost

    run_id, won, lost = twin.run(body)
    assert (won, lost) == ("first", "first")
    assert ob.run(run_id).effects() == [] and rows(ob) == []


def test_a_handle_tells_a_replay_from_a_recording(twin: Twin) -> None:
    async def body(client: Any) -> Any:
        run = await client.start_run("contract", "1", {})
        stale = await client.run(run.id)

        async def step(tx: Any) -> str:
            await tx.intend("k.x", {"n": 1})
            return "r"

        seen = []
        for handle in (run, run, stale):
            await handle.transaction("s", step)
            seen.append(handle.last_replayed)
        return seen

    # Recorded by this handle; replayed by it; recorded by another first (adopted).
    assert twin.run(body) == [False, True, True]


def test_a_handle_for_one_step_reads_only_it_and_still_replays(twin: Twin, ob: Outbox) -> None:
    calls: list[str] = []

    async def body(client: Any) -> Any:
        run = await client.start_run("contract", "1", {})
        for step_id in ("a", "b"):

            async def step(tx: Any, step_id: str = step_id) -> str:
                calls.append(step_id)
                await tx.intend("k.x", {"step": step_id})
                return step_id

            await run.transaction(step_id, step)
        one = await client.run(run.id, step_id="b")
        known = one.completed_steps
        replayed = await one.transaction("b", step)
        # A step it did not load still replays, found when its commit meets it.
        other = await client.run(run.id, step_id="b")
        adopted = await other.transaction("a", step)
        with pytest.raises(ValidationError, match="step_id"):
            await client.run(run.id, step_id="")
        return known, replayed, one.last_replayed, adopted, other.last_replayed, run.id

    known, replayed, was, adopted, too, run_id = twin.run(body)
    assert (known, replayed, was, adopted, too) == (["b"], "b", True, "a", True)
    # The function the second handle ran for "a" (step b's) ran once, rolled back whole.
    assert calls == ["a", "b", "b"]
    assert [e.payload for e in ob.effects(run_id=run_id)] == [{"step": "a"}, {"step": "b"}]


def test_effects_filter_by_the_step_of_a_run(twin: Twin) -> None:
    async def body(client: Any) -> Any:
        run = await client.start_run("contract", "1", {})

        async def two(tx: Any) -> None:
            await tx.intend("k.x", {"n": 1})
            await tx.intend("k.x", {"n": 2})

        async def one(tx: Any) -> None:
            await tx.intend("k.x", {"n": 3})

        await run.transaction("two", two)
        await run.transaction("one", one)
        found = [e.payload["n"] for e in await client.effects(run_id=run.id, step_id="two")]
        with pytest.raises(ValidationError, match="step_id"):
            await client.effects(step_id="two")
        return found

    assert twin.run(body) == [1, 2]


def test_a_callers_key_reused_returns_the_intent_or_is_a_conflict_naming_it(
    twin: Twin, ob: Outbox
) -> None:
    async def body(client: Any) -> Any:
        one = await client.start_run("contract", "1", {})
        two = await client.start_run("contract", "1", {})

        async def charge(tx: Any) -> Any:
            return str((await tx.intend("k.charge", {"cents": 500}, key="invoice-77")).id)

        first = await one.transaction("charge", charge)
        again = await one.transaction("charge-again", charge)
        # The key names one intent: another run, another kind or another payload conflicts.
        with pytest.raises(IdempotencyConflict, match="invoice-77"):
            await two.transaction("charge", charge)

        async def other(tx: Any) -> None:
            await tx.intend("k.charge", {"cents": 900}, key="invoice-77")

        with pytest.raises(IdempotencyConflict, match="invoice-77"):
            await one.transaction("charge-more", other)

        async def twice(tx: Any) -> None:
            await tx.intend("k.x", {"a": 1}, key="twice-in-one")
            await tx.intend("k.x", {"a": 2}, key="twice-in-one")

        with pytest.raises(IdempotencyConflict, match="twice-in-one"):
            await two.transaction("twice", twice)
        return first, again

    first, again = twin.run(body)
    assert first == again
    assert [str(e.id) for e in ob.effects()] == [first]


def test_bad_input_is_refused_naming_the_field(twin: Twin) -> None:
    async def body(client: Any) -> None:
        run = await client.start_run("contract", "1", {})
        with pytest.raises(ValidationError, match="step_id"):
            await run.call("  ", lambda: 1)
        with pytest.raises(PayloadError, match="result"):
            await run.call("nan", lambda: float("nan"))
        with pytest.raises(PayloadError, match="payload"):
            await run.transaction("p", lambda tx: tx.intend("k.x", {"v": float("inf")}))
        with pytest.raises(ValidationError, match="agent"):
            await client.start_run("", "1", {})

    twin.run(body)


# -- G8: waits and signals ------------------------------------------------------------


def test_sleep_blocks_outside_a_worker_then_replays(twin: Twin) -> None:
    async def body(client: Any) -> Any:
        run = await client.start_run("contract", "1", {})
        await run.sleep("cool-off", 0.2)
        resumed = await client.run(run.id)
        await resumed.sleep("cool-off", 3600)  # recorded: returns at once
        return resumed.completed_steps

    assert twin.run(body) == ["cool-off"]


def test_a_signal_sent_before_the_wait_is_consumed_there(twin: Twin) -> None:
    async def body(client: Any) -> Any:
        run = await client.start_run("contract", "1", {})
        receipt = await client.signal(run.id, "approval", {"ok": True}, dedup_key="d1")
        duplicate = await client.signal(run.id, "approval", {"ok": False}, dedup_key="d1")
        got = await run.wait_signal("approve", name="approval", timeout=30)
        return receipt.duplicate, duplicate.duplicate, got

    assert twin.run(body) == (False, True, {"ok": True})


def test_a_signal_sent_during_the_wait_wakes_it(twin: Twin, ob: Outbox) -> None:
    started = ob.start_run("contract", "1", {})

    def send_soon() -> None:
        time.sleep(0.3)
        ob.signal(started.id, "approval", {"by": "ops"})

    async def body(client: Any) -> Any:
        run = await client.run(started.id)
        threading.Thread(target=send_soon, daemon=True).start()
        return await run.wait_signal("approve", name="approval", timeout=30)

    assert twin.run(body) == {"by": "ops"}


def test_a_wait_that_times_out_records_the_timeout_and_replays_it(twin: Twin) -> None:
    async def body(client: Any) -> None:
        run = await client.start_run("contract", "1", {})
        with pytest.raises(SignalTimeout):
            await run.wait_signal("approve", name="approval", timeout=0.2)
        effect = await run.transaction("e", lambda tx: tx.intend("k.never", {}))
        with pytest.raises(EffectTimeout):
            await run.await_effect(effect["id"], timeout=0.2)
        resumed = await client.run(run.id)
        await client.signal(run.id, "approval", {"late": True})
        with pytest.raises(SignalTimeout):
            await resumed.wait_signal("approve", name="approval", timeout=30)
        with pytest.raises(EffectTimeout):
            await resumed.await_effect(effect["id"], timeout=30)

    twin.run(body)


# -- G7: budgets ----------------------------------------------------------------------


def test_debits_are_keyed_and_an_over_budget_step_commits_nothing(twin: Twin, ob: Outbox) -> None:
    async def body(client: Any) -> Any:
        run = await client.start_run("contract", "1", {}, budget=5)

        async def think(tx: Any) -> None:
            tx.spend(3, "model tokens")
            tx.set_state({"thought": 1})

        await run.transaction("think-1", think)
        resumed = await client.run(run.id)
        await resumed.transaction("think-1", think)  # replay: not spent twice

        async def think_more(tx: Any) -> None:
            tx.spend(3, "model tokens")
            tx.set_state({"thought": 2})
            await tx.intend("k.x", {"after": "thinking"})

        with pytest.raises(BudgetExceeded):
            await resumed.transaction("think-2", think_more)
        return run.id

    run_id = twin.run(body)
    loaded = ob.run(run_id)
    assert (loaded.record.spent, loaded.state, loaded.effects()) == (
        Decimal(3),
        {"thought": 1},
        [],
    )


# -- cancellation ---------------------------------------------------------------------


def test_a_cancelled_run_refuses_steps_and_its_pending_effects_are_cancelled(
    twin: Twin, ob: Outbox
) -> None:
    async def body(client: Any) -> Any:
        run = await client.start_run("contract", "1", {})
        await run.transaction("book", lambda tx: tx.intend("k.book", {"seat": "1A"}))
        status = await client.cancel(run.id, "customer changed plans")
        with pytest.raises(RunTerminal):
            await run.transaction("after", lambda tx: tx.set_state({"too": "late"}))
        with pytest.raises(RunTerminal):
            await client.signal(run.id, "approval", {})
        return run.id, status

    run_id, status = twin.run(body)
    assert status == RunStatus.CANCELLED
    assert [e.status for e in ob.run(run_id).effects()] == [EffectStatus.CANCELLED]
