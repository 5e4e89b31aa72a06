"""A daemon's start-up survives its first connection being cut once the server took it.

A deliverer starting while a fault drill (or a failover) terminates every
backend can lose the connection SQLAlchemy has just opened, in the middle of
its first queries, with no SQLSTATE: "server closed the connection
unexpectedly". That is a connection lost, to be tried again at start-up, not a
server that cannot be reached (which is said at once): the chaos test that
terminates every backend saw a deliverer exit on it.

A real proxy in front of the test server cuts the first connection after the
server accepted it, when the engine's connect hook sends its query.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from outbox.cli._common import retried_at_startup
from outbox.errors import DatabaseError
from outbox.storage.engine import make_engine, translate_errors

#: The query our engines' connect hook sends on a new connection (the database's
#: layout): an error there is raised out of the pool's connect, where SQLAlchemy
#: does not mark the connection invalidated.
CUT_AT = b"outbox.distributed"


class _CutFirstQuery:
    """TCP in front of the server's Unix socket; the first connection is cut when
    it sends the query that holds :data:`CUT_AT`."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            server = socket.socket(socket.AF_UNIX)
            server.connect(self.socket_path)
            cut = self.connections == 1
            threading.Thread(target=self._pipe, args=(client, server, cut), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, target: socket.socket, cut: bool) -> None:
        try:
            while data := source.recv(65536):
                if cut and CUT_AT in data:  # both ends go, the query unanswered
                    source.close()
                    target.close()
                    return
                target.sendall(data)
        except OSError:
            pass
        for end in (source, target):
            end.close()

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def cut_dsn(dsn: str) -> Iterator[str]:
    url = make_url(dsn)
    host = str(url.query["host"])
    proxy = _CutFirstQuery(str(Path(host) / f".s.PGSQL.{url.port or 5432}"))
    try:
        # no SSL or GSS request first: the startup packet is the first message
        yield (
            f"postgresql://{url.username}@127.0.0.1:{proxy.port}/{url.database}"
            "?sslmode=disable&gssencmode=disable"
        )
    finally:
        proxy.close()


def _check(dsn: str) -> int:
    engine = make_engine(dsn, pool_size=1)
    try:
        with translate_errors("checking the schema"), engine.connect() as conn:
            return int(conn.execute(text("SELECT 1")).scalar_one())
    finally:
        engine.dispose()


def test_a_connection_cut_at_its_first_query_is_lost_not_unreachable(cut_dsn: str) -> None:
    with pytest.raises(DatabaseError) as cut:
        _check(cut_dsn)
    assert cut.value.sqlstate is None
    assert cut.value.connection_lost and cut.value.transient, str(cut.value)
    assert _check(cut_dsn) == 1  # the next connection goes through


def test_a_daemons_start_up_tries_again_after_its_first_connection_is_cut(
    cut_dsn: str,
) -> None:
    assert retried_at_startup("checking the database", lambda: _check(cut_dsn)) == 1


def test_a_server_not_there_still_fails_start_up_at_once() -> None:
    with socket.create_server(("127.0.0.1", 0)) as free:
        port = free.getsockname()[1]  # closed again below: nothing listens there
    with pytest.raises(DatabaseError) as refused:
        retried_at_startup(
            "checking the database",
            lambda: _check(f"postgresql://postgres@127.0.0.1:{port}/outbox?connect_timeout=2"),
        )
    assert not refused.value.connection_lost
