"""What a database's encoding must be: its text the UTF-8 bytes its clients hash."""

from __future__ import annotations

from outbox.errors import ConfigurationError

__all__ = ["UTF8_ENCODINGS", "refuse_server_encoding"]

#: Encodings whose text is its UTF-8 bytes: UTF8, and SQL_ASCII (which stores the
#: bytes a client sends, UTF-8 from every outbox client) as convert_to did.
UTF8_ENCODINGS = ("UTF8", "SQL_ASCII")


def refuse_server_encoding(encoding: str) -> None:
    """Refuse a database whose text is not UTF-8 before anything is written to it.

    The hash chains and derived keys hash text as UTF-8 (as Python does), and the
    functions that do it take the database's own bytes as that (outbox_utf8 in
    ``functions/shards.sql``), which is what lets PostgreSQL inline them.
    """
    if encoding.upper() in UTF8_ENCODINGS:
        return
    raise ConfigurationError(
        f"the database's encoding is {encoding}: agent-outbox needs a UTF8 database "
        "(CREATE DATABASE ... ENCODING 'UTF8' TEMPLATE template0, with a UTF-8 or C "
        "locale; pg_dump and restore into one to move an existing database)"
    )
