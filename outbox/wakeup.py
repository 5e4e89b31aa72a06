"""Wake-ups for deliverers and workers without a NOTIFY per commit.

PostgreSQL serialises the commits of every transaction that ran ``NOTIFY`` on
one global lock. Measured with pgbench on this kind of machine, 8 writers drop
from about 12.8k to 5.1k transactions/s when each one notifies. So a writing
process sends at most one NOTIFY per ``window`` inline with a commit (the
leading edge: a trickle of intents is signalled with no delay at all), and when
it skipped one it sends a single trailing NOTIFY after the window, outside any
transaction, once the skipped commits are durable. Every committed intent is
therefore followed by a NOTIFY within ``window`` of its commit; under load the
extra notifies are at most one per window per process.

A NOTIFY is only a hint: listeners always keep a poll as the backstop, because
notifications are lost when a listener's connection drops.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

import psycopg

__all__ = ["WakeupThrottle", "listen"]

log = logging.getLogger(__name__)


class WakeupThrottle:
    """Decides, per commit, whether to NOTIFY inline, and sends trailing notifies.

    Call :meth:`inline` before a write that creates work; include the NOTIFY in
    that transaction when it returns True. After the commit, call
    :meth:`committed` with that answer. ``send`` must issue the NOTIFY on its
    own connection (autocommit).
    """

    def __init__(self, send: Callable[[], None], *, window_s: float) -> None:
        self._send = send
        self._window = window_s
        self._lock = threading.Lock()
        self._last = -float("inf")
        self._owed = False
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._closed = False

    def inline(self) -> bool:
        """True when this commit should carry the NOTIFY itself."""
        now = time.monotonic()
        with self._lock:
            if now - self._last >= self._window:
                self._last = now
                return True
            return False

    def committed(self, notified_inline: bool) -> None:
        """Record a commit that created work; owe a trailing NOTIFY if it carried none."""
        if notified_inline:
            return
        with self._lock:
            if self._closed:
                return
            self._owed = True
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._trail, name="outbox-wakeup", daemon=True
                )
                self._thread.start()
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
                while not self._owed and not self._closed:
                    self._wake.wait()
                if not self._owed:
                    return
                delay = self._last + self._window - time.monotonic()
            if delay > 0 and not self._closed:
                time.sleep(delay)
            with self._lock:
                self._owed = False
                self._last = time.monotonic()
            try:
                self._send()
            except Exception:  # the poll backstop covers a lost hint
                log.warning("trailing NOTIFY failed; listeners fall back to polling", exc_info=True)


async def listen(dsn: str, channel: str, wake: asyncio.Event) -> None:
    """Set ``wake`` on every NOTIFY on ``channel``, reconnecting forever (cancel to stop).

    While the connection is down the caller's poll is the only wake-up; on
    reconnect ``wake`` is set once, for anything committed in between.
    """
    backoff = 0.1
    while True:
        try:
            conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
            async with conn:
                await conn.execute(f"LISTEN {channel}")
                backoff = 0.1
                wake.set()
                async for _ in conn.notifies():
                    wake.set()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("LISTEN %s connection lost (%s); polling until it is back", channel, exc)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)
