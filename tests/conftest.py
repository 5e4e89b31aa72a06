"""Shared fixtures: one real PostgreSQL per session, a fresh migrated database per test.

The server is the embedded one (the same the CLI uses), started in a temporary
directory. ``OUTBOX_TEST_DSN`` points the suite at another server instead (for
example one started by testcontainers where a Docker engine exists); its
database must allow ``CREATE DATABASE``. A test that needs PostgreSQL fails
when it cannot get one: it never skips.
"""

from __future__ import annotations

import itertools
import os
import shutil
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy.engine import make_url

from outbox import Outbox
from outbox.storage.admin.embedded import EmbeddedServer
from outbox.storage.engine import make_engine
from outbox.storage.migrate import migrate
from tests.support import embedded_home

TEMPLATE = "outbox_template"
_counter = itertools.count()

# Durability settings off: the suite's data is disposable, and an immediate
# restart (the chaos tests) still replays the WAL from the OS page cache.
TEST_SERVER_SETTINGS = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}


@pytest.fixture(scope="session", autouse=True)
def _no_outbox_environment() -> Iterator[None]:
    """A developer's OUTBOX_* variables must not leak into the suite (or its subprocesses)."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("OUTBOX_")}
    for name in saved:
        # Where the suite's own servers come from is not the developer's agent settings.
        if name not in ("OUTBOX_TEST_DSN", "OUTBOX_CITUS_DIR"):
            del os.environ[name]
    yield
    os.environ.update(saved)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[EmbeddedServer | None]:
    if os.environ.get("OUTBOX_TEST_DSN"):
        yield None
        return
    # Not under pytest's own temp root: a concurrent pytest session rotates that away.
    home = embedded_home("outbox-test-pg-")
    server = EmbeddedServer(home, settings=TEST_SERVER_SETTINGS)
    server.ensure_running()
    yield server
    server.stop(mode="immediate")
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def admin_dsn(pg_server: EmbeddedServer | None) -> str:
    """A DSN to the maintenance database, for CREATE/DROP DATABASE."""
    external = os.environ.get("OUTBOX_TEST_DSN")
    if external:
        return str(make_url(external).set(database="postgres").render_as_string(False))
    assert pg_server is not None
    return pg_server.dsn("postgres")


def _dsn_for(admin_dsn: str, database: str) -> str:
    url = make_url(admin_dsn).set(database=database)
    return url.render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def template_db(admin_dsn: str) -> str:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {TEMPLATE} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {TEMPLATE}")
    engine = make_engine(_dsn_for(admin_dsn, TEMPLATE))
    migrate(engine)
    engine.dispose()
    return TEMPLATE


def create_database(admin_dsn: str, template: str | None) -> str:
    """A new database (cloned from ``template`` when given); returns its DSN."""
    name = f"t_{os.getpid()}_{next(_counter)}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        clause = f" TEMPLATE {template}" if template else ""
        conn.execute(f"CREATE DATABASE {name}{clause}")
    return _dsn_for(admin_dsn, name)


def drop_database(admin_dsn: str, dsn: str) -> None:
    name = make_url(dsn).database
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


class DatabasePool:
    """Fresh clones of the template made ahead of the tests and dropped behind them.

    A clone costs about 100-250 ms of the server's time and a drop 20-30 ms; one
    thread does both while the previous test runs (most tests wait on a timer, a
    lease or a process at some point), so a test starts on a database that is
    ready. Every database is still used once.
    """

    def __init__(self, admin_dsn: str, template: str, ahead: int = 2) -> None:
        self._admin_dsn = admin_dsn
        self._template = template
        self._ahead = ahead
        # one thread: creates and drops never compete with each other
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-databases")
        self._ready: deque[Future[str]] = deque()

    def take(self) -> str:
        """A fresh database's DSN (waits for its clone if none is ready yet)."""
        while len(self._ready) < self._ahead + 1:
            self._ready.append(
                self._thread.submit(create_database, self._admin_dsn, self._template)
            )
        return self._ready.popleft().result()

    def give_back(self, dsn: str) -> None:
        """Drop ``dsn`` behind the next test (its sessions are ended by FORCE)."""
        self._thread.submit(drop_database, self._admin_dsn, dsn)

    def close(self) -> None:
        """Drop the clones made ahead and wait for every drop."""
        while self._ready:
            self._thread.submit(drop_database, self._admin_dsn, self._ready.popleft().result())
        self._thread.shutdown(wait=True)


@pytest.fixture(scope="session")
def database_pool(admin_dsn: str, template_db: str) -> Iterator[DatabasePool]:
    pool = DatabasePool(admin_dsn, template_db)
    yield pool
    pool.close()


@pytest.fixture
def dsn(database_pool: DatabasePool) -> Iterator[str]:
    """A fresh, migrated database for one test."""
    url = database_pool.take()
    yield url
    database_pool.give_back(url)


@pytest.fixture
def empty_dsn(admin_dsn: str) -> Iterator[str]:
    """A fresh database with no schema at all."""
    url = create_database(admin_dsn, None)
    yield url
    drop_database(admin_dsn, url)


@pytest.fixture
def ob(dsn: str) -> Iterator[Outbox]:
    outbox = Outbox.connect(dsn)
    yield outbox
    outbox.close()


@pytest.fixture
def sub_env(dsn: str, tmp_path: Path) -> dict[str, str]:
    """Environment for a subprocess that must use this test's database."""
    env = dict(os.environ)
    env["OUTBOX_DSN"] = dsn
    env["OUTBOX_HOME"] = str(tmp_path / "no-embedded-server-here")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


@pytest.fixture
def kafka_broker(tmp_path: Path) -> Iterator[Any]:
    """A real Kafka-protocol broker (Tansu) on a free loopback port, for one test."""
    from deliverers.testing import TansuBroker

    broker = TansuBroker(tmp_path / "tansu.log").start()
    yield broker
    broker.stop()


@pytest.fixture(scope="session")
def outbox_check_server(admin_dsn: str) -> str:
    """``outbox_check`` (the shipped pytest fixture) makes its databases on the session's server."""
    return admin_dsn
