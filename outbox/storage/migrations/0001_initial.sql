-- agent-outbox 0001: runs, their step checkpoints, effect intents and the attempt log.
-- Must stay equal to outbox/schema.py (tests/integration/test_migrations.py checks it).

CREATE TABLE outbox_migrations (
    version    INTEGER NOT NULL PRIMARY KEY,
    name       TEXT NOT NULL,
    checksum   TEXT NOT NULL,
    applied_at TIMESTAMP WITH TIME ZONE NOT NULL DEFAULT now()
);

CREATE TABLE outbox_runs (
    id               UUID NOT NULL PRIMARY KEY,
    agent            TEXT NOT NULL,
    agent_version    TEXT NOT NULL,
    inputs           JSONB NOT NULL,
    inputs_hash      TEXT NOT NULL,
    status           TEXT NOT NULL,
    state            JSONB NOT NULL DEFAULT '{}'::jsonb,
    plan             JSONB NOT NULL DEFAULT '[]'::jsonb,
    current_step     TEXT,
    result           JSONB,
    error            JSONB,
    budget           NUMERIC,
    spent            NUMERIC NOT NULL DEFAULT 0,
    reserved         NUMERIC NOT NULL DEFAULT 0,
    -- claim / lease / fence, the same columns as outbox_effects
    available_at     TIMESTAMP WITH TIME ZONE NOT NULL DEFAULT now(),
    lease_owner      TEXT,
    lease_expires_at TIMESTAMP WITH TIME ZONE,
    attempt          INTEGER NOT NULL DEFAULT 0,
    created_at       TIMESTAMP WITH TIME ZONE NOT NULL DEFAULT now(),
    updated_at       TIMESTAMP WITH TIME ZONE NOT NULL DEFAULT now(),
    CONSTRAINT outbox_runs_status_check CHECK (status IN (
        'runnable', 'running', 'waiting', 'completed', 'failed', 'cancelling',
        'cancelled', 'compensating', 'compensated', 'compensation_failed'))
);
CREATE INDEX outbox_runs_claimable ON outbox_runs (agent, agent_version, available_at)
    WHERE status = 'runnable';
CREATE INDEX outbox_runs_leased ON outbox_runs (lease_expires_at) WHERE status = 'running';
CREATE INDEX outbox_runs_created ON outbox_runs (created_at);

-- What a run started from never changes. The WHEN clause keeps the function out
-- of every ordinary step update.
CREATE FUNCTION outbox_runs_refuse_input_change() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'run % was started with agent %, inputs hash %: these never change',
        OLD.id, OLD.agent, OLD.inputs_hash
        USING ERRCODE = 'integrity_constraint_violation';
END
$$;
CREATE TRIGGER outbox_runs_inputs_immutable
    BEFORE UPDATE ON outbox_runs FOR EACH ROW
    WHEN (OLD.agent IS DISTINCT FROM NEW.agent
          OR OLD.inputs_hash IS DISTINCT FROM NEW.inputs_hash
          OR OLD.inputs IS DISTINCT FROM NEW.inputs)
    EXECUTE FUNCTION outbox_runs_refuse_input_change();

CREATE TABLE outbox_steps (
    run_id       UUID NOT NULL REFERENCES outbox_runs (id) ON DELETE CASCADE,
    step_id      TEXT NOT NULL,
    seq          BIGINT GENERATED ALWAYS AS IDENTITY,
    kind         TEXT NOT NULL,
    result       JSONB,
    error        JSONB,
    completed_at TIMESTAMP WITH TIME ZONE NOT NULL DEFAULT now(),
    CONSTRAINT outbox_steps_pkey PRIMARY KEY (run_id, step_id)
);

CREATE TABLE outbox_effects (
    id                 UUID NOT NULL PRIMARY KEY,
    seq                BIGINT GENERATED ALWAYS AS IDENTITY,
    run_id             UUID REFERENCES outbox_runs (id) ON DELETE CASCADE,
    step_id            TEXT,
    step_index         INTEGER,
    kind               TEXT NOT NULL,
    payload            JSONB NOT NULL,
    payload_hash       TEXT NOT NULL,
    schema_version     INTEGER NOT NULL DEFAULT 1,
    idempotency_key    TEXT NOT NULL,
    ordering_key       TEXT,
    status             TEXT NOT NULL,
    max_attempts       INTEGER,
    result             JSONB,
    last_error         TEXT,
    compensate         JSONB,
    compensates        UUID,
    cost               NUMERIC,
    available_at       TIMESTAMP WITH TIME ZONE NOT NULL DEFAULT now(),
    lease_owner        TEXT,
    lease_expires_at   TIMESTAMP WITH TIME ZONE,
    attempt            INTEGER NOT NULL DEFAULT 0,
    attempt_started_at TIMESTAMP WITH TIME ZONE,
    created_at         TIMESTAMP WITH TIME ZONE NOT NULL DEFAULT now(),
    updated_at         TIMESTAMP WITH TIME ZONE NOT NULL DEFAULT now(),
    completed_at       TIMESTAMP WITH TIME ZONE,
    CONSTRAINT outbox_effects_idempotency_key UNIQUE (idempotency_key),
    CONSTRAINT outbox_effects_status_check CHECK (status IN (
        'pending', 'in_flight', 'succeeded', 'failed', 'unknown', 'cancelled', 'compensated'))
);
-- Partial indexes keep finished rows out of the hot paths. Claims go kind by
-- kind, so a backlog of one kind (or of a kind no deliverer knows) never slows
-- the claims of another.
CREATE INDEX outbox_effects_claimable ON outbox_effects (kind, available_at, seq)
    WHERE status = 'pending';
CREATE INDEX outbox_effects_leased ON outbox_effects (lease_expires_at)
    WHERE status = 'in_flight';
CREATE INDEX outbox_effects_ordering ON outbox_effects (ordering_key, seq)
    WHERE ordering_key IS NOT NULL AND status IN ('pending', 'in_flight', 'unknown');
CREATE INDEX outbox_effects_run ON outbox_effects (run_id, seq);
CREATE INDEX outbox_effects_needs_operator ON outbox_effects (status, seq)
    WHERE status IN ('unknown', 'failed');

CREATE TABLE outbox_effect_attempts (
    id          BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    effect_id   UUID NOT NULL REFERENCES outbox_effects (id) ON DELETE CASCADE,
    attempt     INTEGER NOT NULL,
    worker      TEXT,
    started_at  TIMESTAMP WITH TIME ZONE,
    finished_at TIMESTAMP WITH TIME ZONE NOT NULL DEFAULT now(),
    outcome     TEXT NOT NULL,
    detail      JSONB
);
CREATE INDEX outbox_effect_attempts_effect ON outbox_effect_attempts (effect_id, attempt);
