"""Helpers shared by tests: a delivery daemon running in a thread, polling until a condition."""

from __future__ import annotations

import ast
import asyncio
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from sqlalchemy.engine import make_url

from outbox.delivery import Deliverer
from outbox.delivery.daemon import DeliveryDaemon
from outbox.delivery.settings import DeliverySettings
from outbox.delivery.sources import EffectSource
from outbox.storage.async_store import AsyncStore
from outbox.storage.engine import make_async_engine

T = TypeVar("T")


class DaemonThread:
    """A real DeliveryDaemon on its own event loop in a background thread.

    ``source`` builds the daemon's source from its store (default: poll), and
    ``companions`` other daemons (a relay) run on the same loop until it stops.
    """

    def __init__(
        self,
        dsn: str,
        deliverers: Mapping[str, Deliverer],
        *,
        settings: DeliverySettings | None = None,
        source: Callable[[AsyncStore], EffectSource] | None = None,
        companions: Callable[[AsyncStore], list[Any]] | None = None,
        **fields: Any,
    ) -> None:
        self.dsn = dsn
        self.deliverers = deliverers
        self.settings = settings or DeliverySettings(**fields)
        self._source = source
        self._companions = companions
        self.daemon: DeliveryDaemon | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)
        self.error: BaseException | None = None

    def _main(self) -> None:
        async def main() -> None:
            store = AsyncStore(make_async_engine(self.dsn))
            source = None if self._source is None else self._source(store)
            self.daemon = DeliveryDaemon(store, self.deliverers, self.settings, source=source)
            others = [] if self._companions is None else self._companions(store)
            self._loop = asyncio.get_running_loop()
            self._ready.set()
            tasks = [asyncio.create_task(other.run()) for other in others]
            try:
                await self.daemon.run()
            finally:
                for other in others:
                    other.stop()
                await asyncio.gather(*tasks, return_exceptions=True)
                await store.dispose()

        try:
            asyncio.run(main())
        except BaseException as exc:  # surfaced by stop()
            self.error = exc
            self._ready.set()

    def __enter__(self) -> DaemonThread:
        self._thread.start()
        assert self._ready.wait(30)
        return self

    def stop(self, timeout: float = 60) -> None:
        if self._loop is not None and self.daemon is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self.daemon.stop)
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "daemon did not stop"
        if self.error is not None:
            raise self.error

    def __exit__(self, *exc: object) -> None:
        self.stop()


def parse_python(source: str) -> ast.Module:
    """``ast.parse``, tried again on CPython 3.11's spurious recursion-depth error.

    3.11 keeps the AST converter's depth count in state shared by the threads, so
    a thread switch mid-conversion can end in ``SystemError: AST constructor
    recursion depth mismatch`` (python/cpython#106905); it failed a docs test once.
    """
    for _ in range(2):
        try:
            return ast.parse(source)
        except SystemError as exc:
            if "recursion depth mismatch" not in str(exc):
                raise
    return ast.parse(source)


def wait_for(
    condition: Callable[[], T],
    timeout: float = 30.0,
    interval: float = 0.02,
    message: str = "condition",
) -> T:
    """Poll ``condition`` until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        time.sleep(interval)


class WorkerThread:
    """A real Worker (``ob.worker(...)``) running in a background thread."""

    def __init__(
        self, outbox: Any, agent: str, version: str, handler: Callable[..., Any], **settings: Any
    ) -> None:
        settings.setdefault("sweep_seconds", 0.05)
        settings.setdefault("poll_seconds", 0.2)
        self.worker = outbox.worker(agent, version, handler, **settings)
        self._thread = threading.Thread(target=self._main, daemon=True)
        self.error: BaseException | None = None

    def _main(self) -> None:
        try:
            self.worker.run()
        except BaseException as exc:
            self.error = exc

    def __enter__(self) -> WorkerThread:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.worker.stop()
        self._thread.join(60)
        assert not self._thread.is_alive(), "worker did not stop"
        if self.error is not None:
            raise self.error


def lock_waiters(dsn: str, application_name: str | None = None) -> list[int]:
    """Pids of the backends of ``dsn``'s database waiting on a lock (of one application)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock'"
            " AND (%(app)s::text IS NULL OR application_name = %(app)s::text)",
            {"app": application_name},
        ).fetchall()
    return [row[0] for row in rows]


@contextmanager
def limited_role(dsn: str, *revoke: str) -> Iterator[str]:
    """Every new session on ``dsn``'s database runs as a role that lacks ``revoke`` privileges.

    The role may read and write every table (as a deliverer's role would)
    except what ``revoke`` takes away, each an SQL fragment such as
    ``"UPDATE ON outbox_runs"``. It applies to sessions opened from now on,
    subprocesses included (``ALTER DATABASE ... SET role``), so no login or
    password is involved. Yields the role's name.
    """
    database = make_url(dsn).database
    role = f"limited_{database}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} NOLOGIN")
        conn.execute(f"GRANT USAGE ON SCHEMA public TO {role}")
        conn.execute(
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}"
        )
        conn.execute(f"GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO {role}")
        for privilege in revoke:
            conn.execute(f"REVOKE {privilege} FROM {role}")
        conn.execute(f"ALTER DATABASE {database} SET role = '{role}'")
    try:
        yield role
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SET ROLE NONE")
            conn.execute(f"ALTER DATABASE {database} RESET role")
            conn.execute(f"DROP OWNED BY {role}")
            conn.execute(f"DROP ROLE {role}")


def in_flight(dsn: str, owner: str) -> set[uuid.UUID]:
    """The effects in flight under ``owner``'s lease, as the database has them."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT id FROM outbox_effects WHERE status = 'in_flight' AND lease_owner = %s",
            [owner],
        ).fetchall()
    return {row[0] for row in rows}


def as_superuser(dsn: str, sql: str, params: Any = None) -> list[Any]:
    """Rows of ``sql`` run on a new connection as the session's own (super)user."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET ROLE NONE")
        cursor = conn.execute(sql, params)
        return cursor.fetchall() if cursor.description else []


def embedded_home(prefix: str = "outbox-test-home-") -> Path:
    """A new directory for an embedded server, which its OS user can enter.

    Run as root, the server runs as another user, and agent-outbox does not
    loosen directories it did not make: a test's own directory is opened here.
    """
    home = Path(tempfile.mkdtemp(prefix=prefix))
    home.chmod(0o711)
    return home


def delivery_plan_modes(dsn: str, connections: int = 4) -> list[str]:
    """``plan_cache_mode`` of a delivery store's connections, opened all at once at its start."""

    async def modes() -> list[str]:
        store = AsyncStore(make_async_engine(dsn))
        barrier = asyncio.Barrier(connections)  # each holds its connection till all are open

        async def one() -> str:
            async with store._direct.connection() as conn:
                await barrier.wait()
                cur = await conn.execute("SELECT current_setting('plan_cache_mode') AS m")
                row = await cur.fetchone()
                assert row is not None
                return str(row["m"])

        try:
            return list(await asyncio.gather(*(one() for _ in range(connections))))
        finally:
            await store.dispose()

    return asyncio.run(modes())
