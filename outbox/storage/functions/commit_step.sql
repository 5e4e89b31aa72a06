-- Record step_id of run_id: its result, the run's new state and plan (NULL
-- keeps them), the budget its intents reserve and its debits, and (with
-- intents, a JSON array of outbox_intend arguments) more intents. All of it
-- commits with the caller's transaction, or none of it. The step joins its run's
-- hash chain as a v2 link (state and plan as the step row stores them).
CREATE OR REPLACE FUNCTION outbox_commit_step(
    run_id uuid,
    step_id text,
    result jsonb DEFAULT NULL,
    state jsonb DEFAULT NULL,
    plan jsonb DEFAULT NULL,
    intents jsonb DEFAULT NULL,
    step_kind text DEFAULT 'transaction',
    OUT step_seq bigint,
    OUT effect_ids uuid[]
)
    LANGUAGE plpgsql AS $$
DECLARE
    max_bytes integer := outbox_setting('max_payload_bytes')::integer;
    tx_step jsonb := outbox_tx_step(outbox_commit_step.run_id, outbox_commit_step.step_id);
    item jsonb;
    n integer := 0;
    made record;
    unknown_field text;
    found_run record;
    stored_result jsonb;
    stored_state jsonb;
    stored_plan jsonb;
    run_paused boolean;
    head bytea;
    p_result jsonb;
BEGIN
    IF outbox_commit_step.step_kind IS NULL OR outbox_commit_step.step_kind NOT IN ('transaction', 'call') THEN
        PERFORM outbox_refuse('OB001', 'step_kind', outbox_commit_step.step_kind,
            'must be transaction or call');
    END IF;
    -- values over outbox.blob_threshold_bytes are stored by reference, owned by the run
    IF outbox_commit_step.result IS NOT NULL THEN
        PERFORM outbox_check_not_reference('result', outbox_commit_step.result);
        stored_result := outbox_store_value(outbox_commit_step.run_id, outbox_commit_step.result,
            outbox_check_json('result', outbox_commit_step.result, max_bytes));
    END IF;
    IF outbox_commit_step.state IS NOT NULL THEN
        PERFORM outbox_check_not_reference('state', outbox_commit_step.state);
        stored_state := outbox_store_value(outbox_commit_step.run_id, outbox_commit_step.state,
            outbox_check_json('state', outbox_commit_step.state, max_bytes));
    END IF;
    IF outbox_commit_step.plan IS NOT NULL THEN
        PERFORM outbox_check_not_reference('plan', outbox_commit_step.plan);
        stored_plan := outbox_store_value(outbox_commit_step.run_id, outbox_commit_step.plan,
            outbox_check_json('plan', outbox_commit_step.plan, max_bytes));
    END IF;
    effect_ids := ARRAY[]::uuid[];
    IF outbox_commit_step.intents IS NOT NULL THEN
        IF jsonb_typeof(outbox_commit_step.intents) <> 'array' THEN
            PERFORM outbox_refuse('OB001', 'intents', left(outbox_commit_step.intents::text, 80),
                'must be a JSON array of intents');
        END IF;
        FOR item IN SELECT value FROM jsonb_array_elements(outbox_commit_step.intents) LOOP
            IF jsonb_typeof(item) <> 'object' THEN
                PERFORM outbox_refuse('OB001', format('intents[%s]', n), left(item::text, 80),
                    'must be an object');
            END IF;
            SELECT k INTO unknown_field FROM jsonb_object_keys(item) AS k
             WHERE k NOT IN ('kind', 'payload', 'key', 'ordering_key', 'step_index', 'max_attempts',
                             'delay_seconds', 'schema_version', 'compensate', 'cost', 'approval',
                             'priority', 'fairness_key')
             LIMIT 1;
            IF unknown_field IS NOT NULL THEN
                PERFORM outbox_refuse('OB001', format('intents[%s].%s', n, unknown_field), NULL,
                    'is not an argument of outbox_intend');
            END IF;
            SELECT * INTO made FROM outbox_intend(
                kind => item->>'kind',
                payload => item->'payload',
                key => item->>'key',
                ordering_key => item->>'ordering_key',
                run_id => outbox_commit_step.run_id,
                step_id => outbox_commit_step.step_id,
                step_index => (item->>'step_index')::integer,
                max_attempts => (item->>'max_attempts')::integer,
                delay_seconds => coalesce((item->>'delay_seconds')::double precision, 0),
                schema_version => coalesce((item->>'schema_version')::integer, 1),
                compensate => item->'compensate',
                cost => (item->>'cost')::numeric,
                approval => item->'approval',
                priority => (item->>'priority')::integer,
                fairness_key => item->>'fairness_key');
            effect_ids := effect_ids || made.effect_id;
            n := n + 1;
        END LOOP;
        tx_step := outbox_tx_steps()->outbox_tx_step_slot(outbox_commit_step.run_id, outbox_commit_step.step_id);
    END IF;

    -- the step chain hashes the values as stored (a reference for a large one), as Python does
    p_result := coalesce(stored_result, 'null'::jsonb);
    UPDATE outbox_runs AS r
       SET state = coalesce(stored_state, r.state),
           plan = coalesce(stored_plan, r.plan),
           current_step = outbox_commit_step.step_id,
           spent = r.spent + (tx_step->>'debit')::numeric,
           reserved = r.reserved + (tx_step->>'reserve')::numeric,
           -- the run's step chain (see outbox/storage/governance_ddl.py)
           step_head = outbox_step_hash_v2(
               coalesce(r.step_head, outbox_run_genesis(r.id, r.agent, r.inputs_hash)),
               r.id, outbox_commit_step.step_id, outbox_commit_step.step_kind, p_result, NULL,
               stored_state, stored_plan, now())
           -- updated_at is left alone: a step's update must stay HOT (see sql/steps.py)
     WHERE r.id = outbox_commit_step.run_id
       AND r.status = ANY (outbox_active_run_statuses())
       AND (r.budget IS NULL
            OR r.spent + r.reserved + (tx_step->>'debit')::numeric + (tx_step->>'reserve')::numeric <= r.budget)
    RETURNING r.paused_at IS NOT NULL, r.step_head INTO run_paused, head;
    IF NOT FOUND THEN
        SELECT r.status, r.budget, r.spent, r.reserved INTO found_run
          FROM outbox_runs AS r WHERE r.id = outbox_commit_step.run_id;
        IF NOT FOUND OR NOT found_run.status = ANY (outbox_active_run_statuses()) THEN
            PERFORM outbox_raise_run_refusal(outbox_commit_step.run_id);
        ELSE
            PERFORM outbox_raise('OB007',
                format('run_id=%L: step needs %s but only %s remains', outbox_commit_step.run_id,
                       (tx_step->>'debit')::numeric + (tx_step->>'reserve')::numeric,
                       found_run.budget - found_run.spent - found_run.reserved),
                jsonb_build_object('run_id', outbox_commit_step.run_id,
                    'requested', (tx_step->>'debit')::numeric + (tx_step->>'reserve')::numeric,
                    'remaining', found_run.budget - found_run.spent - found_run.reserved));
        END IF;
    END IF;

    -- the step keeps the state and plan it set, so a fork can start from it
    INSERT INTO outbox_steps AS s (run_id, step_id, kind, result, state, plan, hash)
    VALUES (outbox_commit_step.run_id, outbox_commit_step.step_id, outbox_commit_step.step_kind,
            p_result, stored_state, stored_plan, head)
    ON CONFLICT ON CONSTRAINT outbox_steps_pkey DO NOTHING
    RETURNING s.seq INTO step_seq;
    IF step_seq IS NULL THEN
        PERFORM outbox_raise_step_recorded(outbox_commit_step.run_id, outbox_commit_step.step_id);
    END IF;

    IF jsonb_array_length(tx_step->'ledger') > 0 THEN
        INSERT INTO outbox_budget_ledger (run_id, step_id, effect_id, reason, entry, amount)
        SELECT outbox_commit_step.run_id, outbox_commit_step.step_id, l.effect_id, l.reason, l.entry, l.amount
          FROM jsonb_to_recordset(tx_step->'ledger') AS l(entry text, reason text, amount numeric, effect_id uuid);
    END IF;
    -- A pause (outbox runs pause locks the run row FOR UPDATE) cannot commit
    -- after this step's first intent: outbox_tx_step holds the row (KEY SHARE,
    -- 0015) until this transaction ends, so each intent saw any pause
    -- already committed and was written paused. Only a pause set without that
    -- lock leaves pending intents here; they are held with the run's others.
    IF run_paused AND EXISTS (
           SELECT 1 FROM outbox_effects AS e
            WHERE e.run_id = outbox_commit_step.run_id AND e.step_id = outbox_commit_step.step_id
              AND e.status = 'pending') THEN
        UPDATE outbox_effects AS e SET status = 'paused'
         WHERE e.run_id = outbox_commit_step.run_id AND e.step_id = outbox_commit_step.step_id
           AND e.status = 'pending';
    END IF;
    PERFORM outbox_tx_save_step(outbox_commit_step.run_id, outbox_commit_step.step_id,
                                tx_step || '{"done": true}'::jsonb);
    IF (tx_step->>'bytes')::bigint > 0 THEN
        -- Asked again at the step's end, nearer the commit: an intend that was
        -- refused a NOTIFY early in a long transaction may be granted one now.
        PERFORM outbox_wake('outbox_effects');
    END IF;
END
$$;
