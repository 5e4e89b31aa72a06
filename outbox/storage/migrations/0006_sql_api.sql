-- agent-outbox 0006: the SQL API. Functions any language calls inside its own
-- transaction to start a run, write intents, record a step and send a signal,
-- with the Python client's rules (docs/sql-api.md lists every function, argument
-- and SQLSTATE). Must stay equal to outbox/storage/schema.py
-- (tests/integration/test_migrations.py checks it).

-- The time (microseconds since the epoch) of the last NOTIFY the SQL API sent
-- on each channel. Sequences, because setval is not transactional: a writer
-- never waits for another writer's transaction to learn that a wake-up is
-- under way, and no row is locked or updated per commit.
CREATE SEQUENCE outbox_wake_clock_effects START WITH 0 MINVALUE 0;
CREATE SEQUENCE outbox_wake_clock_runs START WITH 0 MINVALUE 0;

-- @functions: outbox/storage/schema.py runs everything below this line after
-- creating the tables, so a fresh schema gets exactly these definitions.

-- Every limit and list the functions enforce, in one place. A test compares it
-- with the Python client's constants (tests/integration/test_sql_api_rules.py).
CREATE FUNCTION outbox_intent_rules() RETURNS jsonb
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT '{
  "kind_pattern": "^[A-Za-z0-9_.:-]+$",
  "kind_max_length": 200,
  "key_max_length": 500,
  "ordering_key_max_length": 500,
  "agent_max_length": 200,
  "version_max_length": 100,
  "step_id_max_length": 200,
  "signal_name_max_length": 200,
  "dedup_key_max_length": 500,
  "reason_max_length": 200,
  "max_attempts_min": 1,
  "max_attempts_max": 1000,
  "schema_version_min": 1,
  "delay_seconds_max": 315360000,
  "amount_max": 1000000000000000,
  "max_payload_bytes": 1048576,
  "max_json_depth": 100,
  "max_integer_digits": 4300,
  "step_max_intents": 1000,
  "step_max_bytes": 16777216,
  "notify_window_ms": 3,
  "live_run_statuses": ["runnable", "running", "waiting"],
  "control_characters": "[\\x01-\\x1f\\x7f-\\x9f]",
  "framing_headers": ["connection", "content-length", "expect", "host", "idempotency-key",
                      "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
                      "upgrade"],
  "secret_headers": ["api-key", "authorization", "cookie", "proxy-authorization",
                     "x-api-key", "x-auth-token"],
  "secret_header_pattern": "(^|[-_])(token|secret|password|passwd|apikey|api-key|api_key|session)([-_]|$)",
  "url_secret_params": ["access_token", "api_key", "apikey", "client_secret", "id_token",
                        "password", "refresh_token", "secret", "token"]
}'::jsonb
$$;

-- Hex sha256 over length-prefixed parts (8-byte big-endian length, then the
-- UTF-8 bytes): the same bytes outbox.keys hashes.
CREATE FUNCTION outbox_key_digest(VARIADIC parts text[]) RETURNS text
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
SELECT encode(sha256(string_agg(int8send(octet_length(b)::bigint) || b, ''::bytea ORDER BY n)), 'hex')
  FROM unnest(parts) WITH ORDINALITY AS p(part, n), convert_to(p.part, 'UTF8') AS b
$$;

-- The default idempotency key of the step_index-th intent of step_id in run_id
-- (outbox.keys.derive_key).
CREATE FUNCTION outbox_derive_key(run_id uuid, step_id text, step_index integer) RETURNS text
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
SELECT outbox_key_digest(run_id::text, step_id, step_index::text)
$$;

-- The key of the effect that compensates the effect with key original_key.
CREATE FUNCTION outbox_compensation_key(original_key text) RETURNS text
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
SELECT outbox_key_digest('compensate', original_key)
$$;

-- A time-ordered UUID (version 7), like outbox.ids.uuid7 (PostgreSQL 18 has
-- uuidv7(); this also runs on 13 to 17).
CREATE FUNCTION outbox_uuid7() RETURNS uuid
    LANGUAGE sql VOLATILE PARALLEL SAFE AS $$
SELECT encode(
    set_bit(set_bit(
        overlay(uuid_send(gen_random_uuid())
                PLACING substring(int8send(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint)
                                  FROM 3)
                FROM 1 FOR 6),
        52, 1), 53, 1),
    'hex')::uuid
$$;

-- The text outbox.payloads.encode produces for the same JSON value: keys sorted
-- by code point, no insignificant whitespace, strings escaped the same way.
-- Numbers are written as PostgreSQL stores them, so a float Python would write
-- with an exponent (1e+16) differs; payloads are therefore compared as jsonb
-- values when their hashes differ.
CREATE FUNCTION outbox_canonical_json(value jsonb) RETURNS text
    LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
BEGIN
    CASE jsonb_typeof(value)
    WHEN 'object' THEN
        RETURN '{' || coalesce(
            (SELECT string_agg(to_json(e.k)::text || ':' || outbox_canonical_json(e.v), ','
                               ORDER BY e.k COLLATE "C")
               FROM jsonb_each(value) AS e(k, v)), '') || '}';
    WHEN 'array' THEN
        RETURN '[' || coalesce(
            (SELECT string_agg(outbox_canonical_json(a.v), ',' ORDER BY a.n)
               FROM jsonb_array_elements(value) WITH ORDINALITY AS a(v, n)), '') || ']';
    ELSE
        RETURN value::text;
    END CASE;
END
$$;

-- Raise error code with message; detail is a JSON object of the error's fields
-- (clients build their typed errors from it: docs/sql-api.md, "Errors").
CREATE FUNCTION outbox_raise(code text, message text, detail jsonb) RETURNS void
    LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION USING ERRCODE = code, MESSAGE = message, DETAIL = detail::text;
END
$$;

-- Refuse an argument (OB001) or a JSON value (OB002), naming the field and the
-- value as outbox.errors.ValidationError does.
CREATE FUNCTION outbox_refuse(code text, field text, value text, reason text) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    shown text := CASE WHEN value IS NULL THEN 'NULL'
                       WHEN char_length(value) > 77 THEN quote_literal(left(value, 74)) || '...'
                       ELSE quote_literal(value) END;
BEGIN
    RAISE EXCEPTION USING ERRCODE = code, MESSAGE = field || '=' || shown || ': ' || reason,
        COLUMN = field,
        DETAIL = jsonb_build_object('field', field, 'value', left(value, 200), 'reason', reason)::text;
END
$$;

CREATE FUNCTION outbox_raise_conflict(key text, reason text) RETURNS void
    LANGUAGE sql AS $$
SELECT outbox_raise('OB003', format('idempotency_key=%L: %s', key, reason),
                    jsonb_build_object('key', key, 'reason', reason))
$$;

CREATE FUNCTION outbox_raise_run_not_found(run_id uuid) RETURNS void
    LANGUAGE sql AS $$
SELECT outbox_raise('OB004', format('run_id=%L: no such run', run_id),
                    jsonb_build_object('run_id', run_id))
$$;

CREATE FUNCTION outbox_raise_run_ended(run_id uuid, status text) RETURNS void
    LANGUAGE sql AS $$
SELECT outbox_raise('OB005',
                    format('run_id=%L is %s: a terminal run accepts no more work', run_id, status),
                    jsonb_build_object('run_id', run_id, 'status', status))
$$;

CREATE FUNCTION outbox_raise_step_recorded(run_id uuid, step_id text) RETURNS void
    LANGUAGE sql AS $$
SELECT outbox_raise('OB006',
                    format('step_id=%L of run %s is already recorded: roll back and read its result '
                           'with outbox_step()', step_id, run_id),
                    jsonb_build_object('run_id', run_id, 'step_id', step_id))
$$;

-- A name, id or key: present (unless optional), within its length, no control
-- characters (they forge log lines and break headers), not blank if so asked.
CREATE FUNCTION outbox_check_text(
    field text, value text, max_length integer, required boolean DEFAULT true,
    not_blank boolean DEFAULT false
) RETURNS void
    LANGUAGE plpgsql AS $$
BEGIN
    IF value IS NULL THEN
        IF required THEN
            PERFORM outbox_refuse('OB001', field, value, 'is required');
        END IF;
        RETURN;
    END IF;
    IF value = '' OR (not_blank AND btrim(value) = '') THEN
        PERFORM outbox_refuse('OB001', field, value, 'must not be empty');
    END IF;
    IF char_length(value) > max_length THEN
        PERFORM outbox_refuse('OB001', field, value,
            format('is %s characters, over %s', char_length(value), max_length));
    END IF;
    IF value ~ (outbox_intent_rules()->>'control_characters') THEN
        PERFORM outbox_refuse('OB001', field, value, 'contains a control character');
    END IF;
END
$$;

-- An effect kind (or a compensation's kind).
CREATE FUNCTION outbox_check_kind(field text, value text) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    rules jsonb := outbox_intent_rules();
BEGIN
    PERFORM outbox_check_text(field, value, (rules->>'kind_max_length')::integer);
    IF value !~ (rules->>'kind_pattern') THEN
        PERFORM outbox_refuse('OB001', field, value,
            'must match ' || (rules->>'kind_pattern'));
    END IF;
END
$$;

-- An amount (budget, cost, spend): finite, not negative, within amount_max.
CREATE FUNCTION outbox_check_amount(field text, value numeric, positive boolean DEFAULT false)
    RETURNS void
    LANGUAGE plpgsql AS $$
BEGIN
    IF value IS NULL THEN
        RETURN;
    END IF;
    IF value::text IN ('NaN', 'Infinity', '-Infinity') THEN
        PERFORM outbox_refuse('OB001', field, value::text, 'must be a finite number');
    END IF;
    IF value < 0 OR (positive AND value = 0) THEN
        PERFORM outbox_refuse('OB001', field, value::text,
            CASE WHEN positive THEN 'must be positive' ELSE 'must not be negative' END);
    END IF;
    IF value > (outbox_intent_rules()->>'amount_max')::numeric THEN
        PERFORM outbox_refuse('OB001', field, value::text,
            'is over ' || (outbox_intent_rules()->>'amount_max'));
    END IF;
END
$$;

-- The largest payload accepted: outbox.max_payload_bytes if the session or
-- database sets it, else the rule.
CREATE FUNCTION outbox_max_payload_bytes() RETURNS integer
    LANGUAGE sql STABLE PARALLEL SAFE AS $$
SELECT coalesce(nullif(current_setting('outbox.max_payload_bytes', true), '')::integer,
                (outbox_intent_rules()->>'max_payload_bytes')::integer)
$$;

-- A JSON value to store (payload, inputs, state, result): readable by every
-- client (nesting depth, integer digits, no float overflow), within max_bytes.
-- Returns its canonical text. NUL characters and NaN cannot reach here: jsonb
-- refuses them when the argument is cast.
CREATE FUNCTION outbox_check_json(field text, value jsonb, max_bytes integer) RETURNS text
    LANGUAGE plpgsql AS $$
DECLARE
    rules jsonb := outbox_intent_rules();
    depth integer := (rules->>'max_json_depth')::integer;
    digits integer := (rules->>'max_integer_digits')::integer;
    canonical text;
    size integer;
BEGIN
    IF jsonb_path_exists(value,
            ('strict $.**{' || depth || '} ? (@.type() == "object" || @.type() == "array")')::jsonpath)
    THEN
        PERFORM outbox_refuse('OB002', field, left(value::text, 80),
            format('is nested more than %s levels deep', depth));
    END IF;
    IF jsonb_path_exists(value,
            'strict $.** ? (@.type() == "number" && (@ >= $big || @ <= -$big))',
            jsonb_build_object('big', ('1e' || digits)::numeric))
    THEN
        PERFORM outbox_refuse('OB002', field, left(value::text, 80),
            format('holds a number of more than %s digits', digits));
    END IF;
    IF jsonb_path_exists(value,
            'strict $.** ? (@.type() == "number" && @.floor() != @ && (@ >= 1e308 || @ <= -1e308))')
    THEN
        PERFORM outbox_refuse('OB002', field, left(value::text, 80),
            'holds a fractional number beyond the range of a double (it would read as infinity)');
    END IF;
    canonical := outbox_canonical_json(value);
    size := octet_length(canonical);
    IF size > max_bytes THEN
        PERFORM outbox_refuse('OB002', field, format('<%s bytes>', size),
            format('is %s bytes, over the limit of %s bytes', size, max_bytes));
    END IF;
    RETURN canonical;
END
$$;

-- An HTTP-shaped payload (a top-level "url" string or "headers" object, whatever
-- the kind: a deliverer config may map any kind to http.request): no header
-- that frames the request or carries a secret, no control characters in header
-- names or values, no credentials in the URL (userinfo or token parameters).
-- Secrets travel by reference: the deliverer config names them.
CREATE FUNCTION outbox_check_http_shape(field text, payload jsonb) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    rules jsonb := outbox_intent_rules();
    cc text := rules->>'control_characters';
    h record;
    url text;
    query text;
    param text;
BEGIN
    IF jsonb_typeof(payload) <> 'object' THEN
        RETURN;
    END IF;
    IF jsonb_typeof(payload->'headers') = 'object' THEN
        FOR h IN SELECT e.k AS name, lower(e.k) AS lname, e.v AS value
                   FROM jsonb_each(payload->'headers') AS e(k, v) LOOP
            IF h.name ~ cc OR (jsonb_typeof(h.value) = 'string' AND (h.value #>> '{}') ~ cc) THEN
                PERFORM outbox_refuse('OB001', field || '.headers.' || h.name, h.value #>> '{}',
                    'a header name or value contains a control character');
            END IF;
            IF rules->'framing_headers' ? h.lname THEN
                PERFORM outbox_refuse('OB001', field || '.headers', h.name,
                    'frames the request or is hop-by-hop: the deliverer sets it');
            END IF;
            IF rules->'secret_headers' ? h.lname OR h.lname ~ (rules->>'secret_header_pattern') THEN
                PERFORM outbox_refuse('OB001', field || '.headers', h.name,
                    'carries a secret: name a configured credential instead');
            END IF;
        END LOOP;
    END IF;
    IF jsonb_typeof(payload->'url') = 'string' THEN
        url := payload->>'url';
        IF url ~ cc THEN
            PERFORM outbox_refuse('OB001', field || '.url', url, 'contains a control character');
        END IF;
        IF url ~ '^[A-Za-z][A-Za-z0-9+.-]*://[^/?#]*@' THEN
            PERFORM outbox_refuse('OB001', field || '.url', regexp_replace(url, '//[^/?#]*@', '//***@'),
                'carries credentials (userinfo): name a configured credential instead');
        END IF;
        query := substring(url FROM '\?([^#]*)');
        IF query IS NOT NULL THEN
            FOREACH param IN ARRAY string_to_array(query, '&') LOOP
                IF rules->'url_secret_params' ? lower(split_part(param, '=', 1)) THEN
                    PERFORM outbox_refuse('OB001', field || '.url', split_part(param, '=', 1),
                        'is a credential query parameter: name a configured credential instead');
                END IF;
            END LOOP;
        END IF;
    END IF;
END
$$;

-- Statuses in which a run accepts steps, signals and intents (models.LIVE_RUN_STATUSES).
CREATE FUNCTION outbox_live_run_statuses() RETURNS text[]
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT ARRAY(SELECT jsonb_array_elements_text(outbox_intent_rules()->'live_run_statuses'))
$$;

-- Wake listeners on channel, at most once per window across every SQL API
-- writer: a NOTIFY only when the previous one the SQL API sent on the channel
-- is older than the window (outbox.notify_window_ms, else the rule). Returns
-- whether this transaction notifies. See docs/sql-api.md for what covers the
-- commits that skip it.
CREATE FUNCTION outbox_wake(channel text) RETURNS boolean
    LANGUAGE plpgsql AS $$
DECLARE
    window_us double precision := 1000 * coalesce(
        nullif(current_setting('outbox.notify_window_ms', true), '')::double precision,
        (outbox_intent_rules()->>'notify_window_ms')::double precision);
    now_us bigint := floor(extract(epoch FROM clock_timestamp()) * 1000000)::bigint;
    last_us bigint;
    flag text := 'outbox.notified_' || channel;
BEGIN
    -- PostgreSQL folds a transaction's identical notifications into one.
    IF current_setting(flag, true) = 'on' THEN
        RETURN true;
    END IF;
    IF channel = 'outbox_effects' THEN
        SELECT last_value INTO last_us FROM outbox_wake_clock_effects;
    ELSIF channel = 'outbox_runs' THEN
        SELECT last_value INTO last_us FROM outbox_wake_clock_runs;
    ELSE
        RAISE EXCEPTION 'outbox_wake: unknown channel %', channel;
    END IF;
    IF now_us - last_us < window_us THEN
        RETURN false;
    END IF;
    PERFORM setval(('outbox_wake_clock_' || substring(channel FROM 8))::regclass, now_us);
    PERFORM pg_notify(channel, '');
    PERFORM set_config(flag, 'on', true);
    RETURN true;
END
$$;

-- What this transaction wrote through the SQL API for each (run, step) not yet
-- committed: the next intent index, counts, budget debits and reservations.
-- Kept in a transaction-local setting, so a rollback (or a rollback to a
-- savepoint) forgets it together with the rows.
CREATE FUNCTION outbox_tx_steps() RETURNS jsonb
    LANGUAGE sql STABLE AS $$
SELECT coalesce(nullif(current_setting('outbox.tx_steps', true), ''), '{}')::jsonb
$$;

CREATE FUNCTION outbox_tx_step_slot(run_id uuid, step_id text) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT run_id::text || ' ' || step_id
$$;

CREATE FUNCTION outbox_tx_save_step(run_id uuid, step_id text, entry jsonb) RETURNS void
    LANGUAGE sql AS $$
SELECT set_config('outbox.tx_steps',
    jsonb_set(outbox_tx_steps(), ARRAY[outbox_tx_step_slot(run_id, step_id)], entry)::text, true)
$$;

-- The state of (run_id, step_id) in this transaction. The first time a step is
-- met, the run must exist and accept steps, and the step must not be recorded
-- yet; a step already committed in this transaction takes no more writes.
CREATE FUNCTION outbox_tx_step(p_run_id uuid, p_step_id text) RETURNS jsonb
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
    PERFORM outbox_check_text('step_id', p_step_id,
        (outbox_intent_rules()->>'step_id_max_length')::integer, true, true);
    SELECT r.status INTO run_status FROM outbox_runs AS r WHERE r.id = p_run_id;
    IF NOT FOUND THEN
        PERFORM outbox_raise_run_not_found(p_run_id);
    END IF;
    IF NOT run_status = ANY (outbox_live_run_statuses()) THEN
        PERFORM outbox_raise_run_ended(p_run_id, run_status);
    END IF;
    IF EXISTS (SELECT 1 FROM outbox_steps AS s WHERE s.run_id = p_run_id AND s.step_id = p_step_id) THEN
        PERFORM outbox_raise_step_recorded(p_run_id, p_step_id);
    END IF;
    entry := jsonb_build_object('next', 0, 'count', 0, 'bytes', 0, 'debit', 0, 'reserve', 0,
                                'ledger', '[]'::jsonb, 'done', false);
    -- saved now: the commit-time check (outbox_effects_step_committed) only
    -- looks at rows inserted while this setting is present
    PERFORM outbox_tx_save_step(p_run_id, p_step_id, entry);
    RETURN entry;
END
$$;

-- Record that effect kind with payload must happen, once, when this transaction
-- commits. With run_id and step_id the intent belongs to that step (call
-- outbox_commit_step for it before committing); without, it belongs to no run.
CREATE FUNCTION outbox_intend(
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
    OUT effect_id uuid,
    OUT idempotency_key text,
    OUT created boolean
)
    LANGUAGE plpgsql AS $$
DECLARE
    rules jsonb := outbox_intent_rules();
    max_bytes integer := outbox_max_payload_bytes();
    canonical text;
    p_hash text;
    p_key text := outbox_intend.key;
    idx integer;
    entry jsonb;
    new_id uuid := outbox_uuid7();
    existing record;
BEGIN
    PERFORM outbox_check_kind('kind', outbox_intend.kind);
    IF outbox_intend.payload IS NULL THEN
        PERFORM outbox_refuse('OB001', 'payload', NULL,
            'is required (pass ''null''::jsonb for a JSON null)');
    END IF;
    canonical := outbox_check_json('payload', outbox_intend.payload, max_bytes);
    PERFORM outbox_check_http_shape('payload', outbox_intend.payload);
    PERFORM outbox_check_text('key', p_key, (rules->>'key_max_length')::integer, false);
    PERFORM outbox_check_text('ordering_key', outbox_intend.ordering_key,
        (rules->>'ordering_key_max_length')::integer, false);
    IF outbox_intend.max_attempts IS NOT NULL
       AND outbox_intend.max_attempts NOT BETWEEN (rules->>'max_attempts_min')::integer
                                              AND (rules->>'max_attempts_max')::integer THEN
        PERFORM outbox_refuse('OB001', 'max_attempts', outbox_intend.max_attempts::text,
            format('must be between %s and %s', rules->>'max_attempts_min', rules->>'max_attempts_max'));
    END IF;
    IF outbox_intend.delay_seconds IS NULL
       OR NOT outbox_intend.delay_seconds BETWEEN 0 AND (rules->>'delay_seconds_max')::double precision THEN
        PERFORM outbox_refuse('OB001', 'delay_seconds', outbox_intend.delay_seconds::text,
            'must be between 0 and ' || (rules->>'delay_seconds_max'));
    END IF;
    IF outbox_intend.schema_version IS NULL
       OR outbox_intend.schema_version < (rules->>'schema_version_min')::integer THEN
        PERFORM outbox_refuse('OB001', 'schema_version', outbox_intend.schema_version::text,
            'must be at least ' || (rules->>'schema_version_min'));
    END IF;
    IF outbox_intend.compensate IS NOT NULL THEN
        IF jsonb_typeof(outbox_intend.compensate) <> 'object'
           OR NOT outbox_intend.compensate ? 'kind' OR NOT outbox_intend.compensate ? 'payload'
           OR (SELECT count(*) FROM jsonb_object_keys(outbox_intend.compensate)) <> 2
           OR jsonb_typeof(outbox_intend.compensate->'kind') <> 'string' THEN
            PERFORM outbox_refuse('OB001', 'compensate', left(outbox_intend.compensate::text, 80),
                'must be {"kind": "...", "payload": ...}');
        END IF;
        PERFORM outbox_check_kind('compensate.kind', outbox_intend.compensate->>'kind');
        PERFORM outbox_check_json('compensate', outbox_intend.compensate, max_bytes);
        PERFORM outbox_check_http_shape('compensate.payload', outbox_intend.compensate->'payload');
    END IF;
    PERFORM outbox_check_amount('cost', outbox_intend.cost);
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
        IF (entry->>'count')::integer + 1 > (rules->>'step_max_intents')::integer THEN
            PERFORM outbox_refuse('OB002', 'step_id', outbox_intend.step_id,
                format('takes more than %s intents', rules->>'step_max_intents'));
        END IF;
        IF (entry->>'bytes')::bigint + octet_length(canonical) > (rules->>'step_max_bytes')::bigint THEN
            PERFORM outbox_refuse('OB002', 'step_id', outbox_intend.step_id,
                format('intents over %s bytes in one step', rules->>'step_max_bytes'));
        END IF;
        p_key := coalesce(p_key, outbox_derive_key(outbox_intend.run_id, outbox_intend.step_id, idx));
    ELSIF outbox_intend.step_index IS NOT NULL THEN
        PERFORM outbox_refuse('OB001', 'step_index', outbox_intend.step_index::text,
            'belongs to a step: pass run_id and step_id too');
    ELSE
        p_key := coalesce(p_key, replace(gen_random_uuid()::text, '-', ''));
    END IF;

    INSERT INTO outbox_effects AS e (
        id, run_id, step_id, step_index, kind, payload, payload_hash, schema_version,
        idempotency_key, ordering_key, max_attempts, compensate, cost, status, available_at)
    VALUES (
        new_id, outbox_intend.run_id, outbox_intend.step_id, idx, outbox_intend.kind,
        outbox_intend.payload, p_hash, outbox_intend.schema_version, p_key,
        outbox_intend.ordering_key, outbox_intend.max_attempts, outbox_intend.compensate,
        outbox_intend.cost, 'pending',
        now() + outbox_intend.delay_seconds * interval '1 second')
    ON CONFLICT ON CONSTRAINT outbox_effects_idempotency_key DO NOTHING
    RETURNING e.id INTO effect_id;
    created := effect_id IS NOT NULL;
    idempotency_key := p_key;

    IF NOT created THEN
        -- The key is taken (by this transaction, or by one that committed while
        -- our insert waited for it): the same intent again is answered with the
        -- existing effect; anything else is a conflict.
        SELECT e.id, e.kind, e.payload, e.payload_hash, e.run_id, e.step_id, e.step_index
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
        IF existing.kind <> outbox_intend.kind
           OR existing.run_id IS DISTINCT FROM outbox_intend.run_id
           OR NOT (existing.payload_hash = p_hash OR existing.payload = outbox_intend.payload) THEN
            PERFORM outbox_raise_conflict(p_key, 'already intended with a different ' ||
                CASE WHEN existing.kind <> outbox_intend.kind THEN 'kind'
                     WHEN existing.run_id IS DISTINCT FROM outbox_intend.run_id THEN 'run'
                     ELSE 'payload' END);
        END IF;
        effect_id := existing.id;
    END IF;

    IF outbox_intend.run_id IS NOT NULL THEN
        entry := entry || jsonb_build_object('next', idx + 1);
        IF created THEN
            entry := entry || jsonb_build_object(
                'count', (entry->>'count')::integer + 1,
                'bytes', (entry->>'bytes')::bigint + octet_length(canonical));
            IF outbox_intend.cost IS NOT NULL THEN
                -- reserved when the step commits; the effect's outcome settles it
                entry := entry || jsonb_build_object(
                    'reserve', (entry->>'reserve')::numeric + outbox_intend.cost,
                    'ledger', (entry->'ledger') || jsonb_build_array(jsonb_build_object(
                        'entry', 'reserve', 'reason', outbox_intend.kind,
                        'amount', outbox_intend.cost, 'effect_id', effect_id)));
            END IF;
        END IF;
        PERFORM outbox_tx_save_step(outbox_intend.run_id, outbox_intend.step_id, entry);
    END IF;
    IF created THEN
        PERFORM outbox_wake('outbox_effects');
    END IF;
END
$$;

-- Debit the run's budget by amount for reason when step_id commits (keyed by
-- run, step and reason, so a replay cannot spend twice).
CREATE FUNCTION outbox_spend(run_id uuid, step_id text, amount numeric, reason text) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    entry jsonb := outbox_tx_step(outbox_spend.run_id, outbox_spend.step_id);
BEGIN
    IF outbox_spend.amount IS NULL THEN
        PERFORM outbox_refuse('OB001', 'amount', NULL, 'is required');
    END IF;
    PERFORM outbox_check_amount('amount', outbox_spend.amount, true);
    PERFORM outbox_check_text('reason', outbox_spend.reason,
        (outbox_intent_rules()->>'reason_max_length')::integer, true, true);
    IF jsonb_path_exists(entry->'ledger', '$[*] ? (@.entry == "spend" && @.reason == $r)',
                         jsonb_build_object('r', outbox_spend.reason)) THEN
        PERFORM outbox_refuse('OB001', 'reason', outbox_spend.reason, 'already spent for in this step');
    END IF;
    entry := entry || jsonb_build_object(
        'debit', (entry->>'debit')::numeric + outbox_spend.amount,
        'ledger', (entry->'ledger') || jsonb_build_array(jsonb_build_object(
            'entry', 'spend', 'reason', outbox_spend.reason, 'amount', outbox_spend.amount,
            'effect_id', NULL)));
    PERFORM outbox_tx_save_step(outbox_spend.run_id, outbox_spend.step_id, entry);
END
$$;

-- Record step_id of run_id: its result, the run's new state and plan (NULL
-- keeps them), the budget its intents reserve and its debits, and (with
-- intents, a JSON array of outbox_intend arguments) more intents. All of it
-- commits with the caller's transaction, or none of it.
CREATE FUNCTION outbox_commit_step(
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
    max_bytes integer := outbox_max_payload_bytes();
    tx_step jsonb := outbox_tx_step(outbox_commit_step.run_id, outbox_commit_step.step_id);
    item jsonb;
    n integer := 0;
    made record;
    unknown_field text;
    found_run record;
BEGIN
    IF outbox_commit_step.step_kind IS NULL OR outbox_commit_step.step_kind NOT IN ('transaction', 'call') THEN
        PERFORM outbox_refuse('OB001', 'step_kind', outbox_commit_step.step_kind,
            'must be transaction or call');
    END IF;
    IF outbox_commit_step.result IS NOT NULL THEN
        PERFORM outbox_check_json('result', outbox_commit_step.result, max_bytes);
    END IF;
    IF outbox_commit_step.state IS NOT NULL THEN
        PERFORM outbox_check_json('state', outbox_commit_step.state, max_bytes);
    END IF;
    IF outbox_commit_step.plan IS NOT NULL THEN
        PERFORM outbox_check_json('plan', outbox_commit_step.plan, max_bytes);
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
                             'delay_seconds', 'schema_version', 'compensate', 'cost')
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
                cost => (item->>'cost')::numeric);
            effect_ids := effect_ids || made.effect_id;
            n := n + 1;
        END LOOP;
        tx_step := outbox_tx_steps()->outbox_tx_step_slot(outbox_commit_step.run_id, outbox_commit_step.step_id);
    END IF;

    UPDATE outbox_runs AS r
       SET state = coalesce(outbox_commit_step.state, r.state),
           plan = coalesce(outbox_commit_step.plan, r.plan),
           current_step = outbox_commit_step.step_id,
           spent = r.spent + (tx_step->>'debit')::numeric,
           reserved = r.reserved + (tx_step->>'reserve')::numeric
           -- updated_at is left alone: a step's update must stay HOT (see sql/steps.py)
     WHERE r.id = outbox_commit_step.run_id
       AND r.status = ANY (outbox_live_run_statuses())
       AND (r.budget IS NULL
            OR r.spent + r.reserved + (tx_step->>'debit')::numeric + (tx_step->>'reserve')::numeric <= r.budget);
    IF NOT FOUND THEN
        SELECT r.status, r.budget, r.spent, r.reserved INTO found_run
          FROM outbox_runs AS r WHERE r.id = outbox_commit_step.run_id;
        IF NOT FOUND THEN
            PERFORM outbox_raise_run_not_found(outbox_commit_step.run_id);
        ELSIF NOT found_run.status = ANY (outbox_live_run_statuses()) THEN
            PERFORM outbox_raise_run_ended(outbox_commit_step.run_id, found_run.status);
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

    INSERT INTO outbox_steps AS s (run_id, step_id, kind, result)
    VALUES (outbox_commit_step.run_id, outbox_commit_step.step_id, outbox_commit_step.step_kind,
            coalesce(outbox_commit_step.result, 'null'::jsonb))
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
    PERFORM outbox_tx_save_step(outbox_commit_step.run_id, outbox_commit_step.step_id,
                                tx_step || '{"done": true}'::jsonb);
END
$$;

-- At commit: every intent the SQL API wrote for a step was followed by
-- outbox_commit_step for that step (G1: intents never commit without their
-- checkpoint). The WHEN clause keeps it off every other insert.
CREATE FUNCTION outbox_effects_check_step_committed() RETURNS trigger
    LANGUAGE plpgsql AS $$
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
CREATE CONSTRAINT TRIGGER outbox_effects_step_committed
    AFTER INSERT ON outbox_effects DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
    WHEN (NEW.run_id IS NOT NULL AND current_setting('outbox.tx_steps', true) <> '')
    EXECUTE FUNCTION outbox_effects_check_step_committed();

-- Start a run of agent pinned to version, with immutable inputs; returns its
-- id. Starting again with the same run_id, agent, version and inputs returns
-- the same run (a retried start is harmless); anything else is refused (OB001).
CREATE FUNCTION outbox_start_run(
    agent text,
    version text,
    inputs jsonb DEFAULT NULL,
    budget numeric DEFAULT NULL,
    run_id uuid DEFAULT NULL
) RETURNS uuid
    LANGUAGE plpgsql AS $$
DECLARE
    rules jsonb := outbox_intent_rules();
    p_inputs jsonb := coalesce(outbox_start_run.inputs, 'null'::jsonb);
    p_id uuid := coalesce(outbox_start_run.run_id, outbox_uuid7());
    canonical text;
    p_hash text;
    started uuid;
    existing record;
BEGIN
    PERFORM outbox_check_text('agent', outbox_start_run.agent, (rules->>'agent_max_length')::integer);
    PERFORM outbox_check_text('version', outbox_start_run.version, (rules->>'version_max_length')::integer);
    canonical := outbox_check_json('inputs', p_inputs, outbox_max_payload_bytes());
    PERFORM outbox_check_amount('budget', outbox_start_run.budget);
    p_hash := encode(sha256(convert_to(canonical, 'UTF8')), 'hex');
    INSERT INTO outbox_runs AS r (id, agent, agent_version, inputs, inputs_hash, status, budget)
    VALUES (p_id, outbox_start_run.agent, outbox_start_run.version, p_inputs, p_hash, 'runnable',
            outbox_start_run.budget)
    ON CONFLICT (id) DO NOTHING
    RETURNING r.id INTO started;
    IF started IS NULL THEN
        SELECT r.agent, r.agent_version, r.inputs, r.inputs_hash INTO existing
          FROM outbox_runs AS r WHERE r.id = p_id;
        IF NOT FOUND OR existing.agent <> outbox_start_run.agent
           OR existing.agent_version <> outbox_start_run.version
           OR NOT (existing.inputs_hash = p_hash OR existing.inputs = p_inputs) THEN
            PERFORM outbox_refuse('OB001', 'run_id', p_id::text,
                'names a run started with another agent, version or inputs');
        END IF;
        RETURN p_id;
    END IF;
    PERFORM outbox_wake('outbox_runs');
    RETURN p_id;
END
$$;

-- End a live run as completed (with an optional result) or failed (with an error).
CREATE FUNCTION outbox_finish_run(run_id uuid, status text, result jsonb DEFAULT NULL,
                                  error jsonb DEFAULT NULL) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    max_bytes integer := outbox_max_payload_bytes();
    current_status text;
BEGIN
    IF outbox_finish_run.status IS NULL OR outbox_finish_run.status NOT IN ('completed', 'failed') THEN
        PERFORM outbox_refuse('OB001', 'status', outbox_finish_run.status, 'must be completed or failed');
    END IF;
    IF outbox_finish_run.result IS NOT NULL THEN
        PERFORM outbox_check_json('result', outbox_finish_run.result, max_bytes);
    END IF;
    IF outbox_finish_run.error IS NOT NULL THEN
        PERFORM outbox_check_json('error', outbox_finish_run.error, max_bytes);
    END IF;
    UPDATE outbox_runs AS r
       SET status = outbox_finish_run.status, result = outbox_finish_run.result,
           error = outbox_finish_run.error, lease_owner = NULL, lease_expires_at = NULL,
           updated_at = now()
     WHERE r.id = outbox_finish_run.run_id AND r.status = ANY (outbox_live_run_statuses());
    IF NOT FOUND THEN
        SELECT r.status INTO current_status FROM outbox_runs AS r WHERE r.id = outbox_finish_run.run_id;
        IF NOT FOUND THEN
            PERFORM outbox_raise_run_not_found(outbox_finish_run.run_id);
        END IF;
        PERFORM outbox_raise_run_ended(outbox_finish_run.run_id, current_status);
    END IF;
END
$$;

-- Send signal name with a JSON payload to a live run; a run waiting for it
-- becomes runnable. The same dedup_key is accepted once (duplicate => true).
CREATE FUNCTION outbox_signal(
    run_id uuid,
    name text,
    payload jsonb DEFAULT NULL,
    dedup_key text DEFAULT NULL,
    OUT signal_id uuid,
    OUT duplicate boolean,
    OUT woke_run boolean
)
    LANGUAGE plpgsql AS $$
DECLARE
    rules jsonb := outbox_intent_rules();
    run_status text;
    woke uuid;
BEGIN
    PERFORM outbox_check_text('name', outbox_signal.name, (rules->>'signal_name_max_length')::integer,
                              true, true);
    PERFORM outbox_check_text('dedup_key', outbox_signal.dedup_key,
                              (rules->>'dedup_key_max_length')::integer, false);
    PERFORM outbox_check_json('payload', coalesce(outbox_signal.payload, 'null'::jsonb),
                              outbox_max_payload_bytes());
    -- waits, signals and cancellation of a run serialise on its row (run_tx.lock)
    SELECT r.status INTO run_status FROM outbox_runs AS r WHERE r.id = outbox_signal.run_id FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM outbox_raise_run_not_found(outbox_signal.run_id);
    END IF;
    IF NOT run_status = ANY (outbox_live_run_statuses()) THEN
        PERFORM outbox_raise_run_ended(outbox_signal.run_id, run_status);
    END IF;
    INSERT INTO outbox_signals AS s (id, run_id, name, payload, dedup_key)
    VALUES (outbox_uuid7(), outbox_signal.run_id, outbox_signal.name,
            coalesce(outbox_signal.payload, 'null'::jsonb),
            coalesce(outbox_signal.dedup_key, replace(gen_random_uuid()::text, '-', '')))
    ON CONFLICT ON CONSTRAINT outbox_signals_dedup DO NOTHING
    RETURNING s.id INTO signal_id;
    duplicate := signal_id IS NULL;
    woke_run := false;
    IF duplicate THEN
        RETURN;
    END IF;
    UPDATE outbox_runs AS r
       SET status = 'runnable', available_at = now(), wake_at = NULL, wait_signal = NULL,
           updated_at = now()
     WHERE r.id = outbox_signal.run_id AND r.status = 'waiting' AND r.wait_signal = outbox_signal.name
    RETURNING r.id INTO woke;
    woke_run := woke IS NOT NULL;
    IF woke_run THEN
        PERFORM pg_notify('outbox_runs', '');
    END IF;
    -- plain scripts blocked in wait_signal listen here
    PERFORM pg_notify('outbox_signals', outbox_signal.run_id::text);
END
$$;

-- Where an effect is: one row, or none when no effect has this id.
CREATE FUNCTION outbox_effect_status(effect_id uuid)
    RETURNS TABLE (id uuid, kind text, status text, idempotency_key text, attempt integer,
                   result jsonb, last_error text, run_id uuid, step_id text, step_index integer,
                   created_at timestamptz, updated_at timestamptz, completed_at timestamptz)
    LANGUAGE sql STABLE AS $$
SELECT e.id, e.kind, e.status, e.idempotency_key, e.attempt, e.result, e.last_error, e.run_id,
       e.step_id, e.step_index, e.created_at, e.updated_at, e.completed_at
  FROM outbox_effects AS e WHERE e.id = outbox_effect_status.effect_id
$$;

-- The same, found by idempotency key.
CREATE FUNCTION outbox_effect_by_key(key text)
    RETURNS TABLE (id uuid, kind text, status text, idempotency_key text, attempt integer,
                   result jsonb, last_error text, run_id uuid, step_id text, step_index integer,
                   created_at timestamptz, updated_at timestamptz, completed_at timestamptz)
    LANGUAGE sql STABLE AS $$
SELECT e.id, e.kind, e.status, e.idempotency_key, e.attempt, e.result, e.last_error, e.run_id,
       e.step_id, e.step_index, e.created_at, e.updated_at, e.completed_at
  FROM outbox_effects AS e WHERE e.idempotency_key = outbox_effect_by_key.key
$$;

-- A recorded step (what a replay returns): one row, or none when not recorded.
CREATE FUNCTION outbox_step(run_id uuid, step_id text)
    RETURNS TABLE (step_kind text, status text, result jsonb, error jsonb, seq bigint,
                   completed_at timestamptz)
    LANGUAGE sql STABLE AS $$
SELECT s.kind, s.status, s.result, s.error, s.seq, s.completed_at
  FROM outbox_steps AS s
 WHERE s.run_id = outbox_step.run_id AND s.step_id = outbox_step.step_id
$$;

-- A run as stored: one row, or none when no run has this id.
CREATE FUNCTION outbox_run_status(run_id uuid)
    RETURNS TABLE (id uuid, agent text, agent_version text, status text, inputs jsonb, state jsonb,
                   plan jsonb, current_step text, result jsonb, error jsonb, budget numeric,
                   spent numeric, reserved numeric, created_at timestamptz, updated_at timestamptz)
    LANGUAGE sql STABLE AS $$
SELECT r.id, r.agent, r.agent_version, r.status, r.inputs, r.state, r.plan, r.current_step,
       r.result, r.error, r.budget, r.spent, r.reserved, r.created_at, r.updated_at
  FROM outbox_runs AS r WHERE r.id = outbox_run_status.run_id
$$;
