CREATE OR REPLACE FUNCTION outbox_start_run(
    agent text,
    version text,
    inputs jsonb DEFAULT NULL,
    budget numeric DEFAULT NULL,
    run_id uuid DEFAULT NULL,
    key text DEFAULT NULL,
    on_conflict text DEFAULT 'return_existing',
    priority integer DEFAULT 0,
    fairness_key text DEFAULT '',
    mode text DEFAULT 'live'
) RETURNS uuid
    LANGUAGE plpgsql AS $$
DECLARE
    rules jsonb := outbox_intent_rules();
    p_inputs jsonb := coalesce(outbox_start_run.inputs, 'null'::jsonb);
    p_id uuid := coalesce(outbox_start_run.run_id, outbox_uuid7());
    p_dry boolean := outbox_start_run.mode = 'dry_run';
    canonical text;
    p_hash text;
    stored jsonb;
    started uuid;
    existing record;
BEGIN
    PERFORM outbox_check_text('agent', outbox_start_run.agent, (rules->>'max_agent_length')::integer);
    PERFORM outbox_check_text('version', outbox_start_run.version, (rules->>'max_version_length')::integer);
    PERFORM outbox_check_not_reference('inputs', p_inputs);
    canonical := outbox_check_json('inputs', p_inputs, outbox_setting('max_payload_bytes')::integer);
    PERFORM outbox_check_amount('budget', outbox_start_run.budget);
    PERFORM outbox_check_text('key', outbox_start_run.key, (rules->>'max_key_length')::integer, false);
    IF outbox_start_run.on_conflict IS NULL
       OR outbox_start_run.on_conflict NOT IN ('return_existing', 'reject') THEN
        PERFORM outbox_refuse('OB001', 'on_conflict', outbox_start_run.on_conflict,
            'must be return_existing or reject');
    END IF;
    IF outbox_start_run.priority IS NULL THEN
        PERFORM outbox_refuse('OB001', 'priority', NULL, 'is required');
    END IF;
    IF outbox_start_run.fairness_key IS NULL THEN
        PERFORM outbox_refuse('OB001', 'fairness_key', NULL, 'is required ('''' for none)');
    END IF;
    PERFORM outbox_check_lane(outbox_start_run.priority, outbox_start_run.fairness_key);
    IF outbox_start_run.mode IS NULL OR outbox_start_run.mode NOT IN ('live', 'dry_run') THEN
        PERFORM outbox_refuse('OB001', 'mode', outbox_start_run.mode, 'must be live or dry_run');
    END IF;
    p_hash := encode(sha256(convert_to(canonical, 'UTF8')), 'hex');
    -- (a start answered with another run leaves this reference ownerless: gc takes it)
    stored := outbox_store_value(p_id, p_inputs, canonical);
    -- no conflict target: the id and the business key are both unique
    INSERT INTO outbox_runs AS r (id, agent, agent_version, inputs, inputs_hash, status, budget,
                                  key, priority, fairness_key, dry_run)
    VALUES (p_id, outbox_start_run.agent, outbox_start_run.version, stored, p_hash, 'runnable',
            outbox_start_run.budget, outbox_start_run.key, outbox_start_run.priority,
            outbox_start_run.fairness_key, p_dry)
    ON CONFLICT DO NOTHING
    RETURNING r.id INTO started;
    IF started IS NULL THEN
        SELECT r.id, r.agent, r.agent_version, r.inputs, r.inputs_hash, r.dry_run INTO existing
          FROM outbox_runs AS r WHERE r.id = p_id;
        IF FOUND THEN
            IF existing.agent <> outbox_start_run.agent
               OR existing.agent_version <> outbox_start_run.version
               OR NOT (existing.inputs_hash = p_hash OR outbox_resolve(existing.inputs) = p_inputs) THEN
                PERFORM outbox_refuse('OB001', 'run_id', p_id::text,
                    'names a run started with another agent, version or inputs');
            END IF;
            IF existing.dry_run <> p_dry THEN
                PERFORM outbox_refuse('OB001', 'mode', outbox_start_run.mode,
                    format('run_id %s names a run started in the other mode', p_id));
            END IF;
            RETURN p_id;
        END IF;
        SELECT r.id, r.agent, r.agent_version, r.inputs, r.inputs_hash, r.dry_run INTO existing
          FROM outbox_runs AS r WHERE r.key = outbox_start_run.key;
        IF NOT FOUND THEN
            PERFORM outbox_raise_conflict(outbox_start_run.key,
                'started concurrently by another transaction');
        END IF;
        IF existing.agent <> outbox_start_run.agent
           OR existing.agent_version <> outbox_start_run.version
           OR NOT (existing.inputs_hash = p_hash OR outbox_resolve(existing.inputs) = p_inputs) THEN
            PERFORM outbox_raise_conflict(outbox_start_run.key,
                format('run %s was started with this key as %s %s with other inputs',
                       existing.id, existing.agent, existing.agent_version));
        END IF;
        IF existing.dry_run <> p_dry THEN
            PERFORM outbox_raise_conflict(outbox_start_run.key,
                format('run %s was started with this key in the other mode', existing.id));
        END IF;
        IF outbox_start_run.on_conflict = 'reject' THEN
            PERFORM outbox_raise_run_exists(outbox_start_run.key, existing.id);
        END IF;
        RETURN existing.id;
    END IF;
    PERFORM outbox_wake('outbox_runs');
    RETURN p_id;
END
$$;
