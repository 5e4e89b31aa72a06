-- What a run started from never changes. The WHEN clause keeps the function out
-- of every ordinary step update.
CREATE OR REPLACE FUNCTION outbox_runs_refuse_input_change() RETURNS trigger
    LANGUAGE plpgsql AS $$
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
