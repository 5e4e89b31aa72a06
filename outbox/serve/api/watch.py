"""Long polls on effects: many waiters, one query per poll, nothing held when a waiter leaves.

An effect's end is not announced (deliverers NOTIFY only runs parked on it),
so awaited effects are polled; one task on the server's event loop asks for
every awaited id at once (:meth:`Store.finished_effects`), so a hundred
waiters cost one indexed query per poll, not a hundred. A waiter is a future
in a dict: a client that goes away (or a wait that runs out) removes it, and
the poller stops once nobody waits. Waiting writes nothing: an HTTP long poll
is a read, unlike ``Run.await_effect``, which records its wait as a step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from uuid import UUID

from starlette.concurrency import run_in_threadpool

from outbox.errors import OutboxError
from outbox.models import Effect

__all__ = ["EffectWatch", "TooManyWaiters"]

log = logging.getLogger("outbox.serve")


class TooManyWaiters(Exception):
    """More long polls at once than the server allows."""


class EffectWatch:
    """Awaits effects' ends for any number of waiters on one event loop.

    ``load(ids)`` returns those of ``ids`` that have ended (a blocking call; it
    runs in the thread pool). At most ``max_waiters`` waits at once: the rest
    are refused (:class:`TooManyWaiters`), so long polls cannot take every
    request slot of the server.
    """

    def __init__(
        self,
        load: Callable[[Sequence[UUID]], list[Effect]],
        *,
        interval: float,
        max_waiters: int,
    ) -> None:
        self._load = load
        self.interval = interval
        self.max_waiters = max_waiters
        self._waiters: dict[UUID, set[asyncio.Future[Effect | None]]] = {}
        self._count = 0
        self._released = False
        self._poller: asyncio.Task[None] | None = None
        #: Polls made so far (for tests and curiosity).
        self.polls = 0

    @property
    def waiting(self) -> int:
        """Waits in progress."""
        return self._count

    def release(self) -> None:
        """End every wait now, and every later one at once (the server is stopping).

        Called on the event loop. A released wait returns ``None``, as if it
        had run out, so its client gets an answer instead of a cut connection.
        """
        self._released = True
        for waiters in self._waiters.values():
            for future in waiters:
                if not future.done():
                    future.set_result(None)

    async def wait(self, effect_id: UUID, timeout: float) -> Effect | None:
        """The effect once it has ended, or ``None`` when ``timeout`` seconds pass first.

        Cancelling the call (the client went away) leaves nothing behind.
        """
        if self._released:
            return None
        if self._count >= self.max_waiters:
            raise TooManyWaiters(
                f"{self._count} long polls in progress (at most {self.max_waiters})"
            )
        future: asyncio.Future[Effect | None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(effect_id, set()).add(future)
        self._count += 1
        try:
            if self._poller is None:
                self._poller = asyncio.create_task(self._poll(), name="outbox-effect-watch")
            try:
                return await asyncio.wait_for(future, timeout)
            except TimeoutError:
                return None
        finally:
            self._count -= 1
            waiters = self._waiters.get(effect_id)
            if waiters is not None:
                waiters.discard(future)
                if not waiters:
                    del self._waiters[effect_id]

    async def _poll(self) -> None:
        try:
            while self._waiters:
                self.polls += 1
                try:
                    ended = await run_in_threadpool(self._load, list(self._waiters))
                except OutboxError as exc:
                    # The next poll tries again; each waiter's own deadline still holds.
                    log.warning("api: checking awaited effects failed: %s", exc)
                    ended = []
                for effect in ended:
                    for future in self._waiters.pop(effect.id, ()):
                        if not future.done():
                            future.set_result(effect)
                if self._waiters:
                    await asyncio.sleep(self.interval)
        finally:
            # Checked and cleared with no await in between: a waiter that arrives
            # after this starts a new poller.
            self._poller = None
