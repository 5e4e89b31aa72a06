"""DSNs: the one form we take, and what every session of ours asks of the server.

A DSN is a ``postgresql://`` URL (SQLAlchemy's on psycopg 3 for the engines,
libpq's for the psycopg connections a deliverer opens itself); both keep the
DSN's own ``options`` and add ours after them (:func:`session_args`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, urlencode

import psycopg
import sqlalchemy.exc
from sqlalchemy.engine import URL, make_url

from outbox.errors import ConfigurationError

__all__ = [
    "ISO_DATES",
    "iso_dates_needed",
    "libpq_dsn",
    "psycopg_url",
    "redacted_dsn",
    "session_args",
]

#: psycopg reads a timestamp sent as text only in the ISO date style. Sent after
#: connecting, not as a startup option: that would replace the database's or
#: role's day/month order too ('SQL, DMY' becomes 'ISO, MDY', not 'ISO, DMY').
ISO_DATES = "SET DateStyle = ISO"


def iso_dates_needed(info: psycopg.ConnectionInfo) -> bool:
    """Whether a new session's date style (reported at connection) is not ISO already."""
    return not (info.parameter_status("DateStyle") or "ISO").startswith("ISO")


DSN_FORM = "expected postgresql://user:password@host:port/database (OUTBOX_DSN or --dsn)"
POSTGRES_DRIVERS = frozenset(
    {"postgresql", "postgres", "postgresql+psycopg", "postgresql+psycopg2"}
)


def psycopg_url(dsn: str | URL) -> URL:
    """A SQLAlchemy URL on psycopg 3 for any ``postgresql://`` DSN."""
    try:
        url = make_url(dsn) if isinstance(dsn, str) else dsn
    except (sqlalchemy.exc.ArgumentError, ValueError):
        # Not repeated: a mangled DSN may still hold a password. (A port list,
        # libpq's "@a:5432,b:5433", is a ValueError: SQLAlchemy's form is the query's.)
        raise ConfigurationError(f"dsn is not a URL; {DSN_FORM}") from None
    if url.drivername not in POSTGRES_DRIVERS:
        raise ConfigurationError(f"dsn names {url.drivername!r}, not PostgreSQL; {DSN_FORM}")
    if url.drivername in ("postgresql", "postgres", "postgresql+psycopg2"):
        url = url.set(drivername="postgresql+psycopg")
    return url


def redacted_dsn(dsn: str) -> str:
    """The DSN with its password masked (``***``), to print it."""
    try:
        return make_url(dsn).render_as_string(hide_password=True)
    except (sqlalchemy.exc.ArgumentError, ValueError):  # not a URL: show nothing of it
        return "<your DSN>"


def libpq_dsn(dsn: str | URL) -> str:
    """A plain libpq DSN (what psycopg.connect takes) for a SQLAlchemy URL or DSN."""
    url = make_url(dsn) if isinstance(dsn, str) else dsn
    # Written here, not by SQLAlchemy: it leaves a space in a name, password or
    # database bare (libpq refuses it) and writes one in a query value as "+", a
    # plus sign to libpq ("-c+search_path=...")
    auth = "" if url.username is None else quote(url.username, safe="")
    if url.password is not None:
        auth += ":" + quote(str(url.password), safe="")
    where = URL.create("postgresql", host=url.host, port=url.port).render_as_string()
    plain = where.replace("//", f"//{auth}@" if auth else "//", 1)
    if url.database is not None:
        plain += "/" + quote(url.database, safe="")
    query = dict(url.query)
    if "options" in query:
        query["options"] = _given_options(url)
    # SQLAlchemy's form of several servers, ?host=a:5432&host=b:5433, is libpq's
    # host=a,b&port=5432,5433
    if isinstance(hosts := query.get("host"), tuple) and "port" not in query:
        split = [h.rsplit(":", 1) if h.rsplit(":", 1)[-1].isdigit() else [h, ""] for h in hosts]
        query["host"] = ",".join(h for h, _ in split)
        if any(port for _, port in split):
            query["port"] = ",".join(port for _, port in split)
    text = urlencode(query, doseq=True, quote_via=quote)
    return f"{plain}?{text}" if text else plain


def _given_options(url: URL) -> str:
    """The DSN's own ``options``, every one given: libpq would keep only the last."""
    given = url.query.get("options", "")
    return " ".join(given) if isinstance(given, tuple) else given


def session_args(
    url: URL,
    idle_in_transaction_ms: int,
    application_name: str,
    session_settings: Mapping[str, Any] | None = None,
    *,
    read_committed: bool = False,
) -> dict[str, str]:
    """Libpq parameters for every session of ours, an engine's or a psycopg connection's.

    Ours come after the DSN's own ``options`` (which this argument would
    otherwise replace): a user's ``-c search_path=...`` still holds. Standard
    strings: the migrations and functions write backslashes as SQL does.
    ``read_committed``: for sessions that run no caller's SQL (a deliverer's,
    a relay's), whatever isolation the database defaults to: their claims are
    written for it, and under SERIALIZABLE each would fail now and then.
    """
    options = _given_options(url)
    options += f" -c idle_in_transaction_session_timeout={idle_in_transaction_ms}"
    options += " -c standard_conforming_strings=on"
    if read_committed:
        options += r" -c default_transaction_isolation=read\ committed"
    for name, value in (session_settings or {}).items():
        options += f" -c outbox.{name}={value}"
    args = {"options": options, "application_name": application_name}
    # libpq's default is the server's encoding: on SQL_ASCII (which stores the UTF-8
    # bytes it is sent) psycopg would hand back bytes, not text (a TypeError at once)
    if "client_encoding" not in url.query:
        args["client_encoding"] = "UTF8"
    return args
