"""Run control, kept alike by both clients: one run per key, pause and resume, forks, big values.

Each body runs against ``Outbox`` and ``AsyncOutbox`` on a real PostgreSQL
(see ``twins.py``); what the database holds afterwards is checked with the
sync client and plain SQL.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import text

from outbox import (
    EffectStatus,
    IdempotencyConflict,
    Outbox,
    RunExists,
    RunPaused,
    RunStatus,
    RunTerminal,
    ValidationError,
)
from outbox.keys import derive_key
from tests.contract.twins import Twin

MB = 1024 * 1024


@pytest.fixture(params=["sync", "async"])
def twin(request: pytest.FixtureRequest, dsn: str) -> Twin:
    return Twin(request.param, dsn)


def scalar(ob: Outbox, sql: str, **params: Any) -> Any:
    with ob.engine.connect() as conn:
        return conn.execute(text(sql), params).scalar_one()


# -- one run per business key ---------------------------------------------------------


def test_the_same_key_twice_starts_one_run(twin: Twin, ob: Outbox) -> None:
    async def body(client: Any) -> Any:
        first = await client.start_run("billing", "1", {"invoice": 7}, key="invoice-7")
        await first.transaction("s1", lambda tx: tx.set_state({"at": "s1"}))
        again = await client.start_run("billing", "1", {"invoice": 7}, key="invoice-7")
        return first.id, again.id, again.completed_steps, again.state

    first, again, steps, state = twin.run(body)
    assert first == again
    assert (steps, state) == (["s1"], {"at": "s1"})
    assert len(ob.runs()) == 1
    assert ob.run(first).record.key == "invoice-7"


def test_a_key_reused_with_other_inputs_or_version_is_a_conflict(twin: Twin, ob: Outbox) -> None:
    async def body(client: Any) -> Any:
        run = await client.start_run("billing", "1", {"invoice": 7}, key="invoice-7")
        refused = []
        for version, inputs in (("1", {"invoice": 8}), ("2", {"invoice": 7})):
            try:
                await client.start_run("billing", version, inputs, key="invoice-7")
            except IdempotencyConflict as exc:
                refused.append(exc)
        return run.id, refused

    run_id, refused = twin.run(body)
    assert len(refused) == 2
    assert all(not isinstance(e, RunExists) and e.key == "invoice-7" for e in refused)
    # the conflict names the key, never the other run: a prober learns nothing of it
    assert all(str(run_id) not in str(e) for e in refused)
    assert [r.id for r in ob.runs()] == [run_id]


def test_reject_refuses_a_second_start_naming_the_first(twin: Twin, ob: Outbox) -> None:
    async def body(client: Any) -> Any:
        run = await client.start_run("billing", "1", {"n": 1}, key="k", on_conflict="reject")
        try:
            await client.start_run("billing", "1", {"n": 1}, key="k", on_conflict="reject")
        except RunExists as exc:
            return run.id, exc
        return run.id, None

    run_id, refused = twin.run(body)
    assert isinstance(refused, RunExists) and isinstance(refused, IdempotencyConflict)
    assert refused.run_id == run_id
    with pytest.raises(ValidationError, match="on_conflict"):
        ob.start_run("billing", "1", key="k2", on_conflict="overwrite")


def test_priority_and_fairness_key_reach_the_run_and_its_effects(twin: Twin, ob: Outbox) -> None:
    async def body(client: Any) -> Any:
        run = await client.start_run("a", "1", priority=5, fairness_key="tenant-a")

        async def step(tx: Any) -> None:
            await tx.intend("k.inherit", {})
            await tx.intend("k.own", {}, priority=-3, fairness_key="provider-x")

        await run.transaction("s", step)
        return run.id

    run_id = twin.run(body)
    record = ob.run(run_id).record
    assert (record.priority, record.fairness_key) == (5, "tenant-a")
    lanes = {e.kind: (e.priority, e.fairness_key) for e in ob.effects(run_id=run_id)}
    assert lanes == {"k.inherit": (5, "tenant-a"), "k.own": (-3, "provider-x")}


# -- pause and resume -------------------------------------------------------------------


def test_a_paused_run_takes_no_step_and_holds_its_effects(twin: Twin, ob: Outbox) -> None:
    async def body(client: Any) -> Any:
        run = await client.start_run("a", "1")

        async def step(tx: Any) -> None:
            await tx.intend("k.later", {"n": 1}, delay_seconds=3600)

        await run.transaction("s1", step)
        status = await client.pause(run.id, "customer asked to hold")
        again = await client.pause(run.id, "still holding")
        refused: RunPaused | None
        try:
            await run.call("s2", lambda: "never")
        except RunPaused as exc:
            refused = exc
        else:
            refused = None
        paused_effects = [e.status for e in await client.effects(run_id=run.id)]
        resumed = await client.resume(run.id)
        after = await run.call("s2", lambda: "done")
        return run.id, status, again, refused, paused_effects, resumed, after

    run_id, status, again, refused, paused, resumed, after = twin.run(body)
    assert (status, again) == (RunStatus.PAUSED, RunStatus.PAUSED)
    assert isinstance(refused, RunPaused)
    assert paused == [EffectStatus.PAUSED]
    assert resumed == RunStatus.RUNNABLE
    assert after == "done"
    loaded = ob.run(run_id)
    assert loaded.completed_steps == ["s1", "s2"]
    assert [e.status for e in loaded.effects()] == [EffectStatus.PENDING]
    assert loaded.record.paused_at is None and loaded.record.pause_reason is None


def test_pause_refuses_ended_runs_and_resume_of_a_live_run_changes_nothing(
    twin: Twin, ob: Outbox
) -> None:
    async def body(client: Any) -> Any:
        done = await client.start_run("a", "1")
        await done.complete({"ok": True})
        live = await client.start_run("a", "1")
        out = [await client.resume(live.id)]
        try:
            await client.pause(done.id, "too late")
        except RunTerminal as exc:
            out.append(exc)
        try:
            await client.resume(done.id)
        except RunTerminal as exc:
            out.append(exc)
        return out

    resumed, *refused = twin.run(body)
    assert resumed == RunStatus.RUNNABLE
    assert len(refused) == 2
    with pytest.raises(ValidationError, match="reason"):
        ob.pause(ob.start_run("a", "1").id, " ")


def test_cancelling_a_paused_run_cancels_its_held_effects(twin: Twin, ob: Outbox) -> None:
    async def body(client: Any) -> Any:
        run = await client.start_run("a", "1")

        async def step(tx: Any) -> None:
            await tx.intend("k.later", {}, delay_seconds=3600)

        await run.transaction("s1", step)
        await client.pause(run.id, "hold")
        return run.id, await client.cancel(run.id, "changed our mind")

    run_id, status = twin.run(body)
    assert status == RunStatus.CANCELLED
    assert [e.status for e in ob.effects(run_id=run_id)] == [EffectStatus.CANCELLED]


# -- forks ------------------------------------------------------------------------------


def test_a_fork_replays_the_steps_before_its_step_and_runs_the_rest_anew(
    twin: Twin, ob: Outbox
) -> None:
    calls: list[str] = []

    def tool(name: str) -> dict[str, str]:
        calls.append(name)
        return {"tool": name}

    async def agent(run: Any) -> Any:
        fetched = await run.call("fetch", tool, "fetch")

        async def charge(tx: Any) -> str:
            tx.set_state({"after": "charge"})
            tx.spend(2.5, "model")
            effect = await tx.intend("k.charge", {"cents": 100})
            return str(effect.idempotency_key)

        charged = await run.transaction("charge", charge)

        async def notify(tx: Any) -> str:
            tx.set_state({"after": "notify"})
            return str((await tx.intend("k.notify", {"to": "ap"})).idempotency_key)

        notified = await run.transaction("notify", notify)
        return fetched, charged, notified

    async def body(client: Any) -> Any:
        original = await client.start_run("agent", "1", {"month": 10}, budget=10.0)
        first = await agent(original)
        await original.complete({"done": True})
        fork = await client.fork(original.id, "charge", version="2")
        replayed = (fork.completed_steps, fork.state, fork.version)
        second = await agent(fork)
        return original.id, fork.id, first, second, replayed

    original_id, fork_id, first, second, replayed = twin.run(body)
    assert calls == ["fetch"], "the replayed step's function was not called again"
    assert replayed == (["fetch"], {}, "2")
    assert second[0] == first[0] == {"tool": "fetch"}
    assert second[1] == derive_key(fork_id, "charge", 0) != first[1]
    assert second[2] == derive_key(fork_id, "notify", 0) != first[2]
    fork = ob.run(fork_id)
    assert fork.record.forked_from == original_id and fork.record.forked_at_step == "charge"
    assert fork.record.spent == 2.5 and fork.record.budget == 10
    assert fork.state == {"after": "notify"}
    original = ob.run(original_id)
    assert original.status == RunStatus.COMPLETED
    assert original.completed_steps == ["fetch", "charge", "notify"]
    assert [e.idempotency_key for e in original.effects()] == [first[1], first[2]]
    assert [e.idempotency_key for e in fork.effects()] == [second[1], second[2]]


def test_a_forks_replayed_steps_are_chained_so_an_altered_one_is_caught(ob: Outbox) -> None:
    original = ob.start_run("agent", "1", {"month": 11})
    for step in ("fetch", "charge", "notify"):
        original.call(step, lambda step=step: {"step": step})
    fork = ob.fork(original.id, from_step="notify")
    fork.call("notify", lambda: {"step": "notify again"})
    assert ob.verify_run(fork.id) == [] and ob.verify_run(original.id) == []
    record = ob.audit_record(fork.id)
    assert [s["hash"] is not None for s in record["steps"]] == [True, True, True]
    assert record["run"]["step_head"] == record["steps"][-1]["hash"]
    # A copied step is part of the fork's history: rewriting it breaks the fork's chain.
    with ob.engine.begin() as conn:
        conn.execute(
            text(
                'UPDATE outbox_steps SET result = \'{"step": "forged"}\''
                " WHERE run_id = :run AND step_id = 'charge'"
            ),
            {"run": fork.id},
        )
    breaks = [str(b) for b in ob.verify_run(fork.id)]
    assert breaks and "'charge'" in breaks[0], breaks
    assert ob.verify_run(original.id) == []


def test_a_fork_starts_from_the_state_the_replayed_steps_set(twin: Twin, ob: Outbox) -> None:
    async def body(client: Any) -> Any:
        run = await client.start_run("agent", "1")
        for n in range(1, 4):
            await run.transaction(f"s{n}", lambda tx, n=n: tx.set_state({"n": n}))
        await run.transaction("plan", lambda tx: tx.set_plan(["a", "b"]))
        fork = await client.fork(run.id, "s3")
        return fork.state, fork.plan, fork.current_step

    assert twin.run(body) == ({"n": 2}, [], "s2")


def test_a_failed_run_forks_from_the_step_it_failed_at(ob: Outbox) -> None:
    run = ob.start_run("agent", "1")
    run.call("fetch", lambda: 1)
    with ob.engine.begin() as conn:  # what a worker records when a step's retries run out
        conn.execute(
            text(
                "UPDATE outbox_runs SET status = 'failed', "
                'error = \'{"step": "charge", "type": "Timeout"}\' WHERE id = :id'
            ),
            {"id": run.id},
        )
    fork = ob.fork(run.id, "charge")
    assert fork.completed_steps == ["fetch"] and fork.status == RunStatus.RUNNABLE
    with pytest.raises(ValidationError, match="from_step"):
        ob.fork(run.id, "no-such-step")


def test_a_forks_copied_rows_keep_every_digit_of_a_recorded_number(ob: Outbox) -> None:
    # The fork's rows are read and written back as values: a number a step
    # recorded (PostgreSQL's numeric in jsonb keeps its scale) is copied as text,
    # not through a Python float (1.10 would come back as 1.1).
    recorded = '{"qty": 2.500, "price": 1.10}'  # as jsonb renders it
    run = ob.start_run("agent", "1", {"n": 1})
    with ob.engine.begin() as conn:
        # what a client with exact decimals (the SQL API, the TypeScript client) records
        conn.execute(
            text(
                "SELECT * FROM outbox_commit_step(:id, 'quote', result => CAST(:r AS jsonb),"
                " state => CAST(:r AS jsonb))"
            ),
            {"id": run.id, "r": recorded},
        )
    run.call("charge", lambda: 1)
    fork = ob.fork(run.id, "charge")
    with ob.engine.connect() as conn:
        copied = conn.execute(
            text(
                "SELECT s.result::text, s.state::text, r.state::text FROM outbox_steps s"
                " JOIN outbox_runs r ON r.id = s.run_id WHERE s.run_id = :id"
            ),
            {"id": fork.id},
        ).one()
    assert list(copied) == [recorded] * 3
    assert ob.verify_run(fork.id) == []


# -- large values by reference ----------------------------------------------------------


def test_twenty_megabyte_values_round_trip_and_rows_stay_small(twin: Twin, ob: Outbox) -> None:
    big = {"transcript": "model said: " + "x" * (20 * MB)}

    async def body(client: Any) -> Any:
        run = await client.start_run("agent", "1", big)
        result = await run.call("think", lambda: big)

        async def step(tx: Any) -> Any:
            tx.set_state(big)
            effect = await tx.intend("k.big", big)
            return str(effect.id), effect.payload == big

        effect_id, intended = await run.transaction("send", step)
        loaded = await client.run(run.id)
        effect = await client.effect(effect_id)
        return (
            run.id,
            effect_id,
            run.inputs == big,
            result == big,
            intended,
            loaded.inputs == big,
            loaded.state == big,
            loaded.step("think").result == big,
            effect.payload == big,
        )

    run_id, effect_id, *same = twin.run(body)
    assert all(same)
    assert scalar(ob, "SELECT count(*) FROM outbox_blobs") == 1, "stored once"
    steps_row = scalar(
        ob, "SELECT max(pg_column_size(s.*)) FROM outbox_steps s WHERE run_id = :id", id=run_id
    )
    effect_row = scalar(
        ob, "SELECT pg_column_size(e.*) FROM outbox_effects e WHERE id = :id", id=effect_id
    )
    run_row = scalar(ob, "SELECT pg_column_size(r.*) FROM outbox_runs r WHERE id = :id", id=run_id)
    assert steps_row < 1024 and effect_row < 1024 and run_row < 1024, (
        steps_row,
        effect_row,
        run_row,
    )


def test_a_large_signal_payload_is_stored_by_reference_and_read_back(
    twin: Twin, ob: Outbox
) -> None:
    big = ["line"] * 100_000

    async def body(client: Any) -> Any:
        run = await client.start_run("agent", "1")
        await client.signal(run.id, "approve", big)
        got = await run.wait_signal("wait", name="approve", timeout=5)
        return run.id, got == big, (await client.run(run.id)).step("wait").result == big

    run_id, got, replayed = twin.run(body)
    assert got and replayed
    assert scalar(ob, "SELECT count(*) FROM outbox_blob_refs WHERE owner = :id", id=run_id) == 1


def test_a_value_shaped_like_a_reference_is_refused(twin: Twin) -> None:
    async def body(client: Any) -> Any:
        try:
            await client.start_run("a", "1", {"__outbox_blob__": {"sha256": "0" * 64}})
        except ValidationError as exc:
            return exc.field
        return None

    assert twin.run(body) == "inputs"
