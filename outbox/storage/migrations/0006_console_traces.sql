-- outbox:no-transaction
-- agent-outbox 0006: the operator console and traces.
-- Must stay equal to outbox/storage/schema.py (tests/integration/test_migrations.py checks it).
--
-- Each statement commits on its own (the marker above), so the indexes can be
-- built CONCURRENTLY while intents and completions keep being written. Every
-- statement can run again: a failure part-way is mended by `outbox migrate`.

-- The W3C traceparent current when the intent was written (or the run started);
-- NULL when no trace was active. Each delivery attempt is a span of that trace.
ALTER TABLE outbox_effects ADD COLUMN IF NOT EXISTS trace_parent text;
ALTER TABLE outbox_runs ADD COLUMN IF NOT EXISTS trace_parent text;

-- The console's pages read by these. Both are partial on rows that only a
-- cancellation writes, so the intent, claim and completion paths never touch them.
DROP INDEX CONCURRENTLY IF EXISTS outbox_effects_compensates;
CREATE INDEX CONCURRENTLY outbox_effects_compensates ON outbox_effects (compensates)
    WHERE compensates IS NOT NULL;
DROP INDEX CONCURRENTLY IF EXISTS outbox_effects_stopped;
CREATE INDEX CONCURRENTLY outbox_effects_stopped ON outbox_effects (id)
    WHERE status IN ('cancelled', 'compensated');
