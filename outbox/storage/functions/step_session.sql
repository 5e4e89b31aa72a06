-- What this transaction wrote through the SQL API for each (run, step) not yet
-- committed: the next intent index, how many intents and bytes, budget debits
-- and reservations. Kept in transaction-local settings, so a rollback (or a
-- rollback to a savepoint) forgets it together with the rows.
CREATE OR REPLACE FUNCTION outbox_tx_steps() RETURNS jsonb
    LANGUAGE sql STABLE AS $$
SELECT coalesce(nullif(current_setting('outbox.tx_steps', true), ''), '{}')::jsonb
$$;

CREATE OR REPLACE FUNCTION outbox_tx_step_slot(run_id uuid, step_id text) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT run_id::text || ' ' || step_id
$$;

CREATE OR REPLACE FUNCTION outbox_tx_save_step(run_id uuid, step_id text, entry jsonb) RETURNS void
    LANGUAGE sql AS $$
SELECT set_config('outbox.tx_steps',
    jsonb_set(outbox_tx_steps(), ARRAY[outbox_tx_step_slot(run_id, step_id)], entry)::text, true)
$$;

-- The state of (run_id, step_id) in this transaction. The first time a step is
-- met, the run must exist and accept steps, and the step must not be recorded
-- yet; a step already committed in this transaction takes no more writes. The
-- run row stays locked (FOR NO KEY UPDATE) until commit, as outbox_commit_step's
-- update would lock it: a pause or a cancellation waits for the step's
-- transaction, and of two transactions writing the same step the second waits
-- for the first and then finds its step recorded (OB006).
CREATE OR REPLACE FUNCTION outbox_tx_step(p_run_id uuid, p_step_id text) RETURNS jsonb
    LANGUAGE plpgsql AS $$
DECLARE
    entry jsonb := outbox_tx_steps()->outbox_tx_step_slot(p_run_id, p_step_id);
    run_status text;
    recorded_here boolean;
BEGIN
    IF entry IS NULL AND outbox_distributed() THEN
        -- this transaction's notes are kept on the node it runs on, and on Citus the
        -- step's write runs on another (outbox_write_step is delegated)
        PERFORM outbox_refuse('OB001', 'run_id', p_run_id::text,
            'on a distributed database a step''s intents and debits go to outbox_commit_step '
            'in its one call (intents => ..., spends => ...)');
    END IF;
    IF entry IS NOT NULL THEN
        IF (entry->>'done')::boolean THEN
            PERFORM outbox_refuse('OB001', 'step_id', p_step_id,
                'outbox_commit_step already recorded this step in this transaction: '
                'write its intents and debits before committing it');
        END IF;
        RETURN entry;
    END IF;
    PERFORM outbox_check_text('step_id', p_step_id, outbox_limit('max_step_id_length')::integer,
                              true, true);
    SELECT r.status INTO run_status FROM outbox_runs AS r
     WHERE r.id = p_run_id AND r.shard = outbox_shard_of(p_run_id) FOR NO KEY UPDATE;
    IF NOT FOUND OR NOT run_status = ANY (outbox_active_run_statuses()) THEN
        -- missing, paused (it takes no steps until resumed) or ended
        PERFORM outbox_raise_run_refusal(p_run_id);
    END IF;
    SELECT s.xmin = pg_current_xact_id()::xid INTO recorded_here
      FROM outbox_steps AS s
     WHERE s.run_id = p_run_id AND s.step_id = p_step_id AND s.shard = outbox_shard_of(p_run_id);
    IF recorded_here THEN
        PERFORM outbox_refuse('OB001', 'step_id', p_step_id,
            'outbox_commit_step already recorded this step in this transaction: '
            'write its intents and debits before committing it');
    ELSIF FOUND THEN
        PERFORM outbox_raise_step_recorded(p_run_id, p_step_id);
    END IF;
    entry := jsonb_build_object('next', 0, 'count', 0, 'bytes', 0, 'debit', 0, 'reserve', 0,
                                'ledger', '[]'::jsonb, 'chain', '[]'::jsonb, 'claimable', false,
                                'ids', '[]'::jsonb, 'done', false);
    -- saved now: the commit-time check (outbox_effects_step_committed) only
    -- sees rows inserted while this setting is present
    PERFORM outbox_tx_save_step(p_run_id, p_step_id, entry);
    RETURN entry;
END
$$;

-- At commit: every intent the SQL API wrote for a step was followed by
-- outbox_commit_step for that step (G1: intents never commit without their
-- checkpoint). The WHEN clause keeps it off every other insert.
CREATE OR REPLACE FUNCTION outbox_effects_check_step_committed() RETURNS trigger
    LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    entry jsonb := outbox_tx_steps()->outbox_tx_step_slot(NEW.run_id, NEW.step_id);
BEGIN
    IF entry IS NOT NULL AND NOT (entry->>'done')::boolean THEN
        PERFORM outbox_raise('OB008',
            format('step_id=%L of run %s: intents were written but outbox_commit_step was not '
                   'called for the step before commit', NEW.step_id, NEW.run_id),
            jsonb_build_object('run_id', NEW.run_id, 'step_id', NEW.step_id));
    END IF;
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS outbox_effects_step_committed ON outbox_effects;
CREATE CONSTRAINT TRIGGER outbox_effects_step_committed
    AFTER INSERT ON outbox_effects DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
    WHEN (NEW.run_id IS NOT NULL AND current_setting('outbox.tx_steps', true) <> '')
    EXECUTE FUNCTION outbox_effects_check_step_committed();
