"""Every table and index agent-outbox owns, on one SQLAlchemy ``MetaData``.

The numbered SQL files in ``outbox/storage/migrations`` create the same schema; a test
checks that a migrated database and ``metadata.create_all`` agree column by
column and index by index.

Hot indexes are partial: only claimable, leased or waiting rows sit in them, so
claim cost does not grow with the number of finished rows kept for history.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Connection,
    ForeignKeyConstraint,
    Identity,
    Index,
    Integer,
    MetaData,
    Numeric,
    PrimaryKeyConstraint,
    Sequence,
    Table,
    Text,
    UniqueConstraint,
    event,
    text,
)
from sqlalchemy.dialects.postgresql import BYTEA, JSONB, UUID

from outbox.models import (
    LIVE_RUN_STATUSES,
    NEEDS_PERSON_EFFECT_STATUSES,
    OPEN_EFFECT_STATUSES,
    STOPPING_RUN_STATUSES,
    TERMINAL_RUN_STATUSES,
    EffectStatus,
    RunStatus,
    StepStatus,
)
from outbox.storage.functions import functions_ddl
from outbox.storage.schema_base import (
    SHARD_OF_ID,
    SHARD_OF_RUN,
    metadata,
    shard_check,
    shard_column,
    timestamp,
)
from outbox.storage.sql.common import sql_in

__all__ = [
    "blob_refs",
    "blobs",
    "budget_ledger",
    "consumed_keys",
    "effect_attempts",
    "effect_keys",
    "effects",
    "gates",
    "metadata",
    "migrations",
    "owners",
    "rate_limits",
    "run_keys",
    "runs",
    "signals",
    "steps",
    "webhook_replays",
]

RUN_STATUSES = tuple(RunStatus)
EFFECT_STATUSES = tuple(EffectStatus)


migrations = Table(
    "outbox_migrations",
    metadata,
    Column("version", Integer, primary_key=True, autoincrement=False),
    Column("name", Text, nullable=False),
    Column("checksum", Text, nullable=False),
    timestamp("applied_at", nullable=False, default_now=True),
)

# 0019: the queue tables are vacuumed after a fixed number of dead rows, indexes
# always cleaned: a claim reads its partial index from the end that claimed rows
# leave dead, so it must not wait for 20% of the history to change.
QUEUE_VACUUM = {
    "autovacuum_vacuum_scale_factor": "0",
    "autovacuum_vacuum_threshold": "10000",
    "vacuum_index_cleanup": "on",
}

runs = Table(
    "outbox_runs",
    metadata,
    Column("id", UUID(as_uuid=True), nullable=False),
    Column("agent", Text, nullable=False),
    Column("agent_version", Text, nullable=False),
    Column("inputs", JSONB, nullable=False),
    Column("inputs_hash", Text, nullable=False),
    Column("status", Text, nullable=False),
    Column("state", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("plan", JSONB, nullable=False, server_default=text("'[]'::jsonb")),
    Column("result", JSONB),
    Column("error", JSONB),
    Column("budget", Numeric),
    Column("spent", Numeric, nullable=False, server_default=text("0")),
    Column("reserved", Numeric, nullable=False, server_default=text("0")),
    # claim / lease / fence (shared mechanism with effects, see outbox/queue.py)
    timestamp("available_at", nullable=False, default_now=True),
    Column("lease_owner", Text),
    timestamp("lease_expires_at"),
    Column("attempt", Integer, nullable=False, server_default=text("0")),
    timestamp("created_at", nullable=False, default_now=True),
    timestamp("updated_at", nullable=False, default_now=True),
    # waiting (0002): a timer, a signal, an effect; the run holds nothing meanwhile
    timestamp("wake_at"),
    Column("wait_signal", Text),
    Column("wait_effect", UUID(as_uuid=True)),
    Column("step_retries", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("upgrades", JSONB, nullable=False, server_default=text("'[]'::jsonb")),
    Column("cancel_reason", Text),
    # 0006: the W3C traceparent of the run's trace (its steps are spans of it)
    Column("trace_parent", Text),
    # 0010: a dry run's effects go to a recording deliverer; the head of its step chain
    Column("dry_run", Boolean, nullable=False, server_default=text("false")),
    Column("step_head", BYTEA),
    # 0013: run control. One run per business key; claims by priority, fair between
    # keys; pause; forks (a new run replaying another's steps up to a point).
    Column("key", Text),
    Column("priority", Integer, nullable=False, server_default=text("0")),
    Column("fairness_key", Text, nullable=False, server_default=text("''")),
    timestamp("paused_at"),
    Column("pause_reason", Text),
    Column("forked_from", UUID(as_uuid=True)),
    Column("forked_at_step", Text),
    # 0015: last, next to step_head: a step's update changes these two, and its WAL
    # record holds every byte between the first and the last column it changed
    Column("current_step", Text),
    # 0023: the number of the run's last step (each step takes the next: a step's
    # order never comes from a sequence, which Citus draws per node), its shard,
    # and the namespace its caller's keys (and its intents') are unique in
    Column("step_count", BigInteger, nullable=False, server_default=text("0")),
    shard_column(),
    Column("namespace", Text, nullable=False, server_default=text("'default'")),
    PrimaryKeyConstraint("id", "shard", name="outbox_runs_pkey"),
    CheckConstraint(SHARD_OF_ID, name="outbox_runs_shard_check"),
    CheckConstraint(sql_in("status", RUN_STATUSES), name="outbox_runs_status_check"),
    # every step updates the row: room on the page keeps those updates HOT (0004)
    postgresql_with={"fillfactor": "80", **QUEUE_VACUUM},
)
# A claim walks the lanes (priority, fairness key) of one partition, then each lane in
# available_at order (see queue.claim); the plain case is one lane.
Index(
    "outbox_runs_lanes",
    runs.c.agent,
    runs.c.agent_version,
    runs.c.priority,
    runs.c.fairness_key,
    runs.c.available_at,
    postgresql_where=text("status = 'runnable'"),
)
Index(
    "outbox_runs_leased",
    runs.c.lease_expires_at,
    postgresql_where=text("status = 'running'"),
)
Index("outbox_runs_created", runs.c.created_at)
Index(
    "outbox_runs_finished",
    runs.c.updated_at,
    postgresql_where=text(sql_in("status", TERMINAL_RUN_STATUSES)),
)
# Timers fire by index, not by scanning every waiting run.
Index(
    "outbox_runs_timers",
    runs.c.wake_at,
    postgresql_where=text("status = 'waiting' AND wake_at IS NOT NULL"),
)
Index(
    "outbox_runs_awaiting_effect",
    runs.c.wait_effect,
    postgresql_where=text("status = 'waiting' AND wait_effect IS NOT NULL"),
)
Index(
    "outbox_runs_stopping",
    runs.c.updated_at,
    postgresql_where=text(sql_in("status", STOPPING_RUN_STATUSES)),
)
# A paused run still holds its agent version (0014: the live statuses with paused).
Index(
    "outbox_runs_unfinished",
    runs.c.agent,
    runs.c.agent_version,
    postgresql_where=text(sql_in("status", LIVE_RUN_STATUSES)),
)


# 0015: steps and effects name their run without a foreign key: its check locked the
# run row on every step (WAL) although the step's statement holds that row already;
# every writer holds the run row, and `outbox gc` deletes a run's rows itself.
steps = Table(
    "outbox_steps",
    metadata,
    Column("run_id", UUID(as_uuid=True)),
    Column("step_id", Text, nullable=False),
    # the run's step_count when it was written (0023; before, a sequence's value)
    Column("seq", BigInteger, nullable=False),
    Column("kind", Text, nullable=False),
    Column("result", JSONB),
    Column("error", JSONB),
    timestamp("completed_at", nullable=False, default_now=True),
    # "waiting": a sleep or wait recorded with its deadline, not yet satisfied
    Column("status", Text, nullable=False, server_default=text("'completed'")),
    # 0010: this step's link in the run's hash chain (NULL while a wait is under way)
    Column("hash", BYTEA),
    # 0013: the state and plan this step set (NULL: unchanged), so a fork starts from them
    Column("state", JSONB),
    Column("plan", JSONB),
    shard_column(),
    PrimaryKeyConstraint("run_id", "step_id", "shard", name="outbox_steps_pkey"),
    CheckConstraint(SHARD_OF_RUN, name="outbox_steps_shard_check"),
    CheckConstraint(sql_in("status", StepStatus), name="outbox_steps_status_check"),
)

effects = Table(
    "outbox_effects",
    metadata,
    Column("id", UUID(as_uuid=True), nullable=False),
    # intent order: per-key ordering and listing follow it
    Column("seq", BigInteger, Identity(always=True), nullable=False),
    Column("run_id", UUID(as_uuid=True)),
    Column("step_id", Text),
    Column("step_index", Integer),
    Column("kind", Text, nullable=False),
    Column("payload", JSONB, nullable=False),
    Column("payload_hash", Text, nullable=False),
    Column("schema_version", Integer, nullable=False, server_default=text("1")),
    Column("idempotency_key", Text, nullable=False),
    Column("ordering_key", Text),
    Column("status", Text, nullable=False),
    Column("max_attempts", Integer),
    Column("result", JSONB),
    Column("last_error", Text),
    Column("compensate", JSONB),
    Column("compensates", UUID(as_uuid=True)),
    Column("cost", Numeric),
    # claim / lease / fence
    timestamp("available_at", nullable=False, default_now=True),
    Column("lease_owner", Text),
    timestamp("lease_expires_at"),
    Column("attempt", Integer, nullable=False, server_default=text("0")),
    timestamp("attempt_started_at"),
    timestamp("created_at", nullable=False, default_now=True),
    timestamp("updated_at", nullable=False, default_now=True),
    timestamp("completed_at"),
    # 0002: the run parked on this effect (run.await_effect); see queue.complete_effects
    Column("awaited_by", UUID(as_uuid=True)),
    # 0006: the W3C traceparent current at tx.intend (each attempt is a span of its trace)
    Column("trace_parent", Text),
    # 0010: the approval gate holding it (NULL: none) and that gate's deadline
    Column("approval", JSONB),
    timestamp("approval_deadline"),
    # 0010: what a deliverer noted about the current attempt before calling (read-back)
    Column("attempt_note", JSONB),
    # 0013: claims take higher priority first and share capacity between fairness keys
    Column("priority", Integer, nullable=False, server_default=text("0")),
    Column("fairness_key", Text, nullable=False, server_default=text("''")),
    # 0023: its run's shard (of no run: its id's) and namespace
    shard_column(),
    Column("namespace", Text, nullable=False, server_default=text("'default'")),
    PrimaryKeyConstraint("id", "shard", name="outbox_effects_pkey"),
    UniqueConstraint(
        "namespace", "idempotency_key", "shard", name="outbox_effects_idempotency_key"
    ),
    CheckConstraint(shard_check("coalesce(run_id, id)"), name="outbox_effects_shard_check"),
    CheckConstraint(sql_in("status", EFFECT_STATUSES), name="outbox_effects_status_check"),
    postgresql_with=QUEUE_VACUUM,
)
# Claims go kind by kind, so a backlog of one kind (or of a kind no deliverer
# knows) never slows the claims of another; within a kind, lane by lane
# (priority, fairness key), each lane in intent order (see queue.claim).
Index(
    "outbox_effects_lanes",
    effects.c.kind,
    effects.c.priority,
    effects.c.fairness_key,
    effects.c.available_at,
    effects.c.seq,
    postgresql_where=text("status = 'pending'"),
)
Index(
    "outbox_effects_leased",
    effects.c.lease_expires_at,
    postgresql_where=text("status = 'in_flight'"),
)
# An open effect, a paused one too, holds back later effects of its key (0014).
Index(
    "outbox_effects_open_ordering",
    effects.c.ordering_key,
    effects.c.seq,
    postgresql_where=text("ordering_key IS NOT NULL AND " + sql_in("status", OPEN_EFFECT_STATUSES)),
)
# 0003: dispatched to Kafka but not delivered within the TTL -> re-dispatch
Index(
    "outbox_effects_dispatched",
    effects.c.lease_expires_at,
    postgresql_where=text("status = 'dispatched'"),
)
Index("outbox_effects_run", effects.c.run_id, effects.c.seq)
# 0004: retention (outbox gc) finds finished rows without scanning live ones
Index(
    "outbox_effects_finished",
    effects.c.completed_at,
    postgresql_where=text("completed_at IS NOT NULL"),
)
Index(
    "outbox_effects_needs_operator",
    effects.c.status,
    effects.c.seq,
    postgresql_where=text(sql_in("status", NEEDS_PERSON_EFFECT_STATUSES)),
)
# 0010: approval deadlines fire by index; only held effects with a deadline sit in it
Index(
    "outbox_effects_approval_due",
    effects.c.approval_deadline,
    postgresql_where=text("status = 'awaiting_approval' AND approval_deadline IS NOT NULL"),
)

# 0006: the console finds an effect's compensation, and stopped effects, without a scan;
# neither index is written by the intent, claim or completion of an ordinary effect.
Index(
    "outbox_effects_compensates",
    effects.c.compensates,
    postgresql_where=text("compensates IS NOT NULL"),
)
Index(
    "outbox_effects_stopped",
    effects.c.id,
    postgresql_where=text(sql_in("status", (EffectStatus.CANCELLED, EffectStatus.COMPENSATED))),
)

effect_attempts = Table(
    "outbox_effect_attempts",
    metadata,
    Column("id", BigInteger, Identity(always=True), nullable=False),
    Column("effect_id", UUID(as_uuid=True), nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("worker", Text),
    timestamp("started_at"),
    timestamp("finished_at", nullable=False, default_now=True),
    # succeeded | retry | failed | stale | expired | resolved | released
    Column("outcome", Text, nullable=False),
    Column("detail", JSONB),
    # 0010: sha256 over this row and the effect's previous row (functions/chain.sql)
    Column("hash", BYTEA),
    # 0023: its effect's shard
    shard_column(),
    # 0023: the effect's status and sha256(result::text) once this row was logged,
    # covered by the row's link (functions/chain.sql)
    Column("effect_status", Text),
    Column("result_hash", Text),
    PrimaryKeyConstraint("id", "shard", name="outbox_effect_attempts_pkey"),
    ForeignKeyConstraint(
        ["effect_id", "shard"],
        ["outbox_effects.id", "outbox_effects.shard"],
        name="outbox_effect_attempts_effect_id_fkey",
        ondelete="CASCADE",
    ),
)
# 0010: (effect, id), so the chain's newest row is one index probe
Index("outbox_effect_attempts_effect", effect_attempts.c.effect_id, effect_attempts.c.id)

signals = Table(
    "outbox_signals",
    metadata,
    Column("id", UUID(as_uuid=True), nullable=False),
    Column("run_id", UUID(as_uuid=True), nullable=False),
    Column("name", Text, nullable=False),
    Column("payload", JSONB),
    Column("dedup_key", Text, nullable=False),
    timestamp("created_at", nullable=False, default_now=True),
    Column("consumed_by", Text),
    timestamp("consumed_at"),
    shard_column(),
    PrimaryKeyConstraint("id", "shard", name="outbox_signals_pkey"),
    UniqueConstraint("run_id", "dedup_key", "shard", name="outbox_signals_dedup"),
    ForeignKeyConstraint(
        ["run_id", "shard"],
        ["outbox_runs.id", "outbox_runs.shard"],
        name="outbox_signals_run_id_fkey",
        ondelete="CASCADE",
    ),
    CheckConstraint(SHARD_OF_RUN, name="outbox_signals_shard_check"),
)
Index(
    "outbox_signals_unconsumed",
    signals.c.run_id,
    signals.c.name,
    signals.c.created_at,
    postgresql_where=text("consumed_at IS NULL"),
)

budget_ledger = Table(
    "outbox_budget_ledger",
    metadata,
    Column("id", BigInteger, Identity(always=True), nullable=False),
    Column("run_id", UUID(as_uuid=True), nullable=False),
    Column("step_id", Text),
    Column("effect_id", UUID(as_uuid=True)),
    Column("reason", Text, nullable=False),
    Column("entry", Text, nullable=False),
    Column("amount", Numeric, nullable=False),
    timestamp("created_at", nullable=False, default_now=True),
    CheckConstraint(
        "entry IN ('spend', 'reserve', 'commit', 'release')",
        name="outbox_budget_ledger_entry_check",
    ),
    shard_column(),
    PrimaryKeyConstraint("id", "shard", name="outbox_budget_ledger_pkey"),
    ForeignKeyConstraint(
        ["run_id", "shard"],
        ["outbox_runs.id", "outbox_runs.shard"],
        name="outbox_budget_ledger_run_id_fkey",
        ondelete="CASCADE",
    ),
    CheckConstraint(SHARD_OF_RUN, name="outbox_budget_ledger_shard_check"),
)
# A debit is keyed by (run, step, reason): a replayed or retried step cannot spend twice.
Index(
    "outbox_budget_spend_key",
    budget_ledger.c.run_id,
    budget_ledger.c.step_id,
    budget_ledger.c.reason,
    unique=True,
    postgresql_where=text("entry = 'spend'"),
)
Index("outbox_budget_ledger_run", budget_ledger.c.run_id, budget_ledger.c.id)

# 0007: the SQL API (docs/sql-api.md). When its writers last sent a NOTIFY per channel
# (microseconds; setval is not transactional, so no writer waits on another).
Sequence("outbox_wake_clock_effects", start=0, minvalue=0, metadata=metadata)
Sequence("outbox_wake_clock_runs", start=0, minvalue=0, metadata=metadata)


@event.listens_for(metadata, "after_create")
def _create_functions(target: MetaData, connection: Connection, **kw: object) -> None:
    # Functions and triggers come from their current-truth files (outbox/storage/functions).
    # One multi-statement script with no parameters: psycopg sends it as a simple
    # query (as outbox.storage.migrate does), so "%" stays literal.
    driver = connection.connection.driver_connection
    assert driver is not None
    driver.execute(functions_ddl())


# The smaller tables (keys, values by reference, gates, rate limits, registries).
from outbox.storage.side_tables import (  # noqa: E402 -- after the tables they sit beside
    blob_refs,
    blobs,
    consumed_keys,
    effect_keys,
    gates,
    owners,
    rate_limits,
    run_keys,
    webhook_replays,
)
