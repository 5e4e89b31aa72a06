"""Where a row lives: the logical shard of a run, an effect or a caller's key.

Every run-scoped table carries a ``shard`` column (one of :data:`SHARDS`, fixed
for good), read from the run's id: its steps, effects, attempts, signals,
ledger entries and large values live on it. An effect of no run lives on its
id's shard, and its id is chosen on the shard of its key (or ordering key), so
that one key's effects stay together. A caller's key is registered on the key's
own shard, within its namespace. On one PostgreSQL server this is a column and
a check constraint; on Citus it is what the tables are distributed by, so every
statement about a run touches one shard (``docs/howto/citus.md``).

The SQL functions ``outbox_shard_of``, ``outbox_key_shard`` and
``outbox_on_shard`` (``outbox/storage/functions/shards.sql``) compute the same.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence

__all__ = [
    "DEFAULT_NAMESPACE",
    "NAMESPACE_PATTERN",
    "SHARDS",
    "key_shard",
    "on_shard",
    "shard_of",
    "sweep_shards",
]

#: The number of logical shards. Fixed for good: a run's shard is read from its id.
SHARDS = 32
#: Keys are unique within a namespace; this one when none is given.
DEFAULT_NAMESPACE = "default"
#: What a namespace may be (Settings.namespace, `outbox roles --namespace`; the
#: database refuses others: outbox_check_namespace).
NAMESPACE_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"
_MASK = SHARDS - 1


def shard_of(id: uuid.UUID) -> int:
    """The shard of a run (or of an effect of no run) with this id."""
    return id.bytes[15] & _MASK


def key_shard(namespace: str, key: str) -> int:
    """The shard a caller's key is registered on: sha256 of namespace, 0x1f, key."""
    return hashlib.sha256(f"{namespace}\x1f{key}".encode()).digest()[31] & _MASK


def on_shard(id: uuid.UUID, shard: int) -> uuid.UUID:
    """``id`` with its shard bits set to ``shard``: a new id that must live there."""
    raw = bytearray(id.bytes)
    raw[15] = (raw[15] & ~_MASK & 0xFF) | shard
    return uuid.UUID(bytes=bytes(raw))


def sweep_shards(distributed: bool) -> Sequence[int | None]:
    """What a sweep visits, a statement each: every shard on Citus, else ``None`` (the table)."""
    return range(SHARDS) if distributed else [None]
