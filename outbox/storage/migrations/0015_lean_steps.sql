-- agent-outbox 0015: a step writes less WAL (issue 15, the write path).
-- Must stay equal to outbox/storage/schema.py (tests/integration/test_migrations.py checks it).

-- A step's update of its run row wrote a row-lock record to the WAL before the
-- update itself (54 bytes a step): the BEFORE UPDATE trigger below locks the old
-- row version to hand it to the trigger, and with that gone the foreign keys of
-- outbox_steps and outbox_effects lock it (FOR KEY SHARE) for their check.
--
-- The inputs stay immutable (G6) with an AFTER trigger: its WHEN clause is judged
-- on the rows the update already has, and raising there undoes the update alike.
DROP TRIGGER outbox_runs_inputs_immutable ON outbox_runs;
CREATE TRIGGER outbox_runs_inputs_immutable
    AFTER UPDATE ON outbox_runs FOR EACH ROW
    WHEN (OLD.agent IS DISTINCT FROM NEW.agent
          OR OLD.inputs_hash IS DISTINCT FROM NEW.inputs_hash
          OR OLD.inputs IS DISTINCT FROM NEW.inputs)
    EXECUTE FUNCTION outbox_runs_refuse_input_change();

-- Steps and effects keep their run_id without a foreign key to outbox_runs: the
-- key's check proved nothing the step's own statement had not (it updates the run
-- row it names, or finds none and writes nothing). Every writer of steps or
-- intents holds the run row first (commit_step updates it; waits, stopping and
-- forks lock or insert it; the SQL API's outbox_tx_step below locks it), and
-- `outbox gc` deletes a run's steps and effects itself before the run.
ALTER TABLE outbox_steps DROP CONSTRAINT IF EXISTS outbox_steps_run_id_fkey;
ALTER TABLE outbox_effects DROP CONSTRAINT IF EXISTS outbox_effects_run_id_fkey;

-- current_step moves to the end of the row. A step updates current_step and
-- step_head; the WAL record of that (HOT) update holds the bytes between the
-- first and the last changed column, which were a dozen columns apart.
ALTER TABLE outbox_runs RENAME COLUMN current_step TO current_step_0014;
ALTER TABLE outbox_runs ADD COLUMN current_step TEXT;
UPDATE outbox_runs SET current_step = current_step_0014 WHERE current_step_0014 IS NOT NULL;
ALTER TABLE outbox_runs DROP COLUMN current_step_0014;

-- @functions: the SQL API (0013) with the run row locked where the foreign keys
-- used to lock it. outbox/storage/schema.py runs everything below this line after
-- creating the tables (and after 0007's, 0010's and 0013's parts).

-- The state of (run_id, step_id) in this transaction. The first time a step is
-- met, the run must exist and accept steps, and the step must not be recorded
-- yet; a step already committed in this transaction takes no more writes. The
-- run row stays locked (FOR KEY SHARE) until commit: a pause or a cancellation
-- (FOR UPDATE) waits for the step's transaction, and the run cannot be deleted
-- under its intents.
CREATE OR REPLACE FUNCTION outbox_tx_step(p_run_id uuid, p_step_id text) RETURNS jsonb
    LANGUAGE plpgsql AS $$
DECLARE
    entry jsonb := outbox_tx_steps()->outbox_tx_step_slot(p_run_id, p_step_id);
    run_status text;
BEGIN
    IF entry IS NOT NULL THEN
        IF (entry->>'done')::boolean THEN
            PERFORM outbox_refuse('OB001', 'step_id', p_step_id,
                'outbox_commit_step already recorded this step in this transaction: '
                'write its intents and debits before committing it');
        END IF;
        RETURN entry;
    END IF;
    PERFORM outbox_check_text('step_id', p_step_id, outbox_setting('max_step_id_length')::integer,
                              true, true);
    SELECT r.status INTO run_status FROM outbox_runs AS r WHERE r.id = p_run_id FOR KEY SHARE;
    IF NOT FOUND OR NOT run_status = ANY (outbox_active_run_statuses()) THEN
        -- missing, paused (it takes no steps until resumed) or ended
        PERFORM outbox_raise_run_refusal(p_run_id);
    END IF;
    IF EXISTS (SELECT 1 FROM outbox_steps AS s WHERE s.run_id = p_run_id AND s.step_id = p_step_id) THEN
        PERFORM outbox_raise_step_recorded(p_run_id, p_step_id);
    END IF;
    entry := jsonb_build_object('next', 0, 'count', 0, 'bytes', 0, 'debit', 0, 'reserve', 0,
                                'ledger', '[]'::jsonb, 'done', false);
    -- saved now: the commit-time check (outbox_effects_step_committed) only
    -- sees rows inserted while this setting is present
    PERFORM outbox_tx_save_step(p_run_id, p_step_id, entry);
    RETURN entry;
END
$$;
