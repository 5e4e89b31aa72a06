-- What a run started from never changes. The WHEN clause keeps the function out
-- of every ordinary step update.
CREATE OR REPLACE FUNCTION outbox_runs_refuse_input_change() RETURNS trigger
    LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    RAISE EXCEPTION 'run % was started with agent %, inputs hash %: these never change',
        OLD.id, OLD.agent, OLD.inputs_hash
        USING ERRCODE = 'integrity_constraint_violation';
END
$$;

DROP TRIGGER IF EXISTS outbox_runs_inputs_immutable ON outbox_runs;
CREATE TRIGGER outbox_runs_inputs_immutable
    AFTER UPDATE ON outbox_runs FOR EACH ROW
    WHEN (OLD.agent IS DISTINCT FROM NEW.agent
          OR OLD.inputs_hash IS DISTINCT FROM NEW.inputs_hash
          OR OLD.inputs IS DISTINCT FROM NEW.inputs)
    EXECUTE FUNCTION outbox_runs_refuse_input_change();

-- Who may let go of what an operator holds: approve an effect held for
-- approval, resume a paused run. Everyone, until `outbox roles` revokes EXECUTE
-- from PUBLIC and grants it to the operator role: then an agent or deliverer
-- login that writes the status by hand is refused (outbox_effects_hold_paused,
-- outbox_runs_refuse_resume).
CREATE OR REPLACE FUNCTION outbox_may_release() RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT true
$$;

-- Refuses to resume a paused run (make it live again, or drop a pause asked of
-- a running one) in a session without EXECUTE on outbox_may_release: an agent
-- login cannot un-pause what an operator paused. The WHEN clause keeps it off
-- every other update. AFTER UPDATE, as every guard of outbox_runs that only
-- refuses: a BEFORE UPDATE row trigger makes PostgreSQL lock the old row version
-- before every update of the table, whatever its WHEN clause or columns say
-- (GetTupleForTrigger), which cost every step a lock and 54 B of WAL.
CREATE OR REPLACE FUNCTION outbox_runs_refuse_resume() RETURNS trigger
    LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    IF NOT has_function_privilege('outbox_may_release()', 'EXECUTE') THEN
        RAISE EXCEPTION 'permission denied: run % was paused by an operator; only a resume '
            'lets it go (a role with EXECUTE on outbox_may_release())', OLD.id
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN NEW;
END
$$;

DROP TRIGGER IF EXISTS outbox_runs_resume_guard ON outbox_runs;
CREATE TRIGGER outbox_runs_resume_guard
    AFTER UPDATE OF status, paused_at ON outbox_runs FOR EACH ROW
    WHEN (NEW.status IN ('runnable', 'running', 'waiting')
          AND (OLD.status = 'paused' OR (OLD.paused_at IS NOT NULL AND NEW.paused_at IS NULL)))
    EXECUTE FUNCTION outbox_runs_refuse_resume();

-- A run that ended stays as it ended, and one being cancelled goes on only to its
-- end: whoever writes the status by hand (an agent login cannot undo an operator's
-- cancel; a fork is a new run). The WHEN clause keeps it off every other update
-- (AFTER UPDATE: see outbox_runs_refuse_resume).
CREATE OR REPLACE FUNCTION outbox_runs_refuse_revival() RETURNS trigger
    LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    RAISE EXCEPTION 'permission denied: run % is %; it cannot become % (a fork starts it '
        'again as a new run)', OLD.id, OLD.status, NEW.status
        USING ERRCODE = 'insufficient_privilege';
END
$$;

DROP TRIGGER IF EXISTS outbox_runs_ended_guard ON outbox_runs;
CREATE TRIGGER outbox_runs_ended_guard
    AFTER UPDATE OF status ON outbox_runs FOR EACH ROW
    WHEN ((OLD.status IN ('completed', 'failed', 'cancelled', 'compensated',
                          'compensation_failed') AND NEW.status <> OLD.status)
          OR (OLD.status IN ('cancelling', 'compensating')
              AND NEW.status NOT IN ('cancelling', 'compensating', 'cancelled', 'compensated',
                                     'compensation_failed')))
    EXECUTE FUNCTION outbox_runs_refuse_revival();

-- A recorded step never changes: its result is what a replay returns, and the
-- run's hash chain covers it. Its hash may be relinked (a fork does), which only
-- verify can judge. The UPDATE trigger costs the step write (an INSERT) nothing.
-- The table's owner (and a superuser) is not refused, as row-level security
-- does not bind it: a hand edit by whoever owns the schema is for `outbox audit
-- verify` to find; an agent login can no longer make one.
CREATE OR REPLACE FUNCTION outbox_steps_refuse_rewrite() RETURNS trigger
    LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    IF pg_has_role((SELECT c.relowner FROM pg_catalog.pg_class AS c WHERE c.oid = TG_RELID),
                   'USAGE') THEN
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'step % of run % is recorded: it never changes', OLD.step_id, OLD.run_id
        USING ERRCODE = 'integrity_constraint_violation';
END
$$;

DROP TRIGGER IF EXISTS outbox_steps_recorded_immutable ON outbox_steps;
CREATE TRIGGER outbox_steps_recorded_immutable
    BEFORE UPDATE ON outbox_steps FOR EACH ROW
    WHEN (OLD.status = 'completed'
          AND (OLD.run_id, OLD.shard, OLD.seq, OLD.step_id, OLD.kind, OLD.result, OLD.error,
               OLD.state, OLD.plan, OLD.completed_at, OLD.status)
              IS DISTINCT FROM
              (NEW.run_id, NEW.shard, NEW.seq, NEW.step_id, NEW.kind, NEW.result, NEW.error,
               NEW.state, NEW.plan, NEW.completed_at, NEW.status))
    EXECUTE FUNCTION outbox_steps_refuse_rewrite();
