-- Start a run of agent at version with inputs: the one implementation, for every
-- client. A run with a business key is the only one with that key in its
-- namespace (G5 for runs; the key is registered on its own shard, and a run
-- given no id gets one on that shard, so the start touches one shard):
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
    namespace text DEFAULT NULL,
    OUT run outbox_runs,
    OUT created boolean
)
    LANGUAGE plpgsql AS $$
DECLARE
    rules jsonb := outbox_intent_rules();
    p_inputs jsonb := coalesce(outbox_begin_run.inputs, 'null'::jsonb);
    p_ns text := coalesce(outbox_begin_run.namespace, 'default');
    p_id uuid := outbox_begin_run.run_id;
    p_dry boolean := outbox_begin_run.mode = 'dry_run';
    holder uuid;
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
    PERFORM outbox_check_namespace(p_ns);
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
    IF outbox_begin_run.key IS NOT NULL THEN
        p_id := coalesce(p_id, outbox_on_shard(outbox_uuid7(),
                                               outbox_key_shard(p_ns, outbox_begin_run.key)));
        -- racers on one key queue on its row here; the first one's run holds it
        INSERT INTO outbox_run_keys AS k (namespace, key, shard, run_id)
        VALUES (p_ns, outbox_begin_run.key, outbox_key_shard(p_ns, outbox_begin_run.key), p_id)
        ON CONFLICT ON CONSTRAINT outbox_run_keys_pkey DO NOTHING
        RETURNING k.run_id INTO holder;
        IF holder IS NULL THEN
            SELECT k.run_id INTO holder FROM outbox_run_keys AS k
             WHERE k.namespace = p_ns AND k.key = outbox_begin_run.key
               AND k.shard = outbox_key_shard(p_ns, outbox_begin_run.key);
            IF holder <> p_id THEN
                PERFORM outbox_existing_run(holder, p_ns, outbox_begin_run.key, on_conflict,
                    outbox_begin_run.agent, outbox_begin_run.version, p_inputs, p_hash, p_dry);
                SELECT r.* INTO run FROM outbox_runs AS r
                 WHERE r.id = holder AND r.shard = outbox_shard_of(holder);
                created := false;
                RETURN;
            END IF;
        END IF;
    END IF;
    p_id := coalesce(p_id, outbox_uuid7());
    -- (a start answered with another run leaves this reference ownerless: gc takes it)
    stored := CASE WHEN octet_length(rendered) > outbox_limit('blob_threshold_bytes')
                   THEN outbox_store_value(p_id, p_inputs, rendered) ELSE p_inputs END;
    INSERT INTO outbox_runs AS r (id, shard, namespace, agent, agent_version, inputs, inputs_hash,
                                  status, budget, key, priority, fairness_key, dry_run, trace_parent)
    VALUES (p_id, outbox_shard_of(p_id), p_ns, outbox_begin_run.agent, outbox_begin_run.version,
            stored, p_hash, 'runnable', outbox_begin_run.budget, outbox_begin_run.key,
            outbox_begin_run.priority, outbox_begin_run.fairness_key, p_dry,
            nullif(outbox_begin_run.trace_parent, ''))
    ON CONFLICT ON CONSTRAINT outbox_runs_pkey DO NOTHING
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
    -- the id names a run already: a retry of this start, or a conflict
    SELECT r.* INTO run FROM outbox_runs AS r WHERE r.id = p_id AND r.shard = outbox_shard_of(p_id);
    IF run.agent <> outbox_begin_run.agent OR run.agent_version <> outbox_begin_run.version
       OR NOT (run.inputs_hash = p_hash OR outbox_resolve(run.inputs, run.shard) = p_inputs)
       OR run.budget IS DISTINCT FROM outbox_begin_run.budget OR run.dry_run <> p_dry
       OR (outbox_begin_run.key IS NOT NULL AND run.key IS DISTINCT FROM outbox_begin_run.key)
       OR run.namespace <> p_ns THEN
        PERFORM outbox_refuse('OB001', 'run_id', p_id::text,
            'names a run started with another agent, version, inputs, budget, key or mode');
    END IF;
END
$$;

-- A start under a key another run (holder) holds: that run, when it was started
-- with the same agent, version, inputs and mode and on_conflict is
-- return_existing; else OB010 (reject) or OB003 (a conflict).
CREATE OR REPLACE FUNCTION outbox_existing_run(
    holder uuid, p_ns text, p_key text, p_on_conflict text, p_agent text, p_version text,
    p_inputs jsonb, p_hash text, p_dry boolean
) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    run outbox_runs;
BEGIN
    SELECT r.* INTO run FROM outbox_runs AS r
     WHERE r.id = holder AND r.shard = outbox_shard_of(holder);
    IF NOT FOUND THEN
        PERFORM outbox_raise_conflict(p_key, 'started concurrently by another transaction');
    END IF;
    IF run.agent <> p_agent OR run.agent_version <> p_version
       OR NOT (run.inputs_hash = p_hash OR outbox_resolve(run.inputs, run.shard) = p_inputs) THEN
        PERFORM outbox_raise_conflict(p_key,
            format('a run was started with this key as %s %s with other inputs',
                   run.agent, run.agent_version));
    END IF;
    IF run.dry_run <> p_dry THEN
        PERFORM outbox_raise_conflict(p_key, 'a run was started with this key in the other mode');
    END IF;
    IF p_on_conflict = 'reject' THEN
        PERFORM outbox_raise_run_exists(p_key, run.id);
    END IF;
END
$$;

-- A namespace: lower-case letters, digits, '.', '_' and '-', at most 63.
CREATE OR REPLACE FUNCTION outbox_check_namespace(namespace text) RETURNS void
    LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF namespace IS NULL OR namespace !~ '^[a-z0-9][a-z0-9._-]{0,62}$' THEN
        PERFORM outbox_refuse('OB001', 'namespace', namespace,
            'must be 1 to 63 lower-case letters, digits, ".", "_" or "-", starting with a letter or digit');
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
    mode text DEFAULT 'live',
    namespace text DEFAULT NULL
) RETURNS uuid
    LANGUAGE sql AS $$
SELECT (b.run).id FROM outbox_begin_run(agent, version, inputs, budget, run_id, key, on_conflict,
                                        priority, fairness_key, mode, NULL, NULL, namespace) AS b
$$;
