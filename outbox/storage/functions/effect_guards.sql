CREATE OR REPLACE FUNCTION outbox_effects_settle_cost() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status = 'succeeded' THEN
        UPDATE outbox_runs
           SET reserved = reserved - NEW.cost, spent = spent + NEW.cost
         WHERE id = NEW.run_id AND shard = NEW.shard;
        INSERT INTO outbox_budget_ledger (run_id, shard, step_id, effect_id, reason, entry, amount)
        VALUES (NEW.run_id, NEW.shard, NEW.step_id, NEW.id, NEW.kind, 'commit', NEW.cost);
    ELSIF NEW.status IN ('failed', 'cancelled', 'rejected') THEN
        UPDATE outbox_runs SET reserved = reserved - NEW.cost
         WHERE id = NEW.run_id AND shard = NEW.shard;
        INSERT INTO outbox_budget_ledger (run_id, shard, step_id, effect_id, reason, entry, amount)
        VALUES (NEW.run_id, NEW.shard, NEW.step_id, NEW.id, NEW.kind, 'release', NEW.cost);
    ELSIF OLD.status IN ('failed', 'cancelled', 'rejected') THEN
        -- an operator put it back: it holds its reservation again
        UPDATE outbox_runs SET reserved = reserved + NEW.cost
         WHERE id = NEW.run_id AND shard = NEW.shard;
        INSERT INTO outbox_budget_ledger (run_id, shard, step_id, effect_id, reason, entry, amount)
        VALUES (NEW.run_id, NEW.shard, NEW.step_id, NEW.id, NEW.kind, 'reserve', NEW.cost);
    END IF;
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS outbox_effects_settle_cost ON outbox_effects;
CREATE TRIGGER outbox_effects_settle_cost
    AFTER UPDATE OF status ON outbox_effects FOR EACH ROW
    WHEN (NEW.cost IS NOT NULL AND NEW.run_id IS NOT NULL
          AND OLD.status IS DISTINCT FROM NEW.status
          AND (NEW.status IN ('succeeded', 'failed', 'cancelled', 'rejected')
               OR OLD.status IN ('failed', 'cancelled', 'rejected')))
    EXECUTE FUNCTION outbox_effects_settle_cost();

-- Every way back to pending (a retry, the reconciler, an operator) holds the
-- effect of a paused run as paused; commit_step decides it for new intents.
CREATE OR REPLACE FUNCTION outbox_effects_hold_paused() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM outbox_runs
                WHERE id = NEW.run_id AND shard = NEW.shard AND paused_at IS NOT NULL) THEN
        NEW.status := 'paused';
    END IF;
    RETURN NEW;
END
$$;

DROP TRIGGER IF EXISTS outbox_effects_hold_paused ON outbox_effects;
CREATE TRIGGER outbox_effects_hold_paused
    BEFORE UPDATE OF status ON outbox_effects FOR EACH ROW
    WHEN (NEW.status = 'pending' AND OLD.status <> 'pending' AND OLD.status <> 'paused'
          AND NEW.run_id IS NOT NULL)
    EXECUTE FUNCTION outbox_effects_hold_paused();
