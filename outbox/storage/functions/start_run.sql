-- Start a run of agent at version with inputs: the one implementation, for every
-- client. A run with a business key is the only one with that key (G5 for runs):
-- starting it again returns the existing run when agent, version, inputs and mode
-- are the same (on_conflict 'return_existing'), or OB010 (on_conflict 'reject');
-- anything else is OB003. run_id names the run to start (a retry of a start that
-- may have committed returns it). mode 'dry_run' starts a dry run (its effects
-- go to the recording deliverer). The run is runnable: a worker of its agent and
-- version claims it; its lane (priority, fairness_key) orders claims.
--
-- outbox_start_run returns the run's id; outbox_begin_run, which it calls,
-- returns the row as stored and whether this call created it.
CREATE OR REPLACE FUNCTION outbox_begin_run(
    agent text,
    version text,
    inputs jsonb DEFAULT NULL,
    budget numeric DEFAULT NULL,
    run_id uuid DEFAULT NULL,
    key text DEFAULT NULL,
    on_conflict text DEFAULT 'return_existing',
    priority integer DEFAULT 0,
    fairness_key text DEFAULT '',
    mode text DEFAULT 'live',
    trace_parent text DEFAULT NULL,
    wake boolean DEFAULT NULL,
    OUT run outbox_runs,
    OUT created boolean
)
    LANGUAGE plpgsql AS $$
DECLARE
    rules jsonb := outbox_intent_rules();
    p_inputs jsonb := coalesce(outbox_begin_run.inputs, 'null'::jsonb);
    p_id uuid := coalesce(outbox_begin_run.run_id, outbox_uuid7());
    p_dry boolean := outbox_begin_run.mode = 'dry_run';
    rendered text;
    p_hash text;
    stored jsonb;
BEGIN
    PERFORM outbox_check_text('agent', outbox_begin_run.agent, (rules->>'max_agent_length')::integer);
    PERFORM outbox_check_text('version', outbox_begin_run.version, (rules->>'max_version_length')::integer);
    PERFORM outbox_check_not_reference('inputs', p_inputs);
    rendered := outbox_check_json('inputs', p_inputs, outbox_limit('max_payload_bytes'));
    PERFORM outbox_check_amount('budget', outbox_begin_run.budget);
    PERFORM outbox_check_text('key', outbox_begin_run.key, (rules->>'max_key_length')::integer, false);
    IF on_conflict IS NULL OR on_conflict NOT IN ('return_existing', 'reject') THEN
        PERFORM outbox_refuse('OB001', 'on_conflict', on_conflict, 'must be return_existing or reject');
    END IF;
    IF outbox_begin_run.priority IS NULL THEN
        PERFORM outbox_refuse('OB001', 'priority', NULL, 'is required');
    END IF;
    IF outbox_begin_run.fairness_key IS NULL THEN
        PERFORM outbox_refuse('OB001', 'fairness_key', NULL, 'is required ('''' for none)');
    END IF;
    PERFORM outbox_check_lane(outbox_begin_run.priority, outbox_begin_run.fairness_key);
    IF mode IS NULL OR mode NOT IN ('live', 'dry_run') THEN
        PERFORM outbox_refuse('OB001', 'mode', mode, 'must be live or dry_run');
    END IF;
    IF coalesce(outbox_begin_run.trace_parent, '') !~ '^([0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2})?$' THEN
        PERFORM outbox_refuse('OB001', 'trace_parent', outbox_begin_run.trace_parent,
            'must be a W3C traceparent (00-<trace id>-<span id>-<flags>)');
    END IF;
    p_hash := encode(sha256(convert_to(rendered, 'UTF8')), 'hex');
    -- (a start answered with another run leaves this reference ownerless: gc takes it)
    stored := CASE WHEN octet_length(rendered) > outbox_limit('blob_threshold_bytes')
                   THEN outbox_store_value(p_id, p_inputs, rendered) ELSE p_inputs END;
    -- no conflict target: the id and the business key are both unique
    INSERT INTO outbox_runs AS r (id, agent, agent_version, inputs, inputs_hash, status, budget,
                                  key, priority, fairness_key, dry_run, trace_parent)
    VALUES (p_id, outbox_begin_run.agent, outbox_begin_run.version, stored, p_hash, 'runnable',
            outbox_begin_run.budget, outbox_begin_run.key, outbox_begin_run.priority,
            outbox_begin_run.fairness_key, p_dry, nullif(outbox_begin_run.trace_parent, ''))
    ON CONFLICT DO NOTHING
    RETURNING r.* INTO run;
    created := run.id IS NOT NULL;
    IF created THEN
        IF wake IS DISTINCT FROM false THEN
            IF wake THEN
                PERFORM pg_notify('outbox_runs', '');
            ELSE
                PERFORM outbox_wake('outbox_runs');
            END IF;
        END IF;
        RETURN;
    END IF;
    -- the id or the key names a run already: the same start, or a conflict
    SELECT r.* INTO run FROM outbox_runs AS r WHERE r.id = p_id;
    IF FOUND THEN
        IF run.agent <> outbox_begin_run.agent OR run.agent_version <> outbox_begin_run.version
           OR NOT (run.inputs_hash = p_hash OR outbox_resolve(run.inputs) = p_inputs) THEN
            PERFORM outbox_refuse('OB001', 'run_id', p_id::text,
                'names a run started with another agent, version or inputs');
        END IF;
        IF run.dry_run <> p_dry THEN
            PERFORM outbox_refuse('OB001', 'mode', mode,
                format('run_id %s names a run started in the other mode', p_id));
        END IF;
        RETURN;
    END IF;
    SELECT r.* INTO run FROM outbox_runs AS r WHERE r.key = outbox_begin_run.key;
    IF NOT FOUND THEN
        PERFORM outbox_raise_conflict(outbox_begin_run.key, 'started concurrently by another transaction');
    END IF;
    IF run.agent <> outbox_begin_run.agent OR run.agent_version <> outbox_begin_run.version
       OR NOT (run.inputs_hash = p_hash OR outbox_resolve(run.inputs) = p_inputs) THEN
        PERFORM outbox_raise_conflict(outbox_begin_run.key,
            format('a run was started with this key as %s %s with other inputs',
                   run.agent, run.agent_version));
    END IF;
    IF run.dry_run <> p_dry THEN
        PERFORM outbox_raise_conflict(outbox_begin_run.key,
            'a run was started with this key in the other mode');
    END IF;
    IF on_conflict = 'reject' THEN
        PERFORM outbox_raise_run_exists(outbox_begin_run.key, run.id);
    END IF;
END
$$;

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
    LANGUAGE sql AS $$
SELECT (b.run).id FROM outbox_begin_run(agent, version, inputs, budget, run_id, key, on_conflict,
                                        priority, fairness_key, mode) AS b
$$;
