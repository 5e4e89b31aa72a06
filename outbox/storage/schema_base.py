"""What every table definition shares: the ``MetaData``, the shard column, timestamps."""

from __future__ import annotations

from sqlalchemy import Column, DateTime, MetaData, SmallInteger, func

__all__ = ["SHARD_OF_ID", "SHARD_OF_RUN", "metadata", "shard_column", "timestamp"]

metadata = MetaData()

#: 0023: every run-scoped table carries its run's logical shard (outbox.shards):
#: on Citus the column the tables are distributed by. Keys include it (last, so
#: that a lookup by id alone still uses them); a check ties it to the id it is
#: read from, so a hand-written row cannot land on another run's shard.
SHARD_OF_ID = "shard = outbox_shard_of(id)"
SHARD_OF_RUN = "shard = outbox_shard_of(run_id)"


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
