-- outbox:no-transaction
-- agent-outbox 0011: the indexes of effect governance (0010), built CONCURRENTLY so
-- intents and completions keep being written. Must stay equal to
-- outbox/storage/schema.py (tests/integration/test_migrations.py checks it). Every
-- statement can run again: a failure part-way is mended by `outbox migrate`.

-- An effect awaiting approval holds back later effects of its ordering key, and a
-- person must look at it.
DROP INDEX CONCURRENTLY IF EXISTS outbox_effects_ordering_v2;
CREATE INDEX CONCURRENTLY outbox_effects_ordering_v2 ON outbox_effects (ordering_key, seq)
    WHERE ordering_key IS NOT NULL
      AND status IN ('pending', 'in_flight', 'dispatched', 'unknown', 'awaiting_approval');
DROP INDEX CONCURRENTLY IF EXISTS outbox_effects_ordering;
ALTER INDEX outbox_effects_ordering_v2 RENAME TO outbox_effects_ordering;
DROP INDEX CONCURRENTLY IF EXISTS outbox_effects_needs_operator_v2;
CREATE INDEX CONCURRENTLY outbox_effects_needs_operator_v2 ON outbox_effects (status, seq)
    WHERE status IN ('unknown', 'failed', 'awaiting_approval');
DROP INDEX CONCURRENTLY IF EXISTS outbox_effects_needs_operator;
ALTER INDEX outbox_effects_needs_operator_v2 RENAME TO outbox_effects_needs_operator;
-- Approval deadlines fire by index.
DROP INDEX CONCURRENTLY IF EXISTS outbox_effects_approval_due;
CREATE INDEX CONCURRENTLY outbox_effects_approval_due ON outbox_effects (approval_deadline)
    WHERE status = 'awaiting_approval' AND approval_deadline IS NOT NULL;
-- The newest row of an effect's chain is one probe of (effect, id).
DROP INDEX CONCURRENTLY IF EXISTS outbox_effect_attempts_effect_v2;
CREATE INDEX CONCURRENTLY outbox_effect_attempts_effect_v2
    ON outbox_effect_attempts (effect_id, id);
DROP INDEX CONCURRENTLY IF EXISTS outbox_effect_attempts_effect;
ALTER INDEX outbox_effect_attempts_effect_v2 RENAME TO outbox_effect_attempts_effect;
