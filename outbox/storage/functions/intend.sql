CREATE OR REPLACE FUNCTION outbox_intend(
    kind text,
    payload jsonb,
    key text DEFAULT NULL,
    ordering_key text DEFAULT NULL,
    run_id uuid DEFAULT NULL,
    step_id text DEFAULT NULL,
    step_index integer DEFAULT NULL,
    max_attempts integer DEFAULT NULL,
    delay_seconds double precision DEFAULT 0,
    schema_version integer DEFAULT 1,
    compensate jsonb DEFAULT NULL,
    cost numeric DEFAULT NULL,
    approval jsonb DEFAULT NULL,
    priority integer DEFAULT NULL,
    fairness_key text DEFAULT NULL,
    OUT effect_id uuid,
    OUT idempotency_key text,
    OUT created boolean
)
    LANGUAGE plpgsql AS $$
DECLARE
    rules jsonb := outbox_intent_rules();
    max_bytes integer := outbox_setting('max_payload_bytes')::integer;
    canonical text;
    size bigint;
    p_hash text;
    p_key text := outbox_intend.key;
    idx integer;
    entry jsonb;
    new_id uuid := outbox_uuid7();
    existing record;
    lane record;
    p_kind text := outbox_intend.kind;
    dry boolean := false;
    policy jsonb;
    stored jsonb;
BEGIN
    PERFORM outbox_check_kind('kind', outbox_intend.kind);
    IF outbox_intend.payload IS NULL THEN
        PERFORM outbox_refuse('OB001', 'payload', NULL,
            'is required (pass ''null''::jsonb for a JSON null)');
    END IF;
    IF p_key IS NOT NULL THEN
        PERFORM outbox_check_text('key', p_key, (rules->>'max_key_length')::integer);
    END IF;
    IF outbox_intend.ordering_key IS NOT NULL THEN
        PERFORM outbox_check_text('ordering_key', outbox_intend.ordering_key,
                                  (rules->>'max_key_length')::integer);
    END IF;
    IF outbox_intend.max_attempts IS NOT NULL
       AND outbox_intend.max_attempts NOT BETWEEN 1 AND (rules->>'max_attempts')::integer THEN
        PERFORM outbox_refuse('OB001', 'max_attempts', outbox_intend.max_attempts::text,
            'must be between 1 and ' || (rules->>'max_attempts'));
    END IF;
    IF outbox_intend.delay_seconds IS NULL
       OR NOT outbox_intend.delay_seconds BETWEEN 0 AND (rules->>'max_delay_seconds')::double precision THEN
        PERFORM outbox_refuse('OB001', 'delay_seconds', outbox_intend.delay_seconds::text,
            'must be between 0 and ' || (rules->>'max_delay_seconds'));
    END IF;
    IF outbox_intend.schema_version IS NULL OR outbox_intend.schema_version < 1 THEN
        PERFORM outbox_refuse('OB001', 'schema_version', outbox_intend.schema_version::text,
            'must be at least 1');
    END IF;
    IF outbox_intend.cost IS NOT NULL THEN
        PERFORM outbox_check_amount('cost', outbox_intend.cost);
    END IF;
    IF outbox_intend.compensate IS NOT NULL THEN
        IF jsonb_typeof(outbox_intend.compensate) <> 'object'
           OR NOT outbox_intend.compensate ? 'kind' OR NOT outbox_intend.compensate ? 'payload'
           OR (SELECT count(*) FROM jsonb_object_keys(outbox_intend.compensate)) <> 2
           OR jsonb_typeof(outbox_intend.compensate->'kind') <> 'string' THEN
            PERFORM outbox_refuse('OB001', 'compensate', left(outbox_intend.compensate::text, 80),
                'must be {"kind": "...", "payload": ...}');
        END IF;
        IF (outbox_intend.compensate->>'kind') !~ (rules->>'kind_pattern') THEN
            PERFORM outbox_refuse('OB001', 'compensate', outbox_intend.compensate->>'kind',
                format('kind %L must match %s', outbox_intend.compensate->>'kind', rules->>'kind_pattern'));
        END IF;
    END IF;
    policy := outbox_approval_policy(outbox_intend.approval);
    PERFORM outbox_check_lane(outbox_intend.priority, outbox_intend.fairness_key);
    PERFORM outbox_check_not_reference('payload', outbox_intend.payload);
    PERFORM outbox_check_payload(outbox_intend.payload, 'payload');
    canonical := outbox_check_json('payload', outbox_intend.payload, max_bytes);
    size := octet_length(canonical);
    IF outbox_intend.compensate IS NOT NULL THEN
        PERFORM outbox_check_payload(outbox_intend.compensate->'payload', 'compensate.payload');
        size := size + octet_length(outbox_check_json('compensate', outbox_intend.compensate, max_bytes));
    END IF;
    p_hash := encode(sha256(convert_to(canonical, 'UTF8')), 'hex');

    IF (outbox_intend.run_id IS NULL) <> (outbox_intend.step_id IS NULL) THEN
        PERFORM outbox_refuse('OB001', CASE WHEN outbox_intend.run_id IS NULL THEN 'run_id' ELSE 'step_id' END,
            NULL, 'run_id and step_id go together: an intent belongs to a step of a run, or to no run');
    END IF;
    IF outbox_intend.run_id IS NOT NULL THEN
        entry := outbox_tx_step(outbox_intend.run_id, outbox_intend.step_id);
        idx := coalesce(outbox_intend.step_index, (entry->>'next')::integer);
        IF idx < 0 THEN
            PERFORM outbox_refuse('OB001', 'step_index', idx::text, 'must not be negative');
        END IF;
    ELSIF outbox_intend.step_index IS NOT NULL THEN
        PERFORM outbox_refuse('OB001', 'step_index', outbox_intend.step_index::text,
            'belongs to a step: pass run_id and step_id too');
    ELSE
        -- intents of no run count per transaction, like Python's OutboxTransaction
        entry := coalesce(nullif(current_setting('outbox.tx_intents', true), ''),
                          '{"count": 0, "bytes": 0}')::jsonb;
    END IF;
    IF (entry->>'count')::integer >= outbox_setting('max_step_intents')::integer THEN
        PERFORM outbox_refuse('OB001', 'intents', ((entry->>'count')::integer + 1)::text,
            format('a step or transaction may intend at most %s effects (outbox.max_step_intents)',
                   outbox_setting('max_step_intents')));
    END IF;
    IF (entry->>'bytes')::bigint + size > outbox_setting('max_step_bytes')::bigint THEN
        PERFORM outbox_refuse('OB002', 'intents', format('<%s bytes>', (entry->>'bytes')::bigint + size),
            format('the payloads of one step or transaction may total at most %s bytes '
                   '(outbox.max_step_bytes)', outbox_setting('max_step_bytes')));
    END IF;
    IF outbox_intend.run_id IS NOT NULL THEN
        p_key := coalesce(p_key, outbox_derive_key(outbox_intend.run_id, outbox_intend.step_id, idx));
        -- the run's lane; a pause already set holds the intent (outbox_commit_step
        -- holds it too when a pause commits while this transaction runs)
        SELECT r.priority, r.fairness_key, r.paused_at IS NOT NULL AS paused, r.dry_run
          INTO lane FROM outbox_runs AS r WHERE r.id = outbox_intend.run_id;
    ELSE
        p_key := coalesce(p_key, replace(gen_random_uuid()::text, '-', ''));
        SELECT 0 AS priority, '' AS fairness_key, false AS paused, false AS dry_run INTO lane;
    END IF;
    dry := coalesce(lane.dry_run, false);
    IF dry THEN
        -- A dry run's intents are served by the recording deliverer, never a sink
        -- (outbox.runs.intents does the same), and ask for no approval.
        p_kind := (outbox_reserved_kind_prefixes())[1] || p_kind;
        IF outbox_intend.key IS NOT NULL THEN
            p_key := (outbox_reserved_kind_prefixes())[1] || outbox_intend.run_id::text || ':' || p_key;
        END IF;
        policy := NULL;
    ELSE
        -- A configured gate wins over the intent's own policy: an intent can add a
        -- gate, never loosen one (as the Python client's statement does).
        SELECT CASE WHEN g.name IS NULL THEN policy
                    ELSE jsonb_build_object('gate', g.name, 'timeout', g.timeout_seconds,
                                            'on_timeout', g.on_timeout, 'escalate_to', g.escalate_to)
               END
          INTO policy
          FROM (SELECT 1) AS one
          LEFT JOIN LATERAL (
              SELECT gg.name, gg.timeout_seconds, gg.on_timeout, gg.escalate_to
                FROM outbox_gates AS gg
               WHERE gg.kind = p_kind AND outbox_gate_matches(gg.conditions, outbox_intend.payload)
               ORDER BY gg.name LIMIT 1) AS g ON true;
    END IF;
    stored := outbox_store_value(coalesce(outbox_intend.run_id, new_id), outbox_intend.payload,
                                 canonical);

    INSERT INTO outbox_effects AS e (
        id, run_id, step_id, step_index, kind, payload, payload_hash, schema_version,
        idempotency_key, ordering_key, max_attempts, compensate, cost, priority, fairness_key,
        status, available_at, approval, approval_deadline)
    VALUES (
        new_id, outbox_intend.run_id, outbox_intend.step_id, idx, p_kind,
        stored, p_hash, outbox_intend.schema_version, p_key,
        outbox_intend.ordering_key, outbox_intend.max_attempts, outbox_intend.compensate,
        outbox_intend.cost, coalesce(outbox_intend.priority, lane.priority),
        coalesce(outbox_intend.fairness_key, lane.fairness_key),
        CASE WHEN policy IS NOT NULL THEN 'awaiting_approval'
             WHEN lane.paused THEN 'paused' ELSE 'pending' END,
        now() + outbox_intend.delay_seconds * interval '1 second',
        policy, now() + (policy->>'timeout')::double precision * interval '1 second')
    ON CONFLICT ON CONSTRAINT outbox_effects_idempotency_key DO NOTHING
    RETURNING e.id INTO effect_id;
    created := effect_id IS NOT NULL;
    idempotency_key := p_key;

    IF NOT created THEN
        -- The key is taken (by this transaction, or by one that committed while
        -- our insert waited for it): the same intent again is answered with the
        -- existing effect; anything else is a conflict (G5).
        SELECT e.id, e.kind, e.payload, e.payload_hash, e.run_id
          INTO existing FROM outbox_effects AS e WHERE e.idempotency_key = p_key;
        IF NOT FOUND THEN
            PERFORM outbox_raise_conflict(p_key, 'intended concurrently by another transaction');
        END IF;
        IF outbox_intend.run_id IS NOT NULL AND EXISTS (
               SELECT 1 FROM outbox_steps AS s
                WHERE s.run_id = outbox_intend.run_id AND s.step_id = outbox_intend.step_id) THEN
            -- another transaction recorded this step while our insert waited for its key
            PERFORM outbox_raise_step_recorded(outbox_intend.run_id, outbox_intend.step_id);
        END IF;
        IF existing.run_id IS DISTINCT FROM outbox_intend.run_id THEN
            PERFORM outbox_raise_conflict(p_key, 'already intended by '
                || coalesce('run ' || existing.run_id::text, 'no run'));
        END IF;
        IF existing.kind <> p_kind THEN
            PERFORM outbox_raise_conflict(p_key,
                format('already intended as kind %L, not %L', existing.kind, p_kind));
        END IF;
        -- equal payloads hash equally; a float Python writes with an exponent is
        -- compared as a jsonb value (see outbox_canonical_json)
        IF NOT (existing.payload_hash = p_hash
                OR outbox_resolve(existing.payload) = outbox_intend.payload) THEN
            PERFORM outbox_raise_conflict(p_key, 'already intended with a different payload');
        END IF;
        effect_id := existing.id;
    END IF;

    entry := entry || jsonb_build_object('count', (entry->>'count')::integer + 1);
    IF created THEN
        entry := entry || jsonb_build_object('bytes', (entry->>'bytes')::bigint + size);
    END IF;
    IF outbox_intend.run_id IS NULL THEN
        PERFORM set_config('outbox.tx_intents', entry::text, true);
    ELSE
        entry := entry || jsonb_build_object('next', idx + 1);
        IF created AND outbox_intend.cost IS NOT NULL THEN
            -- reserved when the step commits; the effect's outcome settles it
            entry := entry || jsonb_build_object(
                'reserve', (entry->>'reserve')::numeric + outbox_intend.cost,
                'ledger', (entry->'ledger') || jsonb_build_array(jsonb_build_object(
                    'entry', 'reserve', 'reason', p_kind,
                    'amount', outbox_intend.cost, 'effect_id', effect_id)));
        END IF;
        PERFORM outbox_tx_save_step(outbox_intend.run_id, outbox_intend.step_id, entry);
    END IF;
    IF created AND policy IS NULL THEN
        -- a held intent wakes nobody: no deliverer may claim it until it is approved
        PERFORM outbox_wake('outbox_effects');
    END IF;
END
$$;
