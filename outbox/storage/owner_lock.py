"""The session lock a delivery daemon holds for its lease owner while it lives.

See :mod:`outbox.storage.sql.owners` for what the lock is for. The lock lives
on a connection of its own (autocommit, never in a transaction), held for the
daemon's whole life; when the connection drops (a server restart, a network
cut) it is opened again and the lock taken again, with a backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import psycopg

from outbox.retry import wait_or_wake
from outbox.storage.dsn import libpq_dsn
from outbox.storage.sql.owners import FORGET_OWNER, REGISTER_OWNER, TAKE_OWNER_LOCK

__all__ = ["OwnerLock"]

log = logging.getLogger(__name__)

#: How often an idle lock session is checked to be alive. A dropped connection
#: (a server restart, a terminated backend) is noticed at once, its socket
#: closing; this bounds a silent one, rarely, since every check is a commit.
CHECK_SECONDS = 30.0


class OwnerLock:
    """Hold ``owner``'s session lock until :meth:`close` (start with :meth:`start`)."""

    def __init__(self, dsn: str, owner: str) -> None:
        self._dsn = libpq_dsn(dsn)
        self.owner = owner
        #: Set while the lock is held and the owner registered.
        self.held = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start taking and keeping the lock in the background."""
        self._task = asyncio.create_task(self._keep(), name="owner-lock")

    async def wait_held(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the lock; False if it is not held by then."""
        return await wait_or_wake(self.held, timeout)

    async def _keep(self) -> None:
        backoff = 0.1
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(
                    self._dsn, autocommit=True
                ) as conn:
                    row = await (await conn.execute(TAKE_OWNER_LOCK, (self.owner,))).fetchone()
                    if not (row and row[0]):
                        # Another session holds it: this owner name runs twice, or a
                        # backend of a killed process has not ended yet. Leases still
                        # protect every attempt; only early recovery is lost meanwhile.
                        log.warning(
                            "the session lock of owner %s is held by another session; trying again",
                            self.owner,
                        )
                        raise ConnectionError("owner lock held elsewhere")
                    await conn.execute(REGISTER_OWNER, (self.owner,))
                    self.held.set()
                    backoff = 0.1
                    # A dropped connection ends this wait with an error at once (the
                    # socket becomes readable); the timeout bounds a silent one.
                    try:
                        while True:
                            async for _ in conn.notifies(timeout=CHECK_SECONDS):
                                pass
                            await conn.execute("SELECT 1")
                    except asyncio.CancelledError:
                        # Stopping: its attempts are recorded, so it leaves the register
                        # (a reconciler forgets it later if this fails).
                        with contextlib.suppress(Exception):
                            await asyncio.wait_for(conn.execute(FORGET_OWNER, (self.owner,)), 2)
                        raise
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.held.clear()
                log.warning("owner lock session lost (%s); taking it again", exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    async def close(self) -> None:
        """Unregister the owner and release the lock (its attempts are all recorded by now)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self.held.clear()
