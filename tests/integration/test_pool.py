"""The client's connection pool: last in, first out, and idle connections pinged before use."""

from __future__ import annotations

import asyncio
import time

import psycopg
import pytest
from sqlalchemy import text

from outbox import AsyncOutbox, AsyncStepTransaction, DatabaseError, Outbox, StepTransaction
from outbox.storage import engine as engine_module
from outbox.storage.dsn import libpq_dsn


def _backend(tx: StepTransaction) -> int:
    return int(tx.connection.execute(text("SELECT pg_backend_pid()")).scalar_one())


def _terminate(dsn: str, pid: int) -> None:
    """End one backend, the way a proxy's or the server's idle timeout does, and wait for it."""
    with psycopg.connect(libpq_dsn(dsn), autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        deadline = time.monotonic() + 10
        while conn.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone():
            assert time.monotonic() < deadline, "the backend did not exit"
            time.sleep(0.02)


def test_a_lone_writer_keeps_one_backend_once_a_second_connection_exists(dsn: str) -> None:
    # A FIFO pool handed the connections out in turn as soon as a second one had
    # been opened (by the trailing NOTIFY's thread, say), so every backend served
    # every other step with cold caches and plans.
    with Outbox.connect(dsn, pool_size=2) as ob:
        run = ob.start_run("pool", "1")
        with ob.engine.connect() as first, ob.engine.connect() as second:
            opened = {
                conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
                for conn in (first, second)
            }
        assert len(opened) == 2
        backends: list[int] = []
        for n in range(6):
            run.transaction(f"s{n}", lambda tx: backends.append(_backend(tx)))
        assert len(set(backends)) == 1, backends


def test_a_pooled_connection_closed_while_idle_is_replaced_without_failing_a_step(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Outbox.connect(dsn, pool_size=1) as ob:
        run = ob.start_run("pool", "1")
        backends: list[int] = []
        run.transaction("s0", lambda tx: backends.append(_backend(tx)))
        _terminate(dsn, backends[0])
        monkeypatch.setattr(engine_module, "IDLE_PING_S", 0.0)  # it has been idle long enough
        run.transaction("s1", lambda tx: backends.append(_backend(tx)))
        assert backends[1] != backends[0]
        assert ob.run(run.id).completed_steps == ["s0", "s1"]

        # what the ping saves: a connection closed while it was idle but too briefly
        # to be pinged fails the step that draws it (transient: nothing was written)
        _terminate(dsn, backends[1])
        monkeypatch.setattr(engine_module, "IDLE_PING_S", 3600.0)
        with pytest.raises(DatabaseError) as failed:
            run.transaction("s2", lambda tx: backends.append(_backend(tx)))
        assert failed.value.transient
        run.transaction("s2", lambda tx: backends.append(_backend(tx)))
        assert ob.run(run.id).completed_steps == ["s0", "s1", "s2"]


def test_the_async_client_replaces_an_idle_connection_closed_under_it(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> list[str]:
        async with await AsyncOutbox.connect(dsn, pool_size=1) as ob:
            run = await ob.start_run("pool", "1", {})
            pids: list[int] = []

            async def step(tx: AsyncStepTransaction) -> None:
                found = await tx.connection.execute(text("SELECT pg_backend_pid()"))
                pids.append(int(found.scalar_one()))

            await run.transaction("s0", step)
            await asyncio.to_thread(_terminate, dsn, pids[0])
            monkeypatch.setattr(engine_module, "IDLE_PING_S", 0.0)
            await run.transaction("s1", step)
            assert pids[1] != pids[0]
            return list((await ob.run(run.id)).completed_steps)

    assert asyncio.run(main()) == ["s0", "s1"]
