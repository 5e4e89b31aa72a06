"""libpq_dsn: what libpq reads from it is what the DSN said, and so is what SQLAlchemy reads.

The deliverer's LISTEN, owner-lock and claim sessions connect with it. SQLAlchemy's
own rendering wrote a space in a query value as "+" (a plus sign to libpq: the
server was asked for "-c+search_path") and left a space in a name or password bare
(libpq refuses it).
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

import pytest
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy.engine import make_url

from outbox.errors import ConfigurationError
from outbox.storage.admin.embedded import EmbeddedServer
from outbox.storage.dsn import libpq_dsn, psycopg_url, redacted_dsn

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


def test_a_database_name_with_a_space_reaches_libpq_whole() -> None:
    dsn = libpq_dsn("postgresql://u@h/agent%20runs")
    assert conninfo_to_dict(dsn)["dbname"] == make_url(dsn).database == "agent runs"


def test_options_given_twice_reach_libpq_both() -> None:
    """libpq keeps the last of a repeated key; the engines pass every ``options``."""
    dsn = libpq_dsn(
        "postgresql://u@h/db?options=-c%20search_path%3Dagents&options=-c%20lock_timeout%3D5s"
    )
    assert conninfo_to_dict(dsn)["options"] == "-c search_path=agents -c lock_timeout=5s"


def test_sqlalchemys_several_servers_are_libpqs_host_and_port_lists() -> None:
    dsn = libpq_dsn("postgresql://u@/db?host=a:5432&host=b:5433")
    assert {k: conninfo_to_dict(dsn)[k] for k in ("host", "port")} == {
        "host": "a,b",
        "port": "5432,5433",
    }
    no_ports = conninfo_to_dict(libpq_dsn("postgresql://u@/db?host=a&host=b"))
    assert no_ports["host"] == "a,b" and "port" not in no_ports


def test_libpqs_own_port_list_is_a_configuration_error_naming_the_form() -> None:
    with pytest.raises(ConfigurationError, match="dsn is not a URL; expected postgresql://"):
        psycopg_url("postgresql://u:secret@a:5432,b:5433/db")
    assert redacted_dsn("postgresql://u:secret@a:5432,b:5433/db") == "<your DSN>"


@pytest.mark.parametrize("home", ["outbox home", "a+b", "50%", "x&y=z", "ü"])
def test_the_embedded_servers_dsn_names_its_socket_directory_whatever_home_is_called(
    home: str, tmp_path: Path
) -> None:
    server = EmbeddedServer(tmp_path / home)
    dsn = server.dsn()
    assert make_url(dsn).query["host"] == str(server.socket_dir)
    assert conninfo_to_dict(libpq_dsn(dsn))["host"] == str(server.socket_dir)
