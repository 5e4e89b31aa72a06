-- agent-outbox 0004: retention. `outbox gc` finds finished rows by these indexes,
-- so deleting old history never scans what is still live.
-- Must stay equal to outbox/schema.py (tests/integration/test_migrations.py checks it).

CREATE INDEX outbox_effects_finished ON outbox_effects (completed_at)
    WHERE completed_at IS NOT NULL;
CREATE INDEX outbox_runs_finished ON outbox_runs (updated_at)
    WHERE status IN ('completed', 'failed', 'cancelled', 'compensated', 'compensation_failed');

-- A run's row is updated by every step: leave room on its page so those updates
-- stay HOT (no index is touched; no indexed column changes in a step).
ALTER TABLE outbox_runs SET (fillfactor = 80);
