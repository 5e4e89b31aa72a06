-- outbox:no-transaction
-- agent-outbox 0004: retention. `outbox gc` finds finished rows by these indexes,
-- so deleting old history never scans what is still live.
-- Must stay equal to outbox/schema.py (tests/integration/test_migrations.py checks it).
--
-- Built CONCURRENTLY, so intents and completions keep being written while the
-- indexes build on a big table; CONCURRENTLY cannot run in a transaction, hence
-- the marker above: each statement commits on its own. Should one fail, an
-- invalid index is left behind; the DROPs make running `outbox migrate` again safe.

DROP INDEX CONCURRENTLY IF EXISTS outbox_effects_finished;
CREATE INDEX CONCURRENTLY outbox_effects_finished ON outbox_effects (completed_at)
    WHERE completed_at IS NOT NULL;
DROP INDEX CONCURRENTLY IF EXISTS outbox_runs_finished;
CREATE INDEX CONCURRENTLY outbox_runs_finished ON outbox_runs (updated_at)
    WHERE status IN ('completed', 'failed', 'cancelled', 'compensated', 'compensation_failed');

-- A run's row is updated by every step: leave room on its page so those updates
-- stay HOT (no index is touched; no indexed column changes in a step).
ALTER TABLE outbox_runs SET (fillfactor = 80);
