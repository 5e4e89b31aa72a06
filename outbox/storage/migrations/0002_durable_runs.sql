-- agent-outbox 0002: durable runs. Waiting at zero compute (timers, signals,
-- awaited effects), per-step retry counters, version migrations, cancellation
-- and compensation, and a budget ledger.
-- Must stay equal to outbox/schema.py (tests/integration/test_migrations.py checks it).

ALTER TABLE outbox_runs
    ADD COLUMN wake_at       TIMESTAMP WITH TIME ZONE,
    ADD COLUMN wait_signal   TEXT,
    ADD COLUMN wait_effect   UUID,
    ADD COLUMN step_retries  JSONB NOT NULL DEFAULT '{}'::jsonb,
    ADD COLUMN migrations    JSONB NOT NULL DEFAULT '[]'::jsonb,
    ADD COLUMN cancel_reason TEXT;

-- Timers fire by index, not by scanning every waiting run.
-- The run parked on an effect (run.await_effect). Recorded on the effect row, so
-- the completion that updates that row, whichever commits first, sees it.
ALTER TABLE outbox_effects ADD COLUMN awaited_by UUID;

CREATE INDEX outbox_runs_timers ON outbox_runs (wake_at)
    WHERE status = 'waiting' AND wake_at IS NOT NULL;
CREATE INDEX outbox_runs_awaiting_effect ON outbox_runs (wait_effect)
    WHERE status = 'waiting' AND wait_effect IS NOT NULL;
CREATE INDEX outbox_runs_stopping ON outbox_runs (updated_at)
    WHERE status IN ('cancelling', 'compensating');
CREATE INDEX outbox_runs_versions ON outbox_runs (agent, agent_version)
    WHERE status IN ('runnable', 'running', 'waiting');

ALTER TABLE outbox_steps
    ADD COLUMN status TEXT NOT NULL DEFAULT 'completed',
    ADD CONSTRAINT outbox_steps_status_check CHECK (status IN ('completed', 'waiting'));

CREATE TABLE outbox_signals (
    id          UUID NOT NULL PRIMARY KEY,
    run_id      UUID NOT NULL REFERENCES outbox_runs (id) ON DELETE CASCADE,
    name        TEXT NOT NULL,
    payload     JSONB,
    dedup_key   TEXT NOT NULL,
    created_at  TIMESTAMP WITH TIME ZONE NOT NULL DEFAULT now(),
    consumed_by TEXT,
    consumed_at TIMESTAMP WITH TIME ZONE,
    CONSTRAINT outbox_signals_dedup UNIQUE (run_id, dedup_key)
);
CREATE INDEX outbox_signals_unconsumed ON outbox_signals (run_id, name, created_at)
    WHERE consumed_at IS NULL;

CREATE TABLE outbox_budget_ledger (
    id         BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id     UUID NOT NULL REFERENCES outbox_runs (id) ON DELETE CASCADE,
    step_id    TEXT,
    effect_id  UUID,
    reason     TEXT NOT NULL,
    entry      TEXT NOT NULL,
    amount     NUMERIC NOT NULL,
    created_at TIMESTAMP WITH TIME ZONE NOT NULL DEFAULT now(),
    CONSTRAINT outbox_budget_ledger_entry_check
        CHECK (entry IN ('spend', 'reserve', 'commit', 'release'))
);
-- A debit is keyed by (run, step, reason): a replayed or retried step cannot spend twice.
CREATE UNIQUE INDEX outbox_budget_spend_key ON outbox_budget_ledger (run_id, step_id, reason)
    WHERE entry = 'spend';
CREATE INDEX outbox_budget_ledger_run ON outbox_budget_ledger (run_id, id);

-- Signed webhook bodies already accepted (replay protection for `outbox serve`).
CREATE TABLE outbox_webhook_replays (
    signature TEXT NOT NULL PRIMARY KEY,
    seen_at   TIMESTAMP WITH TIME ZONE NOT NULL DEFAULT now()
);

-- Money reserved by a costly intent is committed when it succeeds and released
-- when it fails or is cancelled (held while unknown), whoever makes the change:
-- a deliverer, the reconciler, an operator or a cancellation. The WHEN clause
-- keeps the function out of every effect without a cost.
CREATE FUNCTION outbox_effects_settle_cost() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status = 'succeeded' THEN
        UPDATE outbox_runs
           SET reserved = reserved - NEW.cost, spent = spent + NEW.cost
         WHERE id = NEW.run_id;
        INSERT INTO outbox_budget_ledger (run_id, step_id, effect_id, reason, entry, amount)
        VALUES (NEW.run_id, NEW.step_id, NEW.id, NEW.kind, 'commit', NEW.cost);
    ELSIF NEW.status IN ('failed', 'cancelled') THEN
        UPDATE outbox_runs SET reserved = reserved - NEW.cost WHERE id = NEW.run_id;
        INSERT INTO outbox_budget_ledger (run_id, step_id, effect_id, reason, entry, amount)
        VALUES (NEW.run_id, NEW.step_id, NEW.id, NEW.kind, 'release', NEW.cost);
    ELSIF OLD.status IN ('failed', 'cancelled') THEN
        -- an operator put it back: it holds its reservation again
        UPDATE outbox_runs SET reserved = reserved + NEW.cost WHERE id = NEW.run_id;
        INSERT INTO outbox_budget_ledger (run_id, step_id, effect_id, reason, entry, amount)
        VALUES (NEW.run_id, NEW.step_id, NEW.id, NEW.kind, 'reserve', NEW.cost);
    END IF;
    RETURN NULL;
END
$$;
CREATE TRIGGER outbox_effects_settle_cost
    AFTER UPDATE OF status ON outbox_effects FOR EACH ROW
    WHEN (NEW.cost IS NOT NULL AND NEW.run_id IS NOT NULL
          AND OLD.status IS DISTINCT FROM NEW.status
          AND (NEW.status IN ('succeeded', 'failed', 'cancelled')
               OR OLD.status IN ('failed', 'cancelled')))
    EXECUTE FUNCTION outbox_effects_settle_cost();
