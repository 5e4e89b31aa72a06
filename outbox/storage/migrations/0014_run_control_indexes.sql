-- outbox:no-transaction
-- agent-outbox 0014: run control, the indexes and checks on the big tables.
-- Must stay equal to outbox/storage/schema.py (tests/integration/test_migrations.py checks it).
--
-- Each statement commits on its own (the marker above): the indexes build
-- CONCURRENTLY and the status checks validate old rows while intents, claims
-- and completions keep being written. Each new index is built before the one
-- it replaces is dropped, so claims never lose theirs. Every statement can run
-- again: a failure part-way is mended by `outbox migrate`.

ALTER TABLE outbox_runs VALIDATE CONSTRAINT outbox_runs_status_check;
ALTER TABLE outbox_effects VALIDATE CONSTRAINT outbox_effects_status_check;

-- A claim walks the lanes (priority, fairness key) of its partition, each lane in
-- available_at order; without priorities or keys that is one lane, as before.
DROP INDEX CONCURRENTLY IF EXISTS outbox_effects_lanes;
CREATE INDEX CONCURRENTLY outbox_effects_lanes
    ON outbox_effects (kind, priority, fairness_key, available_at, seq)
    WHERE status = 'pending';
DROP INDEX CONCURRENTLY IF EXISTS outbox_effects_claimable;
DROP INDEX CONCURRENTLY IF EXISTS outbox_runs_lanes;
CREATE INDEX CONCURRENTLY outbox_runs_lanes
    ON outbox_runs (agent, agent_version, priority, fairness_key, available_at)
    WHERE status = 'runnable';
DROP INDEX CONCURRENTLY IF EXISTS outbox_runs_claimable;

-- One run per business key.
DROP INDEX CONCURRENTLY IF EXISTS outbox_runs_key;
CREATE UNIQUE INDEX CONCURRENTLY outbox_runs_key ON outbox_runs (key) WHERE key IS NOT NULL;

-- A paused run still holds its agent version.
DROP INDEX CONCURRENTLY IF EXISTS outbox_runs_unfinished;
CREATE INDEX CONCURRENTLY outbox_runs_unfinished ON outbox_runs (agent, agent_version)
    WHERE status IN ('runnable', 'running', 'waiting', 'paused');
DROP INDEX CONCURRENTLY IF EXISTS outbox_runs_versions;

-- A paused effect still holds back later effects of its ordering key.
DROP INDEX CONCURRENTLY IF EXISTS outbox_effects_open_ordering;
CREATE INDEX CONCURRENTLY outbox_effects_open_ordering ON outbox_effects (ordering_key, seq)
    WHERE ordering_key IS NOT NULL
      AND status IN ('pending', 'in_flight', 'dispatched', 'unknown', 'paused',
                     'awaiting_approval');
DROP INDEX CONCURRENTLY IF EXISTS outbox_effects_ordering;
