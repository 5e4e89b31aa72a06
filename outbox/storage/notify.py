"""Wake-ups for deliverers and workers without a NOTIFY per commit.

PostgreSQL serialises the commits of every transaction that ran ``NOTIFY`` on
one global lock. Measured with pgbench on this kind of machine, 8 writers drop
from about 12.8k to 5.1k transactions/s when each one notifies. So a writing
process sends at most one NOTIFY per ``window`` inline with a commit (the
leading edge: a trickle of intents is signalled with no delay at all), and when
it skipped one it sends a single trailing NOTIFY after the window, outside any
transaction, once the skipped commits are durable. Every committed intent is
therefore followed by a NOTIFY within ``window`` of its commit (two windows at
most, below); under load the extra notifies are at most one per window per
process.

A commit that carries its own NOTIFY also pays any earlier debt, so a steady
trickle costs no extra transaction at all. One that is under way when a debt
falls due is waited for, up to a second window: a steady writer's next NOTIFY
commit usually ends just after the deadline, and sending the trailing NOTIFY
then cost one extra transaction every few steps. If that commit fails, the
trailing NOTIFY goes out at the end of the second window.

A NOTIFY is only a hint: listeners always keep a poll as the backstop, because
notifications are lost when a listener's connection drops.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg

from outbox.storage.dsn import libpq_dsn

__all__ = [
    "Notifier",
    "WakeupThrottle",
    "listen",
    "listen_blocking",
    "wait_for_notify",
    "wait_for_notify_async",
]

log = logging.getLogger(__name__)


class WakeupThrottle:
    """Decides, per commit, whether to NOTIFY inline, and sends trailing notifies.

    Call :meth:`inline` before a write that creates work; include the NOTIFY in
    that transaction when it returns a token (not ``None``). After the commit,
    call :meth:`committed` with that token (or ``None``). ``send`` issues one
    NOTIFY on its own connection (autocommit).

    A commit that carried no NOTIFY owes one, sent ``window`` after that commit
    at the latest. A later commit that carried its own NOTIFY pays the debt
    instead, provided it started after the owing commit had finished (its
    NOTIFY is then delivered after the owing commit is visible). So a steady
    single writer sends no extra transactions at all.
    """

    def __init__(self, send: Callable[[], None], *, window_s: float) -> None:
        self._send = send
        self._window = window_s
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._last = -float("inf")
        # monotonic times of the first and the last commit still owed a NOTIFY
        self._owed_first: float | None = None
        self._owed_last: float | None = None
        # the token of a commit carrying its own NOTIFY, handed out and not yet committed
        self._paying: float | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def inline(self) -> float | None:
        """A token when this commit should carry the NOTIFY itself, else None."""
        now = time.monotonic()
        with self._lock:
            if now - self._last >= self._window:
                self._last = self._paying = now
                return now
            return None

    def committed(self, token: float | None) -> None:
        """Record a commit that created work: paid by its own NOTIFY (token), or owed."""
        now = time.monotonic()
        with self._lock:
            if token is not None:
                if token == self._paying:
                    self._paying = None
                if self._owed_last is not None and token >= self._owed_last:
                    self._owed_first = self._owed_last = None
                return
            if self._closed:
                return
            first = self._owed_first is None
            if first:
                self._owed_first = now
            self._owed_last = now
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._trail, name="outbox-wakeup", daemon=True
                )
                self._thread.start()
            if first:
                # Only a new debt moves the thread's deadline (owed_first + window): a
                # wake-up per commit cost the writer a thread switch on every step.
                self._wake.notify()

    def close(self) -> None:
        """Send what is owed and stop the background thread."""
        with self._lock:
            self._closed = True
            self._wake.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=5)

    def _trail(self) -> None:
        while True:
            with self._lock:
                while self._owed_first is None and not self._closed:
                    self._wake.wait()
                if self._owed_first is None:
                    return
                due = self._owed_first + self._window
                assert self._owed_last is not None
                if self._paying is not None and self._paying >= self._owed_last:
                    due += self._window  # that commit's NOTIFY will cover the debt
                wait = due - time.monotonic()
                if wait > 0 and not self._closed:
                    self._wake.wait(wait)  # a NOTIFYing commit may pay meanwhile
                    continue
                self._owed_first = self._owed_last = None
                self._last = time.monotonic()
            try:
                self._send()
            except Exception:  # the poll backstop covers a lost hint
                log.warning("trailing NOTIFY failed; listeners fall back to polling", exc_info=True)


async def listen(
    dsn: str,
    channel: str,
    wake: asyncio.Event,
    *,
    on_payload: Callable[[str], None] | None = None,
) -> None:
    """Set ``wake`` on every NOTIFY on ``channel``, reconnecting forever (cancel to stop).

    While the connection is down the caller's poll is the only wake-up; on
    reconnect ``wake`` is set once, for anything committed in between.
    ``on_payload`` is given each NOTIFY's payload first.
    """
    backoff = 0.1
    while True:
        try:
            conn = await psycopg.AsyncConnection.connect(libpq_dsn(dsn), autocommit=True)
            async with conn:
                await conn.execute(f"LISTEN {channel}")
                backoff = 0.1
                wake.set()
                async for note in conn.notifies():
                    if on_payload is not None:
                        on_payload(note.payload)
                    wake.set()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("LISTEN %s connection lost (%s); polling until it is back", channel, exc)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)


def listen_blocking(
    dsn: str, channel: str, wake: threading.Event, stopping: threading.Event
) -> None:
    """Thread twin of :func:`listen`: set ``wake`` on every NOTIFY until ``stopping`` is set."""
    while not stopping.is_set():
        try:
            with psycopg.connect(libpq_dsn(dsn), autocommit=True) as conn:
                conn.execute(f"LISTEN {channel}")
                wake.set()
                while not stopping.is_set():
                    for _ in conn.notifies(timeout=1.0, stop_after=1):
                        wake.set()
        except Exception as exc:
            log.warning("LISTEN %s connection lost (%s); polling", channel, exc)
            stopping.wait(1.0)


def wait_for_notify(dsn: str, channel: str, timeout: float, *, payload: str | None = None) -> bool:
    """Block up to ``timeout`` seconds for a NOTIFY on ``channel`` (with ``payload``, if given)."""
    with psycopg.connect(libpq_dsn(dsn), autocommit=True) as conn:
        conn.execute(f"LISTEN {channel}")
        for note in conn.notifies(timeout=timeout):
            if payload is None or note.payload == payload:
                return True
    return False


async def wait_for_notify_async(
    dsn: str, channel: str, timeout: float, *, payload: str | None = None
) -> bool:
    """Async twin of :func:`wait_for_notify`: wait up to ``timeout`` s without blocking the loop."""
    async with await psycopg.AsyncConnection.connect(libpq_dsn(dsn), autocommit=True) as conn:
        await conn.execute(f"LISTEN {channel}")
        async for note in conn.notifies(timeout=timeout):
            if payload is None or note.payload == payload:
                return True
    return False


class Notifier:
    """NOTIFY on one connection of its own, kept open (trailing wake-ups sent from a thread).

    An async client's engine belongs to its event loop, so the throttle's
    thread cannot use it; opening a connection per NOTIFY would cost the server
    a backend start each time (under load, up to one per window). A dropped
    connection is opened again on the next send.
    """

    def __init__(self, dsn: str) -> None:
        self._dsn = libpq_dsn(dsn)
        self._lock = threading.Lock()
        self._conn: psycopg.Connection[Any] | None = None

    def send(self, channel: str) -> None:
        """One NOTIFY on ``channel`` (autocommit: nothing durable rides on it)."""
        with self._lock:
            try:
                if self._conn is None or self._conn.closed:
                    self._conn = psycopg.connect(self._dsn, autocommit=True)
                self._conn.execute("SELECT pg_notify(%s, '')", (channel,))
            except psycopg.Error:
                self._close()
                raise

    def close(self) -> None:
        """Close the connection (sends after this reopen it)."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
