-- Intents, derived, checked and written: the one implementation behind
-- outbox_commit_step (a step's intents, in one call), outbox_intend and
-- outbox_intend_all (of a step or of no run) and a stopping run's compensations.
--
-- The hot path is set-based: outbox_intent_rows derives every row from the
-- caller's JSON in the statement that writes the step, and marks whether cheap
-- checks cleared it (screened). Only an intent they do not clear (a caller's key,
-- headers or url in its payload, a compensation, an approval policy, a large or
-- unusual value, a refusal) goes through outbox_check_intents, which checks it
-- exactly, raising the refusal, and takes the locks a caller's key needs; the
-- statement then runs again. The screen is stricter than the checks, never
-- looser: tests/integration/test_sql_api_rules.py holds it to that.
--
-- Each intent's payload is stored as jsonb, and its payload_hash is the sha256 of
-- PostgreSQL's own text of that jsonb (payload::text), so every writer and the
-- audit verifier hash the same bytes. A caller's key (or step_index) that names
-- an effect already names that effect (G5): the same kind, payload and owner
-- return it; anything else is a conflict (OB003).

-- The rows of p_intents (a JSON array of outbox_intend's arguments: kind, payload,
-- key, ordering_key, step_index, max_attempts, delay_seconds, schema_version,
-- compensate, cost, approval, priority, fairness_key, plus id and trace_parent,
-- which a client may choose) for step p_step_id of run p_run_id (NULL: of no run),
-- the first at index p_next, in the lane, mode and namespace of its run. A value
-- that does not pass a check derives NULL, never an error: screened is then false.
-- An effect of no run gets an id on the shard of its key, else of its ordering
-- key, so that one key's effects live together; an effect of a run, one on its
-- run's shard, where it lives: its id alone then names its shard.
-- p_first[n] and p_existing[n], from outbox_check_intents: the first intent of the
-- call under the n-th's key, when that is another one, and the effect its key
-- names already. It reads no table (so Citus lets a write function call it).
-- STABLE, so that it is inlined into the statement that writes them (it calls
-- outbox_uuid7 for an intent that names no id).
CREATE OR REPLACE FUNCTION outbox_intent_rows(
    p_run_id uuid, p_step_id text, p_intents jsonb, p_next integer,
    p_priority integer, p_fairness_key text, p_dry_run boolean, p_first integer[] DEFAULT NULL,
    p_namespace text DEFAULT 'default', p_existing uuid[] DEFAULT NULL
) RETURNS SETOF outbox_intent
    LANGUAGE sql STABLE AS $$
SELECT a.n::integer, v.id, v.step_index, v.kind,
       CASE WHEN v.size > outbox_limit('blob_threshold_bytes')
            THEN jsonb_build_object('__outbox_blob__',
                                    jsonb_build_object('bytes', v.size, 'sha256', v.hash))
            ELSE a.item->'payload' END,
       f.text, v.size, v.hash, v.key, v.caller_key,
       outbox_json_str(a.item->'ordering_key'),
       outbox_json_int(a.item->'max_attempts'),
       CASE WHEN outbox_json_is_number(a.item->'delay_seconds', 0,
                                       (outbox_intent_rules()->>'max_delay_seconds')::numeric)
            THEN now() + coalesce(outbox_json_num(a.item->'delay_seconds'), 0) * interval '1 second'
       END,
       coalesce(outbox_json_int(a.item->'schema_version'), 1),
       CASE WHEN p_dry_run AND jsonb_typeof(a.item->'compensate') = 'object'
            THEN jsonb_set(a.item->'compensate', '{kind}', to_jsonb(
                (outbox_reserved_kind_prefixes())[1] || (a.item->'compensate'->>'kind')))
            ELSE nullif(a.item->'compensate', 'null') END,
       outbox_json_num(a.item->'cost'),
       -- a dry run asks for no approval: nothing it intends can reach the world
       CASE WHEN NOT p_dry_run AND a.item->'approval' IS NOT NULL
                 AND a.item->'approval' NOT IN ('null', 'false')
            THEN outbox_approval_policy(a.item->'approval') END,
       coalesce(outbox_json_int(a.item->'priority'), p_priority),
       coalesce(outbox_json_str(a.item->'fairness_key'), p_fairness_key),
       nullif(outbox_json_str(a.item->'trace_parent'), ''),
       s.screened,
       p_existing[a.n],
       p_first[a.n]
  FROM jsonb_array_elements(p_intents) WITH ORDINALITY AS a(item, n)
 CROSS JOIN LATERAL (
    -- OFFSET 0 keeps these three a row of their own, read once: pulled up into the
    -- expressions below, the step index's reader made outbox_derive_key's argument
    -- too costly for the planner to substitute twice, and the key was derived by
    -- a call of its own for every intent
    SELECT (a.item->'payload')::text AS text,
           outbox_json_int(a.item->'step_index') AS step_index,
           outbox_json_str(a.item->'key') AS key OFFSET 0) AS f
 CROSS JOIN LATERAL (
    SELECT coalesce(outbox_json_uuid(a.item->'id'),
                    CASE WHEN p_run_id IS NULL
                         THEN outbox_on_shard(outbox_uuid7(), outbox_key_shard(p_namespace,
                             coalesce(f.key, outbox_json_str(a.item->'ordering_key'),
                                      gen_random_uuid()::text)))
                         ELSE outbox_on_shard(outbox_uuid7(), outbox_shard_of(p_run_id)) END) AS id,
           CASE WHEN p_run_id IS NOT NULL THEN coalesce(f.step_index, p_next + a.n::integer - 1) END
               AS step_index,
           CASE WHEN p_dry_run THEN (outbox_reserved_kind_prefixes())[1] ELSE '' END
               || outbox_json_str(a.item->'kind') AS kind,
           octet_length(f.text) AS size,
           encode(sha256(convert_to(f.text, 'UTF8')), 'hex') AS hash,
           CASE WHEN f.key IS NOT NULL AND p_dry_run
                    -- a dry run never takes a key a real intent will need
                    THEN (outbox_reserved_kind_prefixes())[1] || p_run_id::text || ':' || f.key
                WHEN f.key IS NOT NULL THEN f.key
                -- the effect's id, so a client that sent the id knows the key
                WHEN p_run_id IS NULL
                    THEN replace(coalesce(outbox_json_uuid(a.item->'id'), gen_random_uuid())::text,
                                 '-', '')
                ELSE outbox_derive_key(p_run_id, p_step_id,
                                       coalesce(f.step_index, p_next + a.n::integer - 1))
           END AS key,
           -- an index named explicitly names one intent, like a caller's key
           f.key IS NOT NULL OR a.item->'step_index' IS NOT NULL AS caller_key) AS v
 CROSS JOIN LATERAL (
    -- NULL (a value a check cannot read) clears nothing: the screen fails closed
    SELECT coalesce(jsonb_typeof(a.item) = 'object'
       AND (a.item - ARRAY['kind', 'payload', 'ordering_key', 'max_attempts', 'delay_seconds',
                           'schema_version', 'cost', 'priority', 'fairness_key', 'id',
                           'trace_parent']) = '{}'
       AND outbox_json_str(a.item->'kind') ~ (outbox_intent_rules()->>'kind_pattern')
       AND char_length(a.item->>'kind') <= (outbox_intent_rules()->>'max_kind_length')::integer
       AND NOT starts_with(a.item->>'kind', (outbox_reserved_kind_prefixes())[1])
       AND a.item ? 'payload'
       AND octet_length(f.text) <= outbox_limit('max_payload_bytes')
       AND octet_length(f.text) <= outbox_limit('blob_threshold_bytes')
       AND length(f.text) - length(translate(f.text, '[{', ''))
           <= (outbox_intent_rules()->>'max_json_depth')::integer
       AND f.text !~ '[0-9.]{17}'
       AND NOT (jsonb_typeof(a.item->'payload') = 'object'
                AND (a.item->'payload' ?| ARRAY['__outbox_blob__', 'headers', 'url']))
       AND outbox_json_is_text(a.item->'ordering_key',
                               (outbox_intent_rules()->>'max_key_length')::integer)
       AND outbox_json_is_int(a.item->'max_attempts', 1,
                              (outbox_intent_rules()->>'max_attempts')::numeric)
       AND outbox_json_is_number(a.item->'delay_seconds', 0,
                                 (outbox_intent_rules()->>'max_delay_seconds')::numeric)
       AND outbox_json_is_int(a.item->'schema_version', 1,
                              (outbox_intent_rules()->>'max_schema_version')::numeric)
       AND outbox_json_is_number(a.item->'cost', 0, (outbox_intent_rules()->>'max_amount')::numeric)
       AND outbox_json_is_int(a.item->'priority', -(outbox_intent_rules()->>'max_priority')::numeric,
                              (outbox_intent_rules()->>'max_priority')::numeric)
       AND outbox_json_is_text(a.item->'fairness_key',
                               (outbox_intent_rules()->>'max_fairness_key_length')::integer, true)
       AND (a.item->'id' IS NULL OR outbox_json_uuid(a.item->'id') IS NOT NULL)
       AND (a.item->'trace_parent' IS NULL
            OR outbox_json_str(a.item->'trace_parent') ~ '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$')
       AND (p_run_id IS NOT NULL OR a.item->'step_index' IS NULL), false)
       AS screened) AS s
$$;

-- outbox_intent_rows as outbox_intend_all calls it, with its plan kept for the
-- session: PostgreSQL judged a custom plan of the inlined derivation (hundreds
-- of nodes) cheaper and planned it afresh on every call, 1.3 ms of the call's
-- 1.75 ms of server CPU. It reads no distributed table: Citus takes the plan.
CREATE OR REPLACE FUNCTION outbox_intent_rows_planned(
    p_run_id uuid, p_step_id text, p_intents jsonb, p_next integer,
    p_priority integer, p_fairness_key text, p_dry_run boolean, p_first integer[],
    p_namespace text, p_existing uuid[]
) RETURNS SETOF outbox_intent
    LANGUAGE plpgsql STABLE SET plan_cache_mode = force_generic_plan AS $$
BEGIN
    RETURN QUERY SELECT * FROM outbox_intent_rows(p_run_id, p_step_id, p_intents, p_next,
        p_priority, p_fairness_key, p_dry_run, p_first, p_namespace, p_existing);
END
$$;

-- Check p_intents exactly, as outbox_intent_rows derives them for the same step
-- (p_count and p_bytes: what the step or transaction wrote before, which the caps
-- count), raising the first refusal; take every caller's key (outbox_take_key:
-- racers on a key take turns until commit) and compare it with the effect it
-- names, if any. On Citus, where this runs on the run's shard alone, the keys
-- were taken before by outbox_take_keys and are only checked to be.
-- p_indexed names fields intents[n].x rather than x. Returns, for each
-- intent named again under the key of an earlier one of the call (the same
-- intent), that earlier one's ordinal (outbox_intent_rows' p_first), and the
-- intents with an id each: a large payload is stored here, by reference, owned
-- by its run or (of no run) by its effect.
--
-- Its statements, and those of the functions it calls, keep one generic plan a
-- session: PostgreSQL planned them afresh on every call (custom plans of the
-- inlined derivation looked cheaper), 1.8 ms of a step with one keyed intent.
CREATE OR REPLACE FUNCTION outbox_check_intents(
    p_run_id uuid, p_step_id text, p_intents jsonb, p_next integer, p_count integer,
    p_bytes bigint, p_dry_run boolean, p_indexed boolean, p_namespace text,
    OUT firsts integer[], OUT intents jsonb, OUT existing uuid[]
)
    LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    rules jsonb := outbox_intent_rules();
    max_bytes bigint := outbox_limit('max_payload_bytes');
    max_step_bytes bigint := outbox_limit('max_step_bytes');
    max_intents bigint := outbox_limit('max_step_intents');
    max_key integer := (rules->>'max_key_length')::integer;
    max_attempts integer := (rules->>'max_attempts')::integer;
    top integer := (rules->>'max_priority')::integer;
    known_fields text[] := ARRAY['kind', 'payload', 'key', 'ordering_key', 'step_index',
        'max_attempts', 'delay_seconds', 'schema_version', 'compensate', 'cost', 'approval',
        'priority', 'fairness_key', 'id', 'trace_parent'];
    item jsonb;
    n integer := 0;
    field text;
    payload jsonb;
    comp jsonb;
    size bigint;
    bytes bigint := 0;
    num numeric;
    r outbox_intent;
    seen jsonb := '{}';
BEGIN
    firsts := '{}';
    existing := '{}';
    IF p_intents IS NULL OR jsonb_typeof(p_intents) <> 'array' THEN
        PERFORM outbox_refuse('OB001', 'intents', left(p_intents::text, 80),
            'must be a JSON array of intents');
    END IF;
    FOR item IN SELECT value FROM jsonb_array_elements(p_intents) LOOP
        field := CASE WHEN p_indexed THEN format('intents[%s].', n) ELSE '' END;
        IF jsonb_typeof(item) <> 'object' THEN
            PERFORM outbox_refuse('OB001', rtrim(field, '.'), left(item::text, 80), 'must be an object');
        END IF;
        IF (item - known_fields) <> '{}'::jsonb THEN
            PERFORM outbox_refuse('OB001',
                field || (SELECT min(k) FROM jsonb_object_keys(item - known_fields) AS k),
                NULL, 'is not an argument of outbox_intend');
        END IF;
        IF p_count + n >= max_intents THEN
            PERFORM outbox_refuse('OB001', 'intents', (p_count + n + 1)::text,
                format('a step or transaction may intend at most %s effects (outbox.max_step_intents)',
                       max_intents));
        END IF;
        PERFORM outbox_check_kind(field || 'kind', outbox_json_field_text(item, 'kind', field));
        payload := item->'payload';
        IF payload IS NULL THEN
            PERFORM outbox_refuse('OB001', field || 'payload', NULL,
                'is required (pass ''null''::jsonb for a JSON null)');
        END IF;
        PERFORM outbox_check_not_reference(field || 'payload', payload);
        PERFORM outbox_check_payload(payload, field || 'payload');
        size := octet_length(outbox_check_json(field || 'payload', payload, max_bytes));
        IF outbox_json_field_text(item, 'key', field) IS NOT NULL THEN
            PERFORM outbox_check_text(field || 'key', item->>'key', max_key);
        END IF;
        IF outbox_json_field_text(item, 'ordering_key', field) IS NOT NULL THEN
            PERFORM outbox_check_text(field || 'ordering_key', item->>'ordering_key', max_key);
        END IF;
        num := outbox_json_field_int(item, 'max_attempts', field);
        IF num NOT BETWEEN 1 AND max_attempts THEN
            PERFORM outbox_refuse('OB001', field || 'max_attempts', num::text,
                'must be between 1 and ' || max_attempts);
        END IF;
        num := outbox_json_field_number(item, 'delay_seconds', field);
        IF num NOT BETWEEN 0 AND (rules->>'max_delay_seconds')::numeric THEN
            PERFORM outbox_refuse('OB001', field || 'delay_seconds', num::text,
                'must be between 0 and ' || (rules->>'max_delay_seconds'));
        END IF;
        IF outbox_json_field_int(item, 'schema_version', field) < 1 THEN
            PERFORM outbox_refuse('OB001', field || 'schema_version', item->>'schema_version',
                'must be at least 1');
        END IF;
        num := outbox_json_field_number(item, 'cost', field);
        IF num IS NOT NULL THEN
            PERFORM outbox_check_amount(field || 'cost', num);
        END IF;
        num := outbox_json_field_int(item, 'priority', field);
        IF num NOT BETWEEN -top AND top THEN
            PERFORM outbox_refuse('OB001', field || 'priority', num::text,
                format('must be between %s and %s', -top, top));
        END IF;
        IF coalesce(outbox_json_field_text(item, 'fairness_key', field), '') <> '' THEN
            PERFORM outbox_check_text(field || 'fairness_key', item->>'fairness_key',
                                      (rules->>'max_fairness_key_length')::integer);
        END IF;
        IF item->'id' IS NOT NULL AND outbox_json_uuid(item->'id') IS NULL THEN
            PERFORM outbox_refuse('OB001', field || 'id', item->>'id', 'must be a UUID');
        END IF;
        IF coalesce(outbox_json_field_text(item, 'trace_parent', field), '')
           !~ '^([0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2})?$' THEN
            PERFORM outbox_refuse('OB001', field || 'trace_parent', item->>'trace_parent',
                'must be a W3C traceparent (00-<trace id>-<span id>-<flags>)');
        END IF;
        comp := nullif(item->'compensate', 'null');
        IF comp IS NOT NULL THEN
            IF jsonb_typeof(comp) <> 'object' OR NOT comp ? 'kind' OR NOT comp ? 'payload'
               OR (comp - ARRAY['kind', 'payload']) <> '{}'::jsonb
               OR jsonb_typeof(comp->'kind') <> 'string' THEN
                PERFORM outbox_refuse('OB001', field || 'compensate', left(comp::text, 80),
                    'must be {"kind": "...", "payload": ...}');
            END IF;
            PERFORM outbox_check_kind(field || 'compensate', comp->>'kind');
            PERFORM outbox_check_payload(comp->'payload', field || 'compensate.payload');
            -- what a compensation sends is judged by the gates as written: never a
            -- reference to a value stored elsewhere
            PERFORM outbox_check_not_reference(field || 'compensate.payload', comp->'payload');
            size := size + octet_length(outbox_check_json(field || 'compensate', comp, max_bytes));
        END IF;
        IF item->'approval' IS NOT NULL THEN
            PERFORM outbox_approval_policy(item->'approval');
        END IF;
        IF p_run_id IS NULL AND item->'step_index' IS NOT NULL AND item->'step_index' <> 'null' THEN
            PERFORM outbox_refuse('OB001', field || 'step_index', item->>'step_index',
                'belongs to a step: pass run_id and step_id too');
        END IF;
        IF outbox_json_field_int(item, 'step_index', field) < 0 THEN
            PERFORM outbox_refuse('OB001', field || 'step_index', item->>'step_index',
                'must not be negative');
        END IF;
        IF p_bytes + bytes + size > max_step_bytes THEN
            PERFORM outbox_refuse('OB002', 'intents', format('<%s bytes>', p_bytes + bytes + size),
                format('the payloads of one step or transaction may total at most %s bytes '
                       '(outbox.max_step_bytes)', max_step_bytes));
        END IF;
        bytes := bytes + size;
        n := n + 1;
    END LOOP;

    -- Every field passes. Each intent gets its id now (a large payload's reference
    -- names its owner), then the keys: two intents of this call under one key, or
    -- a key that names an effect already, are the same intent or a conflict (G5).
    -- (the ids outbox_intent_rows picks: an effect of no run on its key's shard)
    SELECT jsonb_agg(CASE WHEN a.item ? 'id' AND a.item->'id' <> 'null' THEN a.item
                          ELSE a.item || jsonb_build_object('id', x.id) END ORDER BY a.n)
      INTO intents
      FROM jsonb_array_elements(p_intents) WITH ORDINALITY AS a(item, n)
      JOIN outbox_intent_rows(p_run_id, p_step_id, p_intents, p_next, 0, '', p_dry_run, NULL,
                              p_namespace) AS x ON x.n = a.n;
    intents := coalesce(intents, '[]');
    FOR r IN SELECT * FROM outbox_intent_rows(p_run_id, p_step_id, intents, p_next, 0, '',
                                              p_dry_run, NULL, p_namespace) ORDER BY n LOOP
        -- the loop's query planned, what follows reads and writes shards
        PERFORM outbox_citus_plans_per_call();
        IF seen ? r.idempotency_key THEN
            IF (seen->r.idempotency_key) - 0 <> jsonb_build_array(r.kind, r.payload_hash) THEN
                PERFORM outbox_raise_conflict(r.idempotency_key,
                    'intended twice in this step with a different kind or payload');
            END IF;
            firsts[r.n] := (seen->r.idempotency_key->>0)::integer;
            CONTINUE;
        END IF;
        seen := seen || jsonb_build_object(r.idempotency_key,
                                           jsonb_build_array(r.n, r.kind, r.payload_hash));
        IF (intents->(r.n - 1))->'key' NOT IN ('null') AND outbox_distributed() THEN
            existing[r.n] := outbox_check_key_taken(p_namespace, r.idempotency_key, r.id,
                                                    outbox_shard_of(coalesce(p_run_id, r.id)));
        ELSIF (intents->(r.n - 1))->'key' NOT IN ('null') THEN
            existing[r.n] := outbox_take_key(p_namespace, r.idempotency_key, r.id, p_run_id,
                                             r.kind, r.payload_hash,
                                             (intents->(r.n - 1))->'payload');
        ELSIF r.caller_key THEN
            -- an index named explicitly: its derived key, on this run's shard
            existing[r.n] := outbox_check_existing(p_namespace, r.idempotency_key, p_run_id,
                r.kind, r.payload_hash, (intents->(r.n - 1))->'payload');
        END IF;
        IF r.payload_size > outbox_limit('blob_threshold_bytes') THEN
            PERFORM outbox_store_value(coalesce(p_run_id, r.id), (intents->(r.n - 1))->'payload',
                                       r.payload_text);
        END IF;
    END LOOP;
END
$$;

-- A key (derived, at an index a caller named) that names an effect of run p_run_id
-- already names that effect: the same kind and payload (returned), or a conflict
-- (OB003).
CREATE OR REPLACE FUNCTION outbox_check_existing(
    p_ns text, p_key text, p_run_id uuid, p_kind text, p_hash text, p_payload jsonb
) RETURNS uuid
    LANGUAGE plpgsql AS $$
DECLARE
    existing record;
BEGIN
    SELECT x.id, x.kind, x.payload_hash, x.run_id, x.payload, x.shard INTO existing
      FROM outbox_effects AS x
     WHERE x.namespace = p_ns AND x.idempotency_key = p_key AND x.shard = outbox_shard_of(p_run_id);
    IF FOUND THEN
        PERFORM outbox_same_intent(p_key, existing.id, existing.run_id, existing.kind,
                                   existing.payload_hash, p_run_id, p_kind, p_hash, p_payload);
    END IF;
    RETURN existing.id;
END
$$;

-- Whether an intent (p_run_id, p_kind, p_hash, p_payload) under key p_key is the
-- one that effect (p_effect ...) is: the same owner, kind and payload, else OB003.
CREATE OR REPLACE FUNCTION outbox_same_intent(
    p_key text, p_effect uuid, p_effect_run uuid, p_effect_kind text, p_effect_hash text,
    p_run_id uuid, p_kind text, p_hash text, p_payload jsonb
) RETURNS void
    LANGUAGE plpgsql AS $$
BEGIN
    IF p_effect_run IS DISTINCT FROM p_run_id THEN
        PERFORM outbox_raise_conflict(p_key, 'already intended by another owner');
    END IF;
    IF p_effect_kind <> p_kind THEN
        PERFORM outbox_raise_conflict(p_key,
            format('already intended as kind %L, not %L', p_effect_kind, p_kind));
    END IF;
    -- a hash of another definition (an effect written before 0023): the values decide
    IF p_effect_hash <> p_hash AND (SELECT outbox_resolve(x.payload, x.shard) FROM outbox_effects AS x
            WHERE x.id = p_effect AND x.shard = outbox_shard_of(coalesce(p_effect_run, p_effect)))
           IS DISTINCT FROM p_payload THEN
        PERFORM outbox_raise_conflict(p_key, 'already intended with a different payload');
    END IF;
END
$$;

-- Take a caller's key p_key in namespace p_ns for effect p_effect (of run p_run_id,
-- or of none): register it on the key's shard, where a racer on the same key
-- waits for this transaction; and, where that is not the owner's shard, mirror it
-- there (what a step write on Citus checks: outbox_check_key_taken). A key taken
-- already is the effect it names (returned), or a conflict (outbox_same_intent).
CREATE OR REPLACE FUNCTION outbox_take_key(
    p_ns text, p_key text, p_effect uuid, p_run_id uuid, p_kind text, p_hash text,
    p_payload jsonb
) RETURNS uuid
    LANGUAGE plpgsql AS $$
DECLARE
    k_shard smallint := outbox_key_shard(p_ns, p_key);
    o_shard smallint := outbox_shard_of(coalesce(p_run_id, p_effect));
    h_effect uuid;
    h_run uuid;
    h_kind text;
    h_hash text;
BEGIN
    INSERT INTO outbox_effect_keys AS k (namespace, key, shard, effect_id, run_id, kind,
                                         payload_hash)
    VALUES (p_ns, p_key, k_shard, p_effect, p_run_id, p_kind, p_hash)
    ON CONFLICT ON CONSTRAINT outbox_effect_keys_pkey DO NOTHING;
    SELECT k.effect_id, k.run_id, k.kind, k.payload_hash INTO h_effect, h_run, h_kind, h_hash
      FROM outbox_effect_keys AS k
     WHERE k.namespace = p_ns AND k.key = p_key AND k.shard = k_shard;
    IF h_effect = p_effect THEN
        -- new here; but a key derived for an effect (of its run, so on its shard) may
        -- be named again as a caller's: that effect holds it
        SELECT e.id, e.run_id, e.kind, e.payload_hash INTO h_effect, h_run, h_kind, h_hash
          FROM outbox_effects AS e
         WHERE e.namespace = p_ns AND e.idempotency_key = p_key AND e.shard = o_shard;
        IF FOUND THEN
            UPDATE outbox_effect_keys AS k
               SET effect_id = h_effect, run_id = h_run, kind = h_kind, payload_hash = h_hash
             WHERE k.namespace = p_ns AND k.key = p_key AND k.shard = k_shard;
        ELSE
            h_effect := p_effect;
            h_run := p_run_id;
            h_kind := p_kind;
            h_hash := p_hash;
        END IF;
    END IF;
    IF h_effect <> p_effect THEN
        PERFORM outbox_same_intent(p_key, h_effect, h_run, h_kind, h_hash, p_run_id, p_kind,
                                   p_hash, p_payload);
    END IF;
    IF k_shard <> o_shard THEN
        INSERT INTO outbox_effect_keys AS k (namespace, key, shard, effect_id, run_id, kind,
                                             payload_hash, mirror)
        VALUES (p_ns, p_key, o_shard, h_effect, h_run, h_kind, h_hash, true)
        ON CONFLICT ON CONSTRAINT outbox_effect_keys_pkey DO NOTHING;
    END IF;
    RETURN nullif(h_effect, p_effect);
END
$$;

-- On Citus: a caller's key of intent p_effect, written on shard p_shard, must have
-- been taken in this transaction (or before) with outbox_take_keys; the write on
-- one shard cannot reach the key's own. Returns the effect it names already, if
-- another.
CREATE OR REPLACE FUNCTION outbox_check_key_taken(
    p_ns text, p_key text, p_effect uuid, p_shard smallint
) RETURNS uuid
    LANGUAGE plpgsql AS $$
DECLARE
    holder uuid;
BEGIN
    SELECT k.effect_id INTO holder FROM outbox_effect_keys AS k
     WHERE k.namespace = p_ns AND k.key = p_key AND k.shard = p_shard;
    IF NOT FOUND THEN
        PERFORM outbox_raise_conflict(p_key,
            'on a distributed database a caller''s key is taken first, in the same '
            'transaction: SELECT outbox_take_keys(run_id, intents)');
    END IF;
    RETURN nullif(holder, p_effect);
END
$$;

-- The effects to write of rows (outbox_intent_rows; those naming an existing
-- effect are skipped), as step p_step_id of run p_run_id writes them, with their
-- status: a configured gate holds a matching intent as awaiting_approval (its
-- approval names the gate, and the reason when a condition met a value it could
-- not judge: outbox_gate_match) and wins over the intent's own policy (an intent
-- can add a gate, never loosen one; a dry run's kinds match no gate); otherwise a paused run's intents are held as
-- paused, and the rest are pending. The columns are outbox_effects', in the
-- order both writers insert them.
--
-- The policy is used three times (status, approval, deadline): OFFSET 0 keeps the
-- planner from pulling its sub-select up into each use, which matched every gate
-- three times an intent (a step with one intent of a gated kind: 1,403 -> 970 us
-- of server CPU) and put three sub-plans in every step statement's plan.
CREATE OR REPLACE FUNCTION outbox_intent_effects(
    p_rows outbox_intent[], p_run_id uuid, p_step_id text, p_paused boolean, p_namespace text,
    p_gates jsonb, p_now timestamptz
) RETURNS TABLE (
    id uuid, run_id uuid, step_id text, step_index integer, kind text, payload jsonb,
    payload_hash text, schema_version integer, idempotency_key text, ordering_key text,
    max_attempts integer, compensate jsonb, cost numeric, priority integer, fairness_key text,
    status text, available_at timestamptz, approval jsonb, approval_deadline timestamptz,
    trace_parent text, shard smallint, namespace text
)
    LANGUAGE sql STABLE AS $$
SELECT r.id, p_run_id, p_step_id, r.step_index, r.kind, r.payload, r.payload_hash,
       r.schema_version, r.idempotency_key, r.ordering_key, r.max_attempts, r.compensate, r.cost,
       r.priority, r.fairness_key,
       CASE WHEN h.policy IS NOT NULL THEN 'awaiting_approval'
            WHEN p_paused THEN 'paused' ELSE 'pending' END,
       r.available_at, h.policy,
       p_now + (h.policy->>'timeout')::double precision * interval '1 second', r.trace_parent,
       outbox_shard_of(coalesce(p_run_id, r.id)), p_namespace
  FROM unnest(p_rows) AS r
 CROSS JOIN LATERAL (
    SELECT coalesce((
        SELECT jsonb_build_object('gate', g.name, 'timeout', g.timeout_seconds,
                                  'on_timeout', g.on_timeout, 'escalate_to', g.escalate_to)
               || g.verdict
          FROM (SELECT g.*, outbox_gate_match(g.conditions, CASE WHEN r.payload_size
                    > outbox_limit('blob_threshold_bytes') THEN r.payload_text::jsonb
                    ELSE r.payload END) AS verdict
                  FROM jsonb_to_recordset(p_gates) AS g(name text, kind text, conditions jsonb,
                       timeout_seconds double precision, on_timeout text, escalate_to text)
                 WHERE g.kind = r.kind) AS g
         WHERE g.verdict IS NOT NULL
         ORDER BY g.name LIMIT 1), r.approval) AS policy OFFSET 0) AS h
 WHERE r.existing IS NULL AND r.first_n IS NULL
$$;

-- The gates configured for kinds (outbox_gates; on Citus a reference table, read
-- where the write runs), as outbox_intent_effects takes them: none, nearly always.
-- On a Citus worker, through its view of its own placement of the table
-- (outbox_gates_placement, outbox/storage/citus.py): the rows Citus would read
-- there, without Citus planning the statement on every call (150 us of a
-- worker's 1,900 a step). Not on the coordinator, which has no such view: a
-- transaction there may have written the placements through other connections.
CREATE OR REPLACE FUNCTION outbox_gates_of(kinds text[]) RETURNS jsonb
    LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF outbox_distributed() AND to_regclass('outbox_gates_placement') IS NOT NULL
       AND has_table_privilege('outbox_gates_placement', 'SELECT') THEN
        RETURN (SELECT coalesce(jsonb_agg(outbox_gate_json(g.name, g.kind, g.conditions,
                                  g.timeout_seconds, g.on_timeout, g.escalate_to)
                                  ORDER BY g.name), '[]')
                  FROM outbox_gates_placement AS g WHERE g.kind = ANY (kinds));
    END IF;
    RETURN (SELECT coalesce(jsonb_agg(outbox_gate_json(g.name, g.kind, g.conditions,
                              g.timeout_seconds, g.on_timeout, g.escalate_to) ORDER BY g.name),
                            '[]')
              FROM outbox_gates AS g WHERE g.kind = ANY (kinds));
END
$$;

-- One gate (the columns of an outbox_gates row) as outbox_intent_effects reads it.
-- (Columns, not the row: on a Citus worker the row is of the shard's own type.)
CREATE OR REPLACE FUNCTION outbox_gate_json(
    name text, kind text, conditions jsonb, timeout_seconds double precision, on_timeout text,
    escalate_to text
) RETURNS jsonb
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT jsonb_build_object('name', name, 'kind', kind, 'conditions', conditions,
                          'timeout_seconds', timeout_seconds, 'on_timeout', on_timeout,
                          'escalate_to', escalate_to)
$$;

-- What the step chain covers of a step's intents (outbox_step_link): each new
-- effect's id, key, kind and payload hash, in step_index order.
CREATE OR REPLACE FUNCTION outbox_intent_link(id uuid, key text, kind text, payload_hash text)
    RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT outbox_lp(id::text) || outbox_lp(key) || outbox_lp(kind) || outbox_lp(payload_hash)
$$;

-- The effect ids of rows (outbox_intent_rows), in order: each the effect written,
-- or the one its key named already.
CREATE OR REPLACE FUNCTION outbox_intent_ids(p_rows outbox_intent[]) RETURNS uuid[]
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT coalesce(array_agg(coalesce(r.existing, f.id, r.id) ORDER BY r.n), '{}')
  FROM unnest(p_rows) AS r LEFT JOIN unnest(p_rows) AS f ON f.n = r.first_n
$$;

-- The intents' part of a step's link: the parts ([step_index, id, link text] of
-- every effect the step created, in whatever order they were written) joined in
-- step_index order.
CREATE OR REPLACE FUNCTION outbox_intents_chain(parts jsonb) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT coalesce(string_agg(p->>2, '' ORDER BY (p->>0)::integer, p->>1), '')
  FROM jsonb_array_elements(parts) AS p
$$;

-- Intend the compensations of a stopping run's succeeded effects (originals),
-- each as its original declared it, keyed from the original's key; one at a time,
-- newest original first (their ordering key). A configured gate holds one as it
-- would the same intent written by a step (outbox_gate_hold). An original
-- compensated already is skipped. Returns how many were new.
CREATE OR REPLACE FUNCTION outbox_intend_compensations(p_run_id uuid, p_originals uuid[])
    RETURNS integer
    LANGUAGE plpgsql AS $$
DECLARE
    inserted integer;
    v_now timestamptz := now();  -- a value: Citus pushes no now() down to a shard
    gates jsonb := outbox_gates_of(ARRAY(
        SELECT DISTINCT x.compensate->>'kind' FROM outbox_effects AS x
         WHERE x.id = ANY (p_originals) AND x.run_id = p_run_id
           AND x.shard = outbox_shard_of(p_run_id) AND x.compensate IS NOT NULL));
BEGIN
    -- one INSERT ... SELECT, no CTE: Citus would run a CTE as sub-plans of their own
    INSERT INTO outbox_effects AS e (
        id, run_id, step_id, step_index, kind, payload, payload_hash, schema_version,
        idempotency_key, ordering_key, compensates, priority, fairness_key, status, shard,
        namespace, approval, approval_deadline)
    SELECT outbox_on_shard(outbox_uuid7(), x.shard), p_run_id, 'compensate', k.n - 1,
           x.compensate->>'kind',
           x.compensate->'payload',
           encode(sha256(convert_to((x.compensate->'payload')::text, 'UTF8')), 'hex'), 1,
           outbox_compensation_key(x.idempotency_key),
           -- one at a time, newest original first
           'compensate:' || p_run_id::text, x.id, x.priority, x.fairness_key,
           CASE WHEN h.hold IS NULL THEN 'pending' ELSE 'awaiting_approval' END,
           x.shard, x.namespace, h.hold,
           v_now + (h.hold->>'timeout')::double precision * interval '1 second'
      FROM unnest(p_originals) WITH ORDINALITY AS k(id, n)
      JOIN outbox_effects AS x ON x.id = k.id AND x.run_id = p_run_id
                              AND x.shard = outbox_shard_of(p_run_id)
     CROSS JOIN LATERAL (SELECT outbox_gate_hold_in(gates, x.compensate->>'kind',
                                                    x.compensate->'payload') AS hold) AS h
     WHERE x.compensate IS NOT NULL
     ORDER BY k.n
    ON CONFLICT ON CONSTRAINT outbox_effects_idempotency_key DO NOTHING;
    GET DIAGNOSTICS inserted = ROW_COUNT;
    IF inserted > 0 THEN
        PERFORM pg_notify('outbox_effects', '');
    END IF;
    RETURN inserted;
END
$$;

-- Lock each ordering key p_intents name until the transaction ends, in key order.
-- An effect's seq, the order its key's effects are delivered in, is drawn when
-- its row is inserted, not when its transaction commits: two transactions writing
-- one key at once could commit in the other order, and a deliverer then claim the
-- later seq first, the earlier one not visible yet. With the key locked from
-- before the insert until commit, a second writer of the key waits for the first
-- to commit and draws a seq after its. Taken by every writer of intents
-- (outbox_write_step, outbox_intend_all); only intents with a key pay for it.
-- The two-key form's first key (0x6F6B) keeps these apart from other advisory
-- locks. The locks are taken in the order of what is locked, the keys' hashes
-- (two keys may share one): in the keys' own order, writers of k1 < k2 and of
-- k2 < k3 with hashtext(k1) = hashtext(k3) took two locks in opposite orders.
-- On Citus a lock is the node's: it orders the writers of a key on its shard's
-- node, as far as a claim orders their effects (docs/howto/citus.md).
CREATE OR REPLACE FUNCTION outbox_lock_ordering_keys(p_intents jsonb) RETURNS void
    LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(28523, k.hash)
       FROM (SELECT DISTINCT hashtext(i->>'ordering_key') AS hash
               FROM jsonb_array_elements(p_intents) AS i
              WHERE jsonb_typeof(i->'ordering_key') = 'string'
              ORDER BY 1) AS k;
END
$$;

-- JSON field readers that never raise: the value when it has the type, else NULL.
CREATE OR REPLACE FUNCTION outbox_json_str(value jsonb) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT CASE WHEN jsonb_typeof(value) = 'string' THEN value #>> '{}' END
$$;

CREATE OR REPLACE FUNCTION outbox_json_num(value jsonb) RETURNS numeric
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT CASE WHEN jsonb_typeof(value) = 'number' THEN value::numeric END
$$;

CREATE OR REPLACE FUNCTION outbox_json_int(value jsonb) RETURNS integer
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT CASE WHEN jsonb_typeof(value) = 'number' AND value::numeric = trunc(value::numeric)
             AND value::numeric BETWEEN -2147483648 AND 2147483647
            THEN value::numeric::integer END
$$;

CREATE OR REPLACE FUNCTION outbox_json_uuid(value jsonb) RETURNS uuid
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT CASE WHEN jsonb_typeof(value) = 'string'
             AND value #>> '{}' ~* '^[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}$'
            THEN (value #>> '{}')::uuid END
$$;

-- Screens of outbox_intent_rows (absent and JSON null pass: the field is optional).
CREATE OR REPLACE FUNCTION outbox_json_is_text(value jsonb, max_length integer,
                                               may_be_empty boolean DEFAULT false) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT CASE WHEN value IS NULL OR value = 'null' THEN true
            WHEN jsonb_typeof(value) <> 'string' THEN false
            ELSE char_length(value #>> '{}') BETWEEN CASE WHEN may_be_empty THEN 0 ELSE 1 END
                                                 AND max_length
                 AND (value #>> '{}') !~ (outbox_intent_rules()->>'control_characters') END
$$;

CREATE OR REPLACE FUNCTION outbox_json_is_number(value jsonb, low numeric, high numeric)
    RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT CASE WHEN value IS NULL OR value = 'null' THEN true
            WHEN jsonb_typeof(value) <> 'number' THEN false
            ELSE value::numeric BETWEEN low AND high END
$$;

CREATE OR REPLACE FUNCTION outbox_json_is_int(value jsonb, low numeric, high numeric)
    RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT CASE WHEN value IS NULL OR value = 'null' THEN true
            WHEN jsonb_typeof(value) <> 'number' THEN false
            ELSE value::numeric BETWEEN low AND high AND value::numeric = trunc(value::numeric) END
$$;

-- Field readers of outbox_check_intents: the value (NULL when absent or JSON
-- null), or OB001 naming the field when it has the wrong type.
CREATE OR REPLACE FUNCTION outbox_json_field_text(item jsonb, name text, field text) RETURNS text
    LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF item->name IS NULL OR item->name = 'null' THEN
        RETURN NULL;
    END IF;
    IF jsonb_typeof(item->name) <> 'string' THEN
        PERFORM outbox_refuse('OB001', field || name, (item->name)::text, 'must be text');
    END IF;
    RETURN item->>name;
END
$$;

CREATE OR REPLACE FUNCTION outbox_json_field_number(item jsonb, name text, field text)
    RETURNS numeric
    LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF item->name IS NULL OR item->name = 'null' THEN
        RETURN NULL;
    END IF;
    IF jsonb_typeof(item->name) <> 'number' THEN
        PERFORM outbox_refuse('OB001', field || name, (item->name)::text, 'must be a number');
    END IF;
    RETURN (item->name)::numeric;
END
$$;

CREATE OR REPLACE FUNCTION outbox_json_field_int(item jsonb, name text, field text)
    RETURNS numeric
    LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    value numeric := outbox_json_field_number(item, name, field);
BEGIN
    IF value <> trunc(value) THEN
        PERFORM outbox_refuse('OB001', field || name, value::text, 'must be a whole number');
    END IF;
    RETURN value;
END
$$;

-- Take the callers' keys of intents (outbox_commit_step's or outbox_intend_all's
-- intents argument) for run_id (NULL: intents of no run, in namespace) before
-- writing them: each registered on its key's shard (outbox_take_key), which a
-- step write on Citus, running on the run's shard alone, cannot reach. Returns
-- the intents, each with the id it is to be written under: pass them on. On one
-- server the write takes the keys itself, and calling this first changes nothing.
-- (The derivation goes through outbox_intent_rows_planned: planned inline, it was
-- planned afresh on every call, 1.8 ms. The function's other statements keep
-- PostgreSQL's choice: Citus plans no generic plan of their shard lookups.)
CREATE OR REPLACE FUNCTION outbox_take_keys(run_id uuid, intents jsonb, namespace text DEFAULT NULL)
    RETURNS jsonb
    LANGUAGE plpgsql AS $$
DECLARE
    run record;
    named jsonb;
    r outbox_intent;
BEGIN
    IF intents IS NULL OR jsonb_typeof(intents) <> 'array' THEN
        PERFORM outbox_refuse('OB001', 'intents', left(intents::text, 80),
            'must be a JSON array of intents');
    END IF;
    IF outbox_take_keys.run_id IS NOT NULL THEN
        SELECT x.namespace, x.dry_run INTO run FROM outbox_runs AS x
         WHERE x.id = outbox_take_keys.run_id AND x.shard = outbox_shard_of(outbox_take_keys.run_id);
        IF NOT FOUND THEN
            PERFORM outbox_raise_run_not_found(outbox_take_keys.run_id);
        END IF;
    ELSE
        PERFORM outbox_check_namespace(coalesce(outbox_take_keys.namespace, 'default'));
        SELECT coalesce(outbox_take_keys.namespace, 'default') AS namespace, false AS dry_run
          INTO run;
    END IF;
    -- every intent named by id, so that its key row and its effect agree
    SELECT coalesce(jsonb_agg(CASE WHEN jsonb_typeof(a.item) = 'object'
                                    AND outbox_json_uuid(a.item->'id') IS NULL
                                   THEN a.item || jsonb_build_object('id', x.id)
                                   ELSE a.item END ORDER BY a.n), '[]')
      INTO named
      FROM jsonb_array_elements(intents) WITH ORDINALITY AS a(item, n)
      LEFT JOIN outbox_intent_rows_planned(outbox_take_keys.run_id, NULL, intents, 0, 0, '',
                                           run.dry_run, NULL, run.namespace, NULL) AS x
             ON x.n = a.n;
    FOR r IN SELECT * FROM outbox_intent_rows_planned(outbox_take_keys.run_id, NULL, named, 0, 0,
                                                      '', run.dry_run, NULL, run.namespace,
                                                      NULL) LOOP
        IF (named->(r.n - 1))->'key' NOT IN ('null') AND r.kind IS NOT NULL THEN
            PERFORM outbox_take_key(run.namespace, r.idempotency_key, r.id,
                                    outbox_take_keys.run_id, r.kind, r.payload_hash,
                                    (named->(r.n - 1))->'payload');
        END IF;
    END LOOP;
    RETURN named;
END
$$;
