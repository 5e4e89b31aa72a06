CREATE OR REPLACE FUNCTION outbox_effects_settle_cost() RETURNS trigger
    LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    PERFORM outbox_citus_plans_per_call();  -- on a worker, its shard's statements
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
-- effect of a paused run as paused; commit_step decides it for new intents. One
-- of a run being cancelled (not a compensation) stays pending but is never due:
-- claims do not look at runs, and the stopping sweep cancels it (or leaves it
-- unknown when a lost attempt may have done it) at its next pass. The run is
-- read FOR KEY SHARE: a pause or a cancel holds it FOR UPDATE until it commits,
-- so an answer racing one waits and reads the run stopped (read before that
-- commit, the run looked live, and the effect came back due and was sent again);
-- a step's update of the run (FOR NO KEY UPDATE) does not make it wait. And
-- an effect held for approval leaves it only by an approval (a session with
-- EXECUTE on outbox_may_release: the operator's, under `outbox roles`), a
-- rejection or a cancellation, never by a deliverer's hand-written UPDATE. And
-- what an operator ended stays ended: a failed, cancelled, rejected or
-- compensated effect changes status only in such a session (the operator's retry
-- of a failed one), a succeeded one only to compensated, so a deliverer login
-- cannot undo a decision nor walk a held effect out through rejected. One trigger
-- for all, so the claims and completions pay for one WHEN clause.
-- Whether a run holds its effects (paused, or stopping), its row read FOR KEY
-- SHARE (see below). As the tables' owner: a row lock asks UPDATE on the table,
-- which a login that may move an effect back to pending need not have. So a
-- session confined to a namespace is refused another namespace's run
-- (outbox_session_sees): called directly, it would tell that run's state. A
-- refusal, not a neutral answer: the trigger asks only of an effect's own run, in
-- the effect's namespace, and taking another's run for live would send a paused
-- run's effect. Checked here, in PL/pgSQL, not in the statement: on Citus a
-- statement run as the owner reaches the run's node as the owner, where the
-- session is no longer the caller's.
CREATE OR REPLACE FUNCTION outbox_run_holds(
    p_run uuid, p_shard smallint, OUT paused boolean, OUT stopping boolean
)
    LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    ns text;
BEGIN
    -- (the namespace read before the lock, which would otherwise make a refused
    -- caller wait while another namespace pauses or stops its run: a tell; and
    -- only once `outbox roles --namespace` has confined a role)
    IF to_regrole('outbox_confined') IS NOT NULL THEN
        SELECT r.namespace INTO ns FROM outbox_runs AS r WHERE r.id = p_run AND r.shard = p_shard;
        IF ns IS NOT NULL AND NOT outbox_session_sees(ns) THEN
            RAISE EXCEPTION 'permission denied: role % is confined to namespace %, and run % is '
                            'not in it', coalesce(nullif(current_setting('role'), 'none'),
                                                  session_user::text),
                array_to_string(outbox_session_namespaces(), ', '), p_run
                USING ERRCODE = 'insufficient_privilege';
        END IF;
    END IF;
    SELECT r.paused_at IS NOT NULL, r.status IN ('cancelling', 'compensating')
      INTO paused, stopping
      FROM outbox_runs AS r WHERE r.id = p_run AND r.shard = p_shard
       FOR KEY SHARE;
END
$$;

CREATE OR REPLACE FUNCTION outbox_effects_hold_paused() RETURNS trigger
    LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    paused boolean;
    stopping boolean;
BEGIN
    PERFORM outbox_citus_plans_per_call();  -- on a worker, its shard's statements
    IF ((OLD.status IN ('failed', 'cancelled', 'rejected', 'compensated')
         AND NEW.status <> OLD.status)
        OR (OLD.status = 'succeeded' AND NEW.status NOT IN ('succeeded', 'compensated')))
       AND NOT has_function_privilege('outbox_may_release()', 'EXECUTE') THEN
        RAISE EXCEPTION 'permission denied: effect % is %; it cannot become % (only an '
            'operator reopens one: a role with EXECUTE on outbox_may_release())',
            OLD.id, OLD.status, NEW.status
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    IF OLD.status = 'awaiting_approval'
       AND NEW.status NOT IN ('awaiting_approval', 'rejected', 'cancelled')
       AND NOT has_function_privilege('outbox_may_release()', 'EXECUTE') THEN
        RAISE EXCEPTION 'permission denied: effect % is held for approval; only an approval '
            'releases it (a role with EXECUTE on outbox_may_release())', OLD.id
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    IF NEW.status = 'pending' AND NEW.run_id IS NOT NULL THEN
        SELECT h.paused, h.stopping INTO paused, stopping
          FROM outbox_run_holds(NEW.run_id, NEW.shard) AS h;
        IF paused THEN
            NEW.status := 'paused';
        ELSIF stopping AND NEW.compensates IS NULL THEN
            NEW.available_at := now() + interval '100 years';  -- finite: clients read it
        END IF;
    END IF;
    RETURN NEW;
END
$$;

DROP TRIGGER IF EXISTS outbox_effects_hold_paused ON outbox_effects;
CREATE TRIGGER outbox_effects_hold_paused
    BEFORE UPDATE OF status ON outbox_effects FOR EACH ROW
    WHEN ((NEW.status = 'pending' AND OLD.status <> 'pending' AND OLD.status <> 'paused'
           AND NEW.run_id IS NOT NULL)
          OR (OLD.status = 'awaiting_approval'
              AND NEW.status NOT IN ('awaiting_approval', 'rejected', 'cancelled'))
          OR (OLD.status IN ('failed', 'cancelled', 'rejected', 'compensated')
              AND NEW.status <> OLD.status)
          OR (OLD.status = 'succeeded' AND NEW.status NOT IN ('succeeded', 'compensated')))
    EXECUTE FUNCTION outbox_effects_hold_paused();

