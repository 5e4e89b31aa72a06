"""The smaller tables: caller's keys, values by reference, gates, rate limits, registries.

Defined on the same ``MetaData`` as the run tables (``outbox.storage.schema``,
which re-exports them).
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Float,
    ForeignKeyConstraint,
    Index,
    PrimaryKeyConstraint,
    Table,
    Text,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, UUID

from outbox.storage.schema_base import (
    key_shard_check,
    metadata,
    shard_check,
    shard_column,
    timestamp,
)

__all__ = [
    "blob_refs",
    "blobs",
    "consumed_keys",
    "effect_keys",
    "gates",
    "owners",
    "rate_limits",
    "run_keys",
    "webhook_replays",
]

webhook_replays = Table(
    "outbox_webhook_replays",
    metadata,
    Column("signature", Text, primary_key=True),
    timestamp("seen_at", nullable=False, default_now=True),
)

# 0012: delivery daemons that hold their owner's session lock (outbox.storage.owner_lock)
owners = Table(
    "outbox_owners",
    metadata,
    Column("owner", Text, primary_key=True),
    timestamp("registered_at", nullable=False, default_now=True),
)

# Cost settlement of costly intents: see migration 0002 for why it is a trigger (0010:
# a rejected intent releases its reservation). plpgsql resolves the ledger only when
# the trigger runs, so the effects table is enough.

# 0003: idempotency keys a Kafka consumer group has processed (deliverers.kafka.DedupConsumer)
consumed_keys = Table(
    "outbox_consumed_keys",
    metadata,
    Column("consumer_group", Text, nullable=False),
    Column("idempotency_key", Text, nullable=False),
    timestamp("consumed_at", nullable=False, default_now=True),
    PrimaryKeyConstraint("consumer_group", "idempotency_key", name="outbox_consumed_keys_pkey"),
)


# 0013: values over Settings.blob_threshold_bytes, stored once (outbox.blobs). Rows hold a
# reference; blob_refs says which run (or run-less effect) uses which blob, so
# `outbox gc` can delete the blobs nothing uses once their owners are gone.
blobs = Table(
    "outbox_blobs",
    metadata,
    Column("sha256", Text, nullable=False),
    Column("bytes", BigInteger, nullable=False),
    Column("data", Text, nullable=False),
    timestamp("created_at", nullable=False, default_now=True),
    # refreshed by the writes that used it until 0042 (a confined login cannot update
    # a row its policies hide); the insert's trigger now holds it for a writer, so gc
    # skips it until the writer's reference is there
    timestamp("used_at", nullable=False, default_now=True),
    # 0023: stored once per shard, beside the rows that use it
    shard_column(),
    # 0042: the mark of the transaction that wrote it (outbox_write_mark, set by a
    # trigger): the policies show a login confined to a namespace what it wrote
    Column("written_in", UUID(as_uuid=True)),
    PrimaryKeyConstraint("sha256", "shard", name="outbox_blobs_pkey"),
)
blob_refs = Table(
    "outbox_blob_refs",
    metadata,
    # a run id, or the id of an effect that belongs to no run
    Column("owner", UUID(as_uuid=True), nullable=False),
    Column("sha256", Text, nullable=False),
    shard_column(),
    Column("written_in", UUID(as_uuid=True)),  # as outbox_blobs.written_in
    PrimaryKeyConstraint("owner", "sha256", "shard", name="outbox_blob_refs_pkey"),
    ForeignKeyConstraint(
        ["sha256", "shard"],
        ["outbox_blobs.sha256", "outbox_blobs.shard"],
        name="outbox_blob_refs_sha256_fkey",
    ),
    CheckConstraint(shard_check("owner"), name="outbox_blob_refs_shard_check"),
)
Index("outbox_blob_refs_sha256", blob_refs.c.sha256)

# 0023: a caller's key names one run, or one effect, in its namespace, across every
# shard: it is registered on the key's own shard (outbox_key_shard), as a unique
# index there. Where the key's shard is not its owner's, an effect's key has a
# second row on its owner's shard (mirror), which the step write checks there.
run_keys = Table(
    "outbox_run_keys",
    metadata,
    Column("namespace", Text, nullable=False),
    Column("key", Text, nullable=False),
    shard_column(),
    Column("run_id", UUID(as_uuid=True), nullable=False),
    PrimaryKeyConstraint("namespace", "key", "shard", name="outbox_run_keys_pkey"),
    CheckConstraint(key_shard_check("namespace", "key"), name="outbox_run_keys_shard_check"),
)
effect_keys = Table(
    "outbox_effect_keys",
    metadata,
    Column("namespace", Text, nullable=False),
    Column("key", Text, nullable=False),
    shard_column(),
    Column("effect_id", UUID(as_uuid=True), nullable=False),
    Column("run_id", UUID(as_uuid=True)),
    Column("kind", Text, nullable=False),
    Column("payload_hash", Text, nullable=False),
    # false: the key's own row (on its shard); true: the copy on its owner's shard
    Column("mirror", Boolean, nullable=False, server_default=text("false")),
    PrimaryKeyConstraint("namespace", "key", "shard", name="outbox_effect_keys_pkey"),
    CheckConstraint(
        f"mirror OR {key_shard_check('namespace', 'key')}",
        name="outbox_effect_keys_shard_check",
    ),
)

# 0013: a kind's declared rate (calls per second), shared by every deliverer process:
# the theoretical arrival time of the next call (GCRA), moved on by each claim.
rate_limits = Table(
    "outbox_rate_limits",
    metadata,
    Column("kind", Text, primary_key=True),
    timestamp("tat", nullable=False),
)

# 0010: approval gates from the deliverers config (``outbox gates apply``); the
# statement that writes an intent evaluates them (``outbox.governance.gates``)
gates = Table(
    "outbox_gates",
    metadata,
    Column("name", Text, primary_key=True),
    Column("kind", Text, nullable=False),
    Column("conditions", JSONB, nullable=False, server_default=text("'[]'::jsonb")),
    Column("timeout_seconds", Float),
    Column("on_timeout", Text, nullable=False, server_default=text("'reject'")),
    Column("escalate_to", Text),
    timestamp("updated_at", nullable=False, default_now=True),
    CheckConstraint(
        "on_timeout IN ('reject', 'cancel_run', 'escalate')", name="outbox_gates_on_timeout_check"
    ),
)
Index("outbox_gates_kind", gates.c.kind)
