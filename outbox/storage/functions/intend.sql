-- Record that effect kind with payload must happen, once, when this transaction
-- commits. With run_id and step_id the intent belongs to that step (call
-- outbox_commit_step for it before committing); without, it belongs to no run.
-- The arguments and rules are outbox_prepare_intents'; priority and
-- fairness_key default to the run's (0 and '' without a run).
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
    namespace text DEFAULT NULL,
    OUT effect_id uuid,
    OUT idempotency_key text,
    OUT created boolean
)
    LANGUAGE sql AS $$
SELECT i.effect_id, i.idempotency_key, i.created
  FROM outbox_intend_all(outbox_intend.run_id, outbox_intend.step_id,
      jsonb_build_array(jsonb_strip_nulls(jsonb_build_object(
          'kind', outbox_intend.kind,
          'key', outbox_intend.key, 'ordering_key', outbox_intend.ordering_key,
          'step_index', outbox_intend.step_index, 'max_attempts', outbox_intend.max_attempts,
          'delay_seconds', outbox_intend.delay_seconds,
          'schema_version', outbox_intend.schema_version,
          'compensate', outbox_intend.compensate, 'cost', outbox_intend.cost,
          'approval', outbox_intend.approval,
          'priority', outbox_intend.priority, 'fairness_key', outbox_intend.fairness_key))
        -- a JSON null payload stays (a SQL NULL one is refused as missing)
        || CASE WHEN outbox_intend.payload IS NULL THEN '{}'::jsonb
                ELSE jsonb_build_object('payload', outbox_intend.payload) END),
      NULL, false, outbox_intend.namespace) AS i
$$;

-- Intents (a JSON array of outbox_intend's arguments) of step_id of run_id, or of
-- no run (both NULL), written now: what outbox_intend does for one, in one call.
-- The step's count, bytes, next index, reservations and chain parts are kept for
-- outbox_commit_step; run-less intents count per transaction. wake as in
-- outbox_commit_step; indexed names refused fields intents[n].x rather than x.
-- namespace: of intents of no run (a run's intents are in its namespace).
CREATE OR REPLACE FUNCTION outbox_intend_all(
    run_id uuid, step_id text, intents jsonb, wake boolean DEFAULT NULL,
    indexed boolean DEFAULT true, namespace text DEFAULT NULL
)
    RETURNS TABLE (effect_id uuid, idempotency_key text, created boolean)
    LANGUAGE plpgsql AS $$
DECLARE
    p_run_id uuid := outbox_intend_all.run_id;
    p_step_id text := outbox_intend_all.step_id;
    entry jsonb;
    run record;
    rows outbox_intent[];
    screened boolean;
    firsts integer[];
    existing uuid[];
    checked jsonb;
    claimable boolean := false;
    gates jsonb;
BEGIN
    IF (p_run_id IS NULL) <> (p_step_id IS NULL) THEN
        PERFORM outbox_refuse('OB001', CASE WHEN p_run_id IS NULL THEN 'run_id' ELSE 'step_id' END,
            NULL, 'run_id and step_id go together: an intent belongs to a step of a run, or to no run');
    END IF;
    IF p_run_id IS NOT NULL THEN
        entry := outbox_tx_step(p_run_id, p_step_id);
        SELECT r.priority, r.fairness_key, r.dry_run, r.paused_at IS NOT NULL AS held, r.namespace
          INTO run FROM outbox_runs AS r
         WHERE r.id = p_run_id AND r.shard = outbox_shard_of(p_run_id);
    ELSE
        -- intents of no run count per transaction, like the Python client's
        entry := coalesce(nullif(current_setting('outbox.tx_intents', true), ''),
                          '{"count": 0, "bytes": 0}')::jsonb;
        PERFORM outbox_check_namespace(coalesce(outbox_intend_all.namespace, 'default'));
        SELECT 0 AS priority, '' AS fairness_key, false AS dry_run, false AS held,
               coalesce(outbox_intend_all.namespace, 'default') AS namespace INTO run;
    END IF;
    IF intents IS NULL OR jsonb_typeof(intents) <> 'array' THEN
        PERFORM outbox_refuse('OB001', 'intents', left(intents::text, 80),
            'must be a JSON array of intents');
    END IF;
    IF intents @? '$[*].ordering_key' THEN
        PERFORM outbox_lock_ordering_keys(intents);
    END IF;
    SELECT coalesce(bool_and(x.screened), true)
           AND count(*) + (entry->>'count')::integer <= outbox_limit('max_step_intents')
           AND coalesce(sum(x.payload_size), 0) + (entry->>'bytes')::bigint
               <= outbox_limit('max_step_bytes'),
           coalesce(array_agg(x ORDER BY x.n), '{}')
      INTO screened, rows
      FROM outbox_intent_rows_planned(p_run_id, p_step_id, intents,
                                      coalesce((entry->>'next')::integer, 0), run.priority,
                                      run.fairness_key, run.dry_run, NULL,
                                      coalesce(run.namespace, 'default'), NULL) AS x;
    IF NOT screened THEN
        -- checked exactly (and callers' keys locked), then derived again: the
        -- effects a locked key names are seen now
        SELECT * INTO firsts, checked, existing FROM outbox_check_intents(p_run_id, p_step_id, intents,
            coalesce((entry->>'next')::integer, 0), (entry->>'count')::integer,
            (entry->>'bytes')::bigint, coalesce(run.dry_run, false), indexed,
            coalesce(run.namespace, 'default'));
        SELECT coalesce(array_agg(x ORDER BY x.n), '{}') INTO rows
          FROM outbox_intent_rows_planned(p_run_id, p_step_id, checked,
                                          coalesce((entry->>'next')::integer, 0), run.priority,
                                          run.fairness_key, run.dry_run, firsts,
                                          coalesce(run.namespace, 'default'), existing) AS x;
    END IF;
    -- once (as an argument of outbox_intent_effects it would run once per use)
    gates := outbox_gates_of(ARRAY(SELECT DISTINCT r.kind FROM unnest(rows) AS r));
    PERFORM outbox_write_effects(rows, p_run_id, p_step_id, run.held,
                                 coalesce(run.namespace, 'default'), gates, now());
    -- as outbox_commit_step's: an intent a gate holds makes this true too (a NOTIFY
    -- for nothing, never one missed)
    claimable := NOT run.held AND EXISTS (SELECT 1 FROM unnest(rows) AS r
                                           WHERE r.existing IS NULL AND r.first_n IS NULL);
    entry := entry || jsonb_build_object(
        'count', (entry->>'count')::integer + cardinality(rows),
        'bytes', (entry->>'bytes')::bigint
                 + coalesce((SELECT sum(r.payload_size) FROM unnest(rows) AS r
                              WHERE r.existing IS NULL AND r.first_n IS NULL), 0));
    IF p_run_id IS NULL THEN
        PERFORM set_config('outbox.tx_intents', entry::text, true);
    ELSE
        PERFORM outbox_tx_save_step(p_run_id, p_step_id, entry || (
            SELECT jsonb_build_object(
                'next', coalesce(max(r.step_index) FILTER (WHERE r.n = cardinality(rows)) + 1,
                                 (entry->>'next')::integer),
                'reserve', (entry->>'reserve')::numeric
                           + coalesce(sum(r.cost) FILTER (WHERE r.existing IS NULL AND r.first_n IS NULL), 0),
                'ledger', (entry->'ledger') || coalesce(jsonb_agg(jsonb_build_object(
                               'entry', 'reserve', 'reason', r.kind, 'amount', r.cost,
                               'effect_id', r.id))
                           FILTER (WHERE r.existing IS NULL AND r.first_n IS NULL
                                   AND r.cost IS NOT NULL), '[]'),
                'chain', (entry->'chain') || coalesce(jsonb_agg(jsonb_build_array(
                               r.step_index, r.id, outbox_intent_link(r.id, r.idempotency_key, r.kind, r.payload_hash)))
                           FILTER (WHERE r.existing IS NULL AND r.first_n IS NULL), '[]'),
                'claimable', (entry->>'claimable')::boolean OR claimable,
                'ids', (entry->'ids') || to_jsonb(outbox_intent_ids(rows)))
              FROM unnest(rows) AS r));
    END IF;
    IF claimable AND wake IS DISTINCT FROM false THEN
        IF wake THEN
            PERFORM pg_notify('outbox_effects', '');
        ELSE
            PERFORM outbox_wake('outbox_effects');
        END IF;
    END IF;
    RETURN QUERY
        SELECT (outbox_intent_ids(rows))[r.n], r.idempotency_key,
               r.existing IS NULL AND r.first_n IS NULL
          FROM unnest(rows) AS r ORDER BY r.n;
END
$$;
