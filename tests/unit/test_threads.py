"""DaemonThreads: a thread pool whose abandoned calls never hold the process.

Expected: calls run (in order, with one thread), results and errors come back
through futures, idle threads are reused, ``shutdown`` does not wait for a
running call, and a process whose asyncio loop uses it as the default
executor exits while a call it gave up on still sleeps, where the standard
pool keeps it alive until the call returns.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from outbox.delivery.threads import DaemonThreads


def test_calls_run_in_order_on_one_thread_and_report_errors() -> None:
    pool = DaemonThreads(1, "t")
    seen: list[int] = []
    futures = [pool.submit(seen.append, i) for i in range(50)]
    for future in futures:
        future.result(5)
    assert seen == list(range(50))
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(5)
    assert pool.submit(lambda: threading.current_thread().daemon).result(5) is True
    pool.shutdown()
    with pytest.raises(RuntimeError):
        pool.submit(print)


def test_idle_threads_are_reused_and_the_pool_is_bounded() -> None:
    pool = DaemonThreads(3, "t")
    for _ in range(20):
        pool.submit(time.sleep, 0).result(5)
    names = {pool.submit(lambda: threading.current_thread().name).result(5) for _ in range(5)}
    assert len(names) == 1, "one call at a time needs one thread"
    gate = threading.Event()
    busy = [pool.submit(gate.wait, 5) for _ in range(6)]
    time.sleep(0.2)
    assert sum(t.name.startswith("t_") for t in threading.enumerate()) == 3
    gate.set()
    assert all(f.result(5) for f in busy)
    pool.shutdown()


def test_shutdown_does_not_wait_for_a_running_call_and_cancels_queued_ones() -> None:
    pool = DaemonThreads(1, "t")
    gate = threading.Event()
    running = pool.submit(gate.wait, 30)
    queued = pool.submit(print, "never")
    time.sleep(0.1)
    started = time.monotonic()
    pool.shutdown(wait=True, cancel_futures=True)
    assert time.monotonic() - started < 1
    assert queued.cancelled() and not running.done()
    gate.set()
    assert running.result(5) is True


PROGRAM = """
import asyncio, time
from outbox.delivery.threads import DaemonThreads

async def main():
    asyncio.get_running_loop().set_default_executor(DaemonThreads(4, "t"))
    call = asyncio.ensure_future(asyncio.to_thread(time.sleep, 30))
    await asyncio.sleep(0.2)
    call.cancel()  # given up on, as a daemon does at the end of its grace period

asyncio.run(main())
"""


def test_a_call_given_up_on_does_not_hold_the_process() -> None:
    """With ``ThreadPoolExecutor`` this program runs 30 s (asyncio.run waits for the call)."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", textwrap.dedent(PROGRAM)], check=True, timeout=25)
    assert time.monotonic() - started < 25
