"""Scratch databases on a server: a migrated template and throw-away clones of it.

``outbox check`` and the test suite make one database per trial, cloned from
a template migrated once (``CREATE DATABASE ... TEMPLATE``: a file copy, tens
of milliseconds), and drop them all at the end. The role behind the DSN needs
the ``CREATEDB`` privilege.
"""

from __future__ import annotations

import itertools
import secrets

import psycopg
from psycopg import sql
from sqlalchemy.engine import make_url

from outbox.errors import DatabaseError
from outbox.storage.dsn import libpq_dsn
from outbox.storage.engine import make_engine
from outbox.storage.migrate import migrate

__all__ = ["ScratchDatabases", "dsn_for_database"]


def dsn_for_database(dsn: str, database: str) -> str:
    """The same server and role, another database."""
    url = make_url(dsn).set(database=database)
    return url.render_as_string(hide_password=False)


class ScratchDatabases:
    """Databases ``<prefix>_<random>_<n>`` on the server of ``dsn``, dropped by :meth:`drop_all`.

    ``dsn`` may name any database the role can connect to: statements that
    create and drop databases run there.
    """

    def __init__(self, dsn: str, prefix: str = "outbox_check") -> None:
        self._dsn = dsn
        self._base = f"{prefix}_{secrets.token_hex(4)}"
        self._counter = itertools.count(1)
        self._made: list[str] = []
        self._template: str | None = None

    def _admin(self) -> psycopg.Connection[tuple[object, ...]]:
        try:
            return psycopg.connect(libpq_dsn(self._dsn), autocommit=True, connect_timeout=10)
        except psycopg.Error as exc:
            raise DatabaseError(f"connecting to make scratch databases: {exc}") from exc

    def _create(self, name: str, template: str | None) -> str:
        statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template is not None:
            statement = sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(template)
            )
        try:
            with self._admin() as conn:
                conn.execute(statement)
        except psycopg.Error as exc:
            raise DatabaseError(
                f"creating scratch database {name!r} (the role needs CREATEDB): {exc}"
            ) from exc
        self._made.append(name)
        return dsn_for_database(self._dsn, name)

    def template(self) -> str:
        """Create and migrate the template (once); its DSN. Nothing may stay connected to it."""
        if self._template is None:
            name = f"{self._base}_template"
            dsn = self._create(name, None)
            engine = make_engine(dsn, pool_size=1)
            try:
                migrate(engine)
            finally:
                engine.dispose()
            self._template = name
        return dsn_for_database(self._dsn, self._template)

    def clone(self) -> str:
        """A new migrated database; its DSN."""
        self.template()
        return self._create(f"{self._base}_{next(self._counter)}", self._template)

    def drop(self, dsn: str) -> None:
        """Drop one database made here (its connections are terminated)."""
        name = make_url(dsn).database
        if name not in self._made:
            raise ValueError(f"database {name!r} was not made here")
        with self._admin() as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
        self._made.remove(name)

    def drop_all(self) -> None:
        """Drop every database made here."""
        if not self._made:
            return
        with self._admin() as conn:
            for name in reversed(self._made):
                conn.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
                )
        self._made.clear()
        self._template = None
