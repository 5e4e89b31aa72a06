-- A name, id or key: present (unless optional), within its length, no control
-- character (rule control-character: they forge log lines and break the
-- headers a key is sent in), not blank if so asked.
CREATE OR REPLACE FUNCTION outbox_check_text(
    field text, value text, max_length integer, required boolean DEFAULT true,
    not_blank boolean DEFAULT false
) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    rules jsonb := outbox_intent_rules();
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
    IF value ~ (rules->>'control_characters') THEN
        PERFORM outbox_refuse('OB001', field, value, rules->'reasons'->>'control-character',
                              'control-character');
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION outbox_check_kind(field text, value text) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    rules jsonb := outbox_intent_rules();
    prefix text;
BEGIN
    PERFORM outbox_check_text(field, value, (rules->>'max_kind_length')::integer);
    IF value !~ (rules->>'kind_pattern') THEN
        PERFORM outbox_refuse('OB001', field, value, 'must match ' || (rules->>'kind_pattern'));
    END IF;
    FOREACH prefix IN ARRAY outbox_reserved_kind_prefixes() LOOP
        IF starts_with(value, prefix) THEN
            PERFORM outbox_refuse('OB001', field, value,
                format('kinds starting with %L are reserved for dry runs', prefix));
        END IF;
    END LOOP;
END
$$;

-- An amount (budget, cost, spend): finite, not negative (positive if so asked),
-- at most max_amount.
CREATE OR REPLACE FUNCTION outbox_check_amount(field text, value numeric, positive boolean DEFAULT false)
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
    IF value > (outbox_intent_rules()->>'max_amount')::numeric THEN
        PERFORM outbox_refuse('OB001', field, value::text,
            'must be at most ' || (outbox_intent_rules()->>'max_amount'));
    END IF;
END
$$;

-- A JSON value to store (payload, inputs, state, result, error, ...), checked so
-- that every client reads what was written: at most max_json_depth levels of
-- nesting, no integer of more than max_integer_digits digits (Python refuses to
-- read one), no fraction that a double does not hold exactly (Python would read
-- and send another number), and at most max_bytes of text. Returns the text
-- stored values are hashed and sized by: PostgreSQL's own rendering of the jsonb.
-- NUL characters and NaN never reach here: jsonb refuses them when the argument
-- is cast.
CREATE OR REPLACE FUNCTION outbox_check_json(field text, value jsonb, max_bytes bigint) RETURNS text
    LANGUAGE plpgsql AS $$
DECLARE
    rules jsonb := outbox_intent_rules();
    depth integer := (rules->>'max_json_depth')::integer;
    rendered text := value::text;
    size bigint := octet_length(rendered);
BEGIN
    IF size > max_bytes THEN
        PERFORM outbox_refuse('OB002', field, format('<%s bytes>', size),
            format('is %s bytes, over the limit of %s bytes', size, max_bytes));
    END IF;
    -- The exact checks walk the whole value; the text tells cheaply when they
    -- cannot fail (fewer brackets than levels; no run of 17 digits and points,
    -- which a number needs to be too long or to miss a double).
    IF length(rendered) - length(translate(rendered, '[{', '')) > depth
       AND jsonb_path_exists(value, ('strict $.**{' || depth
                                     || '} ? (@.type() == "object" || @.type() == "array")')::jsonpath)
    THEN
        PERFORM outbox_refuse('OB002', field, left(rendered, 80),
            format('is nested more than %s levels deep', depth));
    END IF;
    IF rendered ~ '[0-9.]{17}'
       AND outbox_unreadable_number(value, (rules->>'max_integer_digits')::integer) THEN
        PERFORM outbox_refuse('OB002', field, left(rendered, 80),
            format('holds an integer of more than %s digits, or a fraction that a double does '
                   'not hold exactly (every client must read the number that was written)',
                   rules->>'max_integer_digits'));
    END IF;
    RETURN rendered;
END
$$;

-- Whether value holds a number a client would read as another one: an integer of
-- more than digits digits, or a fraction that a double does not hold exactly.
CREATE OR REPLACE FUNCTION outbox_unreadable_number(value jsonb, digits integer) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT EXISTS (
    SELECT 1 FROM jsonb_path_query(value, 'strict $.** ? (@.type() == "number")') AS n(v),
           LATERAL (SELECT n.v::text::numeric AS x) AS c
     WHERE CASE WHEN abs(c.x) >= ('1e' || digits)::numeric THEN true
                WHEN c.x = trunc(c.x) THEN false
                -- beyond the largest double, or below the smallest (it would read as 0)
                WHEN abs(c.x) > 1.7976931348623157e308 OR abs(c.x) < 4.9406564584124654e-324
                THEN true
                -- float8's text is its shortest exact digits (float8::numeric keeps 15)
                ELSE c.x::float8::text::numeric <> c.x END)
$$;

-- The Python type name of a JSON value, as outbox.intent_rules shows it.
CREATE OR REPLACE FUNCTION outbox_json_type_name(value jsonb) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT CASE jsonb_typeof(value)
       WHEN 'object' THEN 'dict' WHEN 'array' THEN 'list' WHEN 'string' THEN 'str'
       WHEN 'boolean' THEN 'bool' WHEN 'null' THEN 'NoneType'
       ELSE CASE WHEN value::text ~ '^-?[0-9]+$' THEN 'int' ELSE 'float' END END
$$;

-- A value shown in an error with control and non-ASCII characters escaped
-- (Python's ascii()), so an error cannot forge a log line. (Every backslash an
-- E'' literal: a function's body is read in its caller's session, and one with
-- standard_conforming_strings off reads '\' as an open string.)
CREATE OR REPLACE FUNCTION outbox_printable(value text) RETURNS text
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
SELECT string_agg(CASE
         WHEN c = E'\\' THEN E'\\\\'
         WHEN c = E'\t' THEN E'\\t' WHEN c = E'\n' THEN E'\\n' WHEN c = E'\r' THEN E'\\r'
         WHEN ascii(c) BETWEEN 32 AND 126 THEN c
         WHEN ascii(c) < 256 THEN E'\\x' || lpad(to_hex(ascii(c)), 2, '0')
         WHEN ascii(c) < 65536 THEN E'\\u' || lpad(to_hex(ascii(c)), 4, '0')
         ELSE E'\\U' || lpad(to_hex(ascii(c)), 8, '0') END, '' ORDER BY n)
  FROM regexp_split_to_table(value, '') WITH ORDINALITY AS t(c, n)
$$;

-- A priority (-max_priority .. max_priority) and a fairness key (at most
-- max_fairness_key_length characters, may be empty); NULL: inherited.
CREATE OR REPLACE FUNCTION outbox_check_lane(priority integer, fairness_key text) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    rules jsonb := outbox_intent_rules();
    top integer := (rules->>'max_priority')::integer;
BEGIN
    IF priority IS NOT NULL AND priority NOT BETWEEN -top AND top THEN
        PERFORM outbox_refuse('OB001', 'priority', priority::text,
            format('must be between %s and %s', -top, top));
    END IF;
    IF fairness_key IS NOT NULL AND fairness_key <> '' THEN
        PERFORM outbox_check_text('fairness_key', fairness_key,
                                  (rules->>'max_fairness_key_length')::integer);
    END IF;
END
$$;

-- A top-level object shaped like a reference is refused: it would be read back
-- as another value (outbox.blobs.store_value).
CREATE OR REPLACE FUNCTION outbox_check_not_reference(field text, value jsonb) RETURNS void
    LANGUAGE plpgsql AS $$
BEGIN
    IF jsonb_typeof(value) = 'object' AND value ? '__outbox_blob__' THEN
        PERFORM outbox_refuse('OB002', field, '<object with ''__outbox_blob__''>',
                              '''__outbox_blob__'' is reserved');
    END IF;
END
$$;

-- An intent's own approval policy (the argument approval of outbox_intend) as the
-- effect records it, or NULL for none. true or {} asks for approval with no
-- deadline; {"timeout": seconds, "on_timeout": "reject"|"cancel_run"|"escalate",
-- "escalate_to": "who"} as outbox.gates.ApprovalPolicy.
CREATE OR REPLACE FUNCTION outbox_approval_policy(approval jsonb) RETURNS jsonb
    LANGUAGE plpgsql AS $$
DECLARE
    policy jsonb;
    extra text;
    timeout numeric;
BEGIN
    IF approval IS NULL OR approval = 'null'::jsonb OR approval = 'false'::jsonb THEN
        RETURN NULL;
    END IF;
    policy := CASE WHEN approval = 'true'::jsonb THEN '{}'::jsonb ELSE approval END;
    IF jsonb_typeof(policy) <> 'object' THEN
        PERFORM outbox_refuse('OB001', 'approval', left(approval::text, 80),
            'must be true or {"timeout": seconds, "on_timeout": ..., "escalate_to": ...}');
    END IF;
    SELECT k INTO extra FROM jsonb_object_keys(policy) AS k
     WHERE k NOT IN ('timeout', 'on_timeout', 'escalate_to') LIMIT 1;
    IF extra IS NOT NULL THEN
        PERFORM outbox_refuse('OB001', 'approval.' || extra, NULL,
            'is not a field of an approval policy (timeout, on_timeout, escalate_to)');
    END IF;
    IF policy ? 'timeout' AND policy->'timeout' <> 'null'::jsonb THEN
        IF jsonb_typeof(policy->'timeout') <> 'number' THEN
            PERFORM outbox_refuse('OB001', 'approval.timeout', policy->>'timeout',
                'must be a number of seconds');
        END IF;
        timeout := (policy->>'timeout')::numeric;
        IF timeout <= 0 OR timeout > (outbox_intent_rules()->>'max_delay_seconds')::numeric THEN
            PERFORM outbox_refuse('OB001', 'approval.timeout', timeout::text,
                'must be above 0 and at most ' || (outbox_intent_rules()->>'max_delay_seconds'));
        END IF;
    END IF;
    IF coalesce(policy->>'on_timeout', 'reject') NOT IN ('reject', 'cancel_run', 'escalate') THEN
        PERFORM outbox_refuse('OB001', 'approval.on_timeout', policy->>'on_timeout',
            'must be reject, cancel_run or escalate');
    END IF;
    IF policy ? 'escalate_to' AND policy->'escalate_to' <> 'null'::jsonb THEN
        IF jsonb_typeof(policy->'escalate_to') <> 'string' THEN
            PERFORM outbox_refuse('OB001', 'approval.escalate_to', policy->>'escalate_to',
                'must be text');
        END IF;
        PERFORM outbox_check_text('approval.escalate_to', policy->>'escalate_to', 500);
    END IF;
    RETURN jsonb_build_object(
        'gate', 'intent',
        'timeout', (policy->'timeout')::double precision,
        'on_timeout', coalesce(policy->>'on_timeout', 'reject'),
        'escalate_to', policy->>'escalate_to');
END
$$;
