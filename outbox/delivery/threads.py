"""Threads for blocking calls that a daemon may give up on: they never hold the process.

A delivering process runs blocking work in threads: a synchronous deliverer's
call, a sink's lookup, kafka-python's consumer. When the grace period ends, a
call still running is abandoned (its lease runs out and the reconciler
resolves it), but a thread cannot be interrupted. With
``concurrent.futures.ThreadPoolExecutor`` it would still hold the process:
``asyncio.run`` waits for the loop's default executor, and the interpreter joins
every such thread at exit, so ``--grace 1`` would become "until the call
returns". :class:`DaemonThreads` is the same kind of pool, built from daemon
threads that nobody joins; a call still running at exit ends with the process.

It subclasses ``ThreadPoolExecutor`` only because ``loop.set_default_executor``
accepts nothing else; none of that class's threads or internals are used.
"""

from __future__ import annotations

import functools
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

__all__ = ["DaemonThreads", "default_workers"]

P = ParamSpec("P")
T = TypeVar("T")


def default_workers() -> int:
    """The size of asyncio's own default executor: ``min(32, cpus + 4)``."""
    return min(32, (os.cpu_count() or 1) + 4)


class DaemonThreads(ThreadPoolExecutor):
    """Up to ``max_workers`` daemon threads, started as work needs them, never waited for.

    ``shutdown`` stops new work and lets idle threads end; it does not wait
    for calls still running (``wait`` is accepted for the ``Executor`` API and
    only means that queued work still runs). Submission order is kept, so
    ``max_workers=1`` runs calls one at a time, in order.
    """

    def __init__(self, max_workers: int, name: str) -> None:
        super().__init__(max_workers, thread_name_prefix=name)  # starts nothing
        # Names of our own, apart from ThreadPoolExecutor's (unused) internals.
        self._dt_max = max_workers
        self._dt_name = name
        self._dt_work: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue()
        )
        self._dt_threads: list[threading.Thread] = []
        # Released by a thread each time it finishes a call (as ThreadPoolExecutor does).
        self._dt_idle = threading.Semaphore(0)
        self._dt_lock = threading.Lock()
        self._dt_closed = False

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        """Run ``fn(*args, **kwargs)`` on one of the threads."""
        future: Future[T] = Future()
        with self._dt_lock:
            if self._dt_closed:
                raise RuntimeError("cannot schedule new calls after shutdown")
            self._dt_work.put((future, functools.partial(fn, *args, **kwargs)))
            if not self._dt_idle.acquire(blocking=False) and len(self._dt_threads) < self._dt_max:
                thread = threading.Thread(
                    target=self._serve, name=f"{self._dt_name}_{len(self._dt_threads)}", daemon=True
                )
                self._dt_threads.append(thread)
                thread.start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No new calls; queued ones are cancelled if asked; running ones are not waited for."""
        with self._dt_lock:
            if self._dt_closed:
                return
            self._dt_closed = True
            if cancel_futures:
                while True:
                    try:
                        item = self._dt_work.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        item[0].cancel()
            self._dt_work.put(None)

    def _serve(self) -> None:
        while True:
            item = self._dt_work.get()
            if item is None:
                self._dt_work.put(None)  # the next thread ends too
                return
            future, call = item
            del item
            if future.set_running_or_notify_cancel():
                try:
                    result = call()
                except BaseException as exc:
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            del future, call
            self._dt_idle.release()
