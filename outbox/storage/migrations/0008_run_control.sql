-- agent-outbox 0008: run control for long agents. Pause and resume, forks,
-- large values by reference, priorities and fairness keys, declared rates,
-- one run per business key. Its indexes on the big tables are built by 0009,
-- CONCURRENTLY, after this file's columns exist.
-- Must stay equal to outbox/storage/schema.py (tests/integration/test_migrations.py checks it).

-- Runs: paused is a live status that takes no steps. The constraint is checked
-- for new rows at once and validated for old ones by 0009 (without blocking writes).
ALTER TABLE outbox_runs DROP CONSTRAINT outbox_runs_status_check;
ALTER TABLE outbox_runs ADD CONSTRAINT outbox_runs_status_check CHECK (status IN (
    'runnable', 'running', 'waiting', 'completed', 'failed', 'cancelling', 'cancelled',
    'compensating', 'compensated', 'compensation_failed', 'paused')) NOT VALID;
ALTER TABLE outbox_runs
    ADD COLUMN key TEXT,
    ADD COLUMN priority INTEGER NOT NULL DEFAULT 0,
    ADD COLUMN fairness_key TEXT NOT NULL DEFAULT '',
    ADD COLUMN paused_at TIMESTAMP WITH TIME ZONE,
    ADD COLUMN pause_reason TEXT,
    ADD COLUMN forked_from UUID,
    ADD COLUMN forked_at_step TEXT;

-- The state and plan each step set, so a fork starts from them.
ALTER TABLE outbox_steps ADD COLUMN state JSONB, ADD COLUMN plan JSONB;

-- Effects: held as paused while their run is paused.
ALTER TABLE outbox_effects DROP CONSTRAINT outbox_effects_status_check;
ALTER TABLE outbox_effects ADD CONSTRAINT outbox_effects_status_check CHECK (status IN (
    'pending', 'in_flight', 'dispatched', 'succeeded', 'failed', 'unknown', 'cancelled',
    'compensated', 'paused')) NOT VALID;
ALTER TABLE outbox_effects
    ADD COLUMN priority INTEGER NOT NULL DEFAULT 0,
    ADD COLUMN fairness_key TEXT NOT NULL DEFAULT '';

-- Every way back to pending (a retry, the reconciler, an operator) holds the
-- effect of a paused run as paused; commit_step decides it for new intents.
CREATE FUNCTION outbox_effects_hold_paused() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM outbox_runs WHERE id = NEW.run_id AND paused_at IS NOT NULL) THEN
        NEW.status := 'paused';
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER outbox_effects_hold_paused
    BEFORE UPDATE OF status ON outbox_effects FOR EACH ROW
    WHEN (NEW.status = 'pending' AND OLD.status <> 'pending' AND OLD.status <> 'paused'
          AND NEW.run_id IS NOT NULL)
    EXECUTE FUNCTION outbox_effects_hold_paused();

-- Large values, stored once by content (outbox.blobs), and who uses them.
CREATE TABLE outbox_blobs (
    sha256     TEXT NOT NULL,
    bytes      BIGINT NOT NULL,
    data       TEXT NOT NULL,
    created_at TIMESTAMP WITH TIME ZONE NOT NULL DEFAULT now(),
    used_at    TIMESTAMP WITH TIME ZONE NOT NULL DEFAULT now(),
    CONSTRAINT outbox_blobs_pkey PRIMARY KEY (sha256)
);
CREATE TABLE outbox_blob_refs (
    owner  UUID NOT NULL,
    sha256 TEXT NOT NULL,
    CONSTRAINT outbox_blob_refs_pkey PRIMARY KEY (owner, sha256),
    CONSTRAINT outbox_blob_refs_sha256_fkey FOREIGN KEY (sha256) REFERENCES outbox_blobs (sha256)
);
CREATE INDEX outbox_blob_refs_sha256 ON outbox_blob_refs (sha256);

-- A kind's declared rate, shared by every deliverer process (GCRA).
CREATE TABLE outbox_rate_limits (
    kind TEXT NOT NULL,
    tat  TIMESTAMP WITH TIME ZONE NOT NULL,
    CONSTRAINT outbox_rate_limits_pkey PRIMARY KEY (kind)
);
