"""libpq_dsn: what libpq reads from it is what the DSN said, and so is what SQLAlchemy reads.

The deliverer's LISTEN, owner-lock and claim sessions connect with it. SQLAlchemy's
own rendering wrote a space in a query value as "+" (a plus sign to libpq: the
server was asked for "-c+search_path") and left a space in a name or password bare
(libpq refuses it).
"""

from __future__ import annotations

from urllib.parse import quote

import pytest
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy.engine import make_url

from outbox.storage.dsn import libpq_dsn

PASSWORDS = [None, "p+a ss", "a@b:c/d%e", "x#y?z&w=1", "ünï"]
#: (user, password): none, or a user with or without a password
LOGINS = [(None, None)] + [(user, pw) for user in ("postgres", "us er") for pw in PASSWORDS]
HOSTS = {"db.example:5433": "db.example", "[::1]:5432": "::1", "": "/tmp/pg sock"}


@pytest.mark.parametrize(("user", "password"), LOGINS)
@pytest.mark.parametrize("where", list(HOSTS))
def test_libpq_and_sqlalchemy_read_the_dsn_as_written(
    user: str | None, password: str | None, where: str
) -> None:
    auth = "" if user is None else quote(user, safe="")
    if password is not None:
        auth += ":" + quote(password, safe="")
    query = "options=-c%20search_path%3Dagents%20-c%20lock_timeout%3D5s&application_name=a%2Bb%20c"
    if not where:
        query += "&host=" + quote(HOSTS[""], safe="")
    dsn = libpq_dsn(f"postgresql+psycopg://{auth}{'@' if auth else ''}{where}/db?{query}")

    libpq, sqlalchemy = conninfo_to_dict(dsn), make_url(dsn)
    assert (libpq.get("user"), libpq.get("password")) == (user, password)
    assert (sqlalchemy.username, sqlalchemy.password) == (user, password)
    assert libpq["host"] == HOSTS[where]
    assert libpq["dbname"] == sqlalchemy.database == "db"
    for read in (libpq, sqlalchemy.query):
        assert read["options"] == "-c search_path=agents -c lock_timeout=5s"
        assert read["application_name"] == "a+b c"
