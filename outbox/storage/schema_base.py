"""What every table definition shares: the ``MetaData``, the shard column, timestamps."""

from __future__ import annotations

from sqlalchemy import Column, DateTime, MetaData, SmallInteger, func

__all__ = [
    "SHARD_OF_ID",
    "SHARD_OF_RUN",
    "key_shard_check",
    "metadata",
    "shard_check",
    "shard_column",
    "timestamp",
]

metadata = MetaData()


def shard_check(id_sql: str) -> str:
    """The check that ties a row's ``shard`` to the id it is read from (0023).

    Every run-scoped table carries its run's logical shard (outbox.shards): on
    Citus the column the tables are distributed by. Keys include it (last, so
    that a lookup by id alone still uses them); this check ties it to its id, so
    a hand-written row cannot land on another run's shard.

    outbox_shard_of's body written out (0045), not a call: PostgreSQL prepares a
    table's checks for every statement that writes it, and a call of a SQL
    function is inlined there, its body parsed again from text each time (about
    5 % of the server's CPU for a step, which writes three such tables). Written
    out, the check is stored bound to the built-ins it names, read in no
    session's search path.
    """
    return (
        f"shard = (pg_catalog.get_byte(pg_catalog.uuid_send({id_sql}), 15)"
        " OPERATOR(pg_catalog.&) 31)::smallint"
    )


def key_shard_check(namespace_sql: str, key_sql: str) -> str:
    """The check that ties a caller's key's row to its shard: outbox_key_shard written out.

    As :func:`shard_check` says why; the key's shard is read from the sha256 of
    namespace, 0x1f, key as UTF-8 (backslashes doubled for ``decode``'s escape).
    """
    text = (
        f"{namespace_sql} OPERATOR(pg_catalog.||) pg_catalog.chr(31)"
        f" OPERATOR(pg_catalog.||) {key_sql}"
    )
    utf8 = (
        f"pg_catalog.decode(pg_catalog.replace({text}, pg_catalog.chr(92),"
        " pg_catalog.chr(92) OPERATOR(pg_catalog.||) pg_catalog.chr(92)), 'escape')"
    )
    return (
        f"shard = (pg_catalog.get_byte(pg_catalog.sha256({utf8}), 31)"
        " OPERATOR(pg_catalog.&) 31)::smallint"
    )


SHARD_OF_ID = shard_check("id")
SHARD_OF_RUN = shard_check("run_id")


def shard_column() -> Column[int]:
    """The ``shard`` column (``outbox.shards``)."""
    return Column("shard", SmallInteger, nullable=False)


def timestamp(name: str, *, nullable: bool = True, default_now: bool = False) -> Column[object]:
    """A ``timestamptz`` column, ``now()`` by default when asked."""
    return Column(
        name,
        DateTime(timezone=True),
        nullable=nullable,
        server_default=func.now() if default_now else None,
    )
