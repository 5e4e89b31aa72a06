"""What only the async twin has: async tool functions, AsyncConnection steps, async workers."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from sqlalchemy import Column, Integer, MetaData, Table, Text, select

from outbox import (
    AsyncOutbox,
    AsyncRun,
    AsyncStepTransaction,
    Outbox,
    RunStatus,
    ValidationError,
)
from tests.support import wait_for

notes = Table(
    "async_notes",
    MetaData(),
    Column("id", Integer, primary_key=True),
    Column("text", Text, nullable=False),
)


def run_async(dsn: str, body: Any, **overrides: Any) -> Any:
    async def main() -> Any:
        async with await AsyncOutbox.connect(dsn, **overrides) as ob:
            return await body(ob)

    return asyncio.run(main())


def test_call_awaits_async_functions_and_runs_plain_ones_in_a_thread(dsn: str) -> None:
    loop_thread: list[int] = []
    seen: list[int] = []

    async def fetch_async(n: int) -> int:
        await asyncio.sleep(0)
        return n * 2

    def fetch_blocking(n: int) -> int:
        seen.append(threading.get_ident())
        return n * 3

    async def body(ob: AsyncOutbox) -> Any:
        loop_thread.append(threading.get_ident())
        run = await ob.start_run("a", "1", {})
        return await run.call("x", fetch_async, 5), await run.call("y", fetch_blocking, 5)

    assert run_async(dsn, body) == (10, 15)
    assert seen and seen != loop_thread


def test_an_intend_left_unawaited_makes_the_step_write_nothing(dsn: str, ob: Outbox) -> None:
    async def body(aob: AsyncOutbox) -> Any:
        run = await aob.start_run("a", "1", {})

        async def forgot(tx: AsyncStepTransaction) -> None:
            tx.set_state({"should": "not commit"})
            tx.intend("k.x", {"lost": True})  # no await

        with pytest.raises(ValidationError, match="not awaited"):
            await run.transaction("s", forgot)
        return run.id

    run_id = run_async(dsn, body)
    assert ob.run(run_id).effects() == [] and ob.run(run_id).completed_steps == []


def test_a_step_joins_the_callers_async_transaction(dsn: str, ob: Outbox) -> None:
    notes.create(ob.engine)

    async def body(aob: AsyncOutbox) -> Any:
        run = await aob.start_run("a", "1", {})

        async def step(tx: AsyncStepTransaction) -> None:
            await tx.intend("k.x", {"n": 1})

        async with aob.engine.connect() as conn:
            await conn.execute(notes.insert().values(text="mine"))
            await run.transaction("joined", step, connection=conn)
            await conn.rollback()  # the caller decides: the step goes with it
        async with aob.engine.begin() as conn:
            await conn.execute(notes.insert().values(text="kept"))
            await run.transaction("joined-2", step, connection=conn)
        return run.id

    run_id = run_async(dsn, body)
    with ob.engine.connect() as conn:
        assert list(conn.execute(select(notes.c.text)).scalars()) == ["kept"]
    assert ob.run(run_id).completed_steps == ["joined-2"]
    assert len(ob.run(run_id).effects()) == 1


def test_an_async_worker_runs_many_runs_at_once_on_one_loop(dsn: str, ob: Outbox) -> None:
    """Fifty handlers are inside at the same moment (a barrier proves it, not a clock)."""
    runs = [ob.start_run("fleet", "1", {"n": n}) for n in range(50)]
    threads: set[int] = set()

    async def body(aob: AsyncOutbox) -> dict[str, int]:
        inside = 0
        everyone = asyncio.Event()

        async def handler(run: AsyncRun) -> int:
            nonlocal inside
            threads.add(threading.get_ident())
            n = await run.call("fetch", lambda: run.inputs["n"])
            inside += 1
            if inside == len(runs):
                everyone.set()
            await asyncio.wait_for(everyone.wait(), 60)
            await run.transaction("done", lambda tx: tx.set_state({"n": n}))
            return int(n)

        worker = aob.worker("fleet", "1", handler, concurrency=50, sweep_seconds=0.05)
        task = asyncio.create_task(worker.run())
        while worker.counts.get("completed", 0) < len(runs):
            await asyncio.sleep(0.05)
        worker.stop()
        await task
        return worker.counts

    counts = run_async(dsn, body, pool_size=10)
    assert counts == {"completed": 50}
    assert len(threads) == 1
    assert {ob.run(r.id).record.result for r in runs} == set(range(50))


def test_an_async_worker_parks_a_waiting_run_and_a_signal_resumes_it(dsn: str, ob: Outbox) -> None:
    visits: list[str] = []

    async def handler(run: AsyncRun) -> Any:
        visits.append("in")
        approval = await run.wait_signal("approve", name="approval", timeout=60)
        return {"approved_by": approval["by"]}

    async def body(aob: AsyncOutbox) -> None:
        worker = aob.worker("wait", "1", handler, sweep_seconds=0.05)
        task = asyncio.create_task(worker.run())
        run = await aob.start_run("wait", "1", {})
        while (await aob.run(run.id)).status != RunStatus.WAITING:
            await asyncio.sleep(0.05)
        assert worker.counts == {"suspended": 1}
        receipt = await aob.signal(run.id, "approval", {"by": "ops"})
        assert receipt.woke_run
        while (await aob.run(run.id)).status != RunStatus.COMPLETED:
            await asyncio.sleep(0.05)
        worker.stop()
        await task
        assert (await aob.run(run.id)).record.result == {"approved_by": "ops"}

    run_async(dsn, body)
    assert visits == ["in", "in"]


def test_an_async_worker_keeps_version_pinning_and_retries_failed_steps(
    dsn: str, ob: Outbox
) -> None:
    old = ob.start_run("pin", "1", {"state": "old"})
    new = ob.start_run("pin", "2", {})
    tries: list[str] = []

    async def handler(run: AsyncRun) -> str:
        tries.append(run.version)

        async def flaky(tx: AsyncStepTransaction) -> None:
            if len(tries) < 2:
                raise RuntimeError("first try fails")
            tx.set_state({"ok": True})

        await run.transaction("flaky", flaky)
        return run.version

    async def body(aob: AsyncOutbox) -> None:
        worker = aob.worker(
            "pin", "2", handler, sweep_seconds=0.05, retry_base_seconds=0.01, poll_seconds=0.05
        )
        task = asyncio.create_task(worker.run())
        while (await aob.run(new.id)).status != RunStatus.COMPLETED:
            await asyncio.sleep(0.05)
        worker.stop()
        await task

    run_async(dsn, body)
    assert tries == ["2", "2"]
    assert ob.run(old.id).status == RunStatus.RUNNABLE
    assert ob.run(new.id).record.step_retries == {"flaky": 1}


def test_the_sync_clients_worker_takes_an_async_handler(ob: Outbox) -> None:
    async def handler(run: AsyncRun) -> str:
        assert isinstance(run, AsyncRun)
        await run.call("fetch", asyncio.sleep, 0, "fetched")
        return "done"

    runner = ob.worker("blocking", "1", handler, sweep_seconds=0.05)
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    try:
        run = ob.start_run("blocking", "1", {})
        wait_for(lambda: ob.run(run.id).status == RunStatus.COMPLETED)
    finally:
        runner.stop()
        thread.join(30)
    assert not thread.is_alive()
    assert ob.run(run.id).record.result == "done"
    assert runner.counts == {"completed": 1}
