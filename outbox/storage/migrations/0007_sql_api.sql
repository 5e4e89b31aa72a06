-- agent-outbox 0007: the SQL API. Functions any language calls inside its own
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

-- Every limit and list the SQL API enforces, in one place: outbox.intent_rules
-- (the Python client's rules, with their codes and reasons), the Settings
-- defaults, and the limits that keep a value readable by every client (JSON
-- depth and integer digits). tests/integration/test_sql_api_rules.py holds it
-- equal to the Python constants. A session or database may override the
-- settings (outbox_setting: SET outbox.max_payload_bytes = ...).
CREATE FUNCTION outbox_intent_rules() RETURNS jsonb
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT '{
  "kind_pattern": "^[A-Za-z0-9_.:-]+$",
  "max_kind_length": 200,
  "max_key_length": 500,
  "max_attempts": 1000,
  "max_schema_version": 2147483647,
  "max_delay_seconds": 315360000,
  "max_amount": 1000000000000000,
  "max_agent_length": 200,
  "max_version_length": 100,
  "max_name_length": 200,
  "max_payload_bytes": 1048576,
  "max_step_intents": 10000,
  "max_step_bytes": 67108864,
  "max_step_id_length": 200,
  "notify_window_ms": 3.0,
  "max_json_depth": 100,
  "max_integer_digits": 4300,
  "live_run_statuses": ["runnable", "running", "waiting"],
  "control_characters": "[\\x01-\\x1f\\x7f-\\x9f\\u2028\\u2029]",
  "headers_field": "headers",
  "url_field": "url",
  "header_name_pattern": "^[!#$%&''*+.^_`|~0-9A-Za-z-]+$",
  "header_value_forbidden": "[\\x01-\\x08\\x0a-\\x1f\\x7f-\\x9f\\u2028\\u2029]",
  "header_name_rules": [
    {
      "code": "framing-header",
      "names": ["connection", "content-length", "expect", "host", "http2-settings", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade"],
      "prefixes": ["proxy-"],
      "pattern": null
    },
    {
      "code": "reserved-header",
      "names": ["idempotency-key"],
      "prefixes": ["x-outbox-"],
      "pattern": null
    },
    {
      "code": "credential-header",
      "names": ["authorization", "cookie", "set-cookie", "www-authenticate"],
      "prefixes": [],
      "pattern": "token|secret|passw(or)?d|passphrase|credential|session|cookie|api-?key|access-?key|private-?key|secret-?key|authori[sz]ation|authentication|(^|-)auth(-|$)"
    }
  ],
  "query_name_rules": [
    {
      "code": "credential-query-parameter",
      "names": ["authorization", "cookie", "jwt", "pass", "pwd", "set-cookie", "sig", "signature", "www-authenticate", "x-amz-credential", "x-amz-signature", "x-goog-credential", "x-goog-signature"],
      "prefixes": [],
      "pattern": "token|secret|passw(or)?d|passphrase|credential|session|cookie|api-?key|access-?key|private-?key|secret-?key|authori[sz]ation|authentication|(^|-)auth(-|$)"
    }
  ],
  "credential_value_pattern": "^\\s*(bearer|basic)\\s+[A-Za-z0-9._~+/-]{16,}=*\\s*$",
  "reasons": {
    "control-character": "holds a control character (CR, LF, NUL, ...), which is refused",
    "surrogate": "holds a lone surrogate, which is not valid Unicode text",
    "headers-type": "must be an object of header names to text values",
    "header-name-syntax": "is not a valid header name (an HTTP token: letters, digits and !#$%&''*+.^_`|~-)",
    "header-value-type": "must be text",
    "header-value-control": "holds a control character (CR, LF, NUL, ...) other than a tab",
    "credential-value": "is an authorization scheme and its secret; payloads are stored in plain text, so credentials go by reference: name one in the payload''s ''credential'' field and configure it in the deliverers config ([kinds.<kind>.credentials.<name>] with env = ... or file = ...)",
    "url-type": "must be text",
    "url-control": "holds a control character (CR, LF, NUL, ...)",
    "url-userinfo": "holds a user name or password before the host; payloads are stored in plain text, so credentials go by reference: name one in the payload''s ''credential'' field and configure it in the deliverers config ([kinds.<kind>.credentials.<name>] with env = ... or file = ...)",
    "framing-header": "is a hop-by-hop or framing header: the HTTP client sets it",
    "reserved-header": "is set by the deliverer (the idempotency key travels as the intent''s key)",
    "credential-header": "carries a credential; payloads are stored in plain text, so credentials go by reference: name one in the payload''s ''credential'' field and configure it in the deliverers config ([kinds.<kind>.credentials.<name>] with env = ... or file = ...)",
    "credential-query-parameter": "carries a credential; payloads are stored in plain text, so credentials go by reference: name one in the payload''s ''credential'' field and configure it in the deliverers config ([kinds.<kind>.credentials.<name>] with env = ... or file = ...)"
  }
}'::jsonb
$$;

-- A setting: outbox.<name> if the session or database sets it, else the rule.
CREATE FUNCTION outbox_setting(name text) RETURNS text
    LANGUAGE sql STABLE PARALLEL SAFE AS $$
SELECT coalesce(nullif(current_setting('outbox.' || name, true), ''), outbox_intent_rules()->>name)
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
    -- Scalars are written by jsonb itself; only containers recurse (a call per
    -- leaf would cost more than the rest of an intent).
    CASE jsonb_typeof(value)
    WHEN 'object' THEN
        RETURN '{' || coalesce(
            (SELECT string_agg(to_json(e.k)::text || ':'
                               || CASE WHEN jsonb_typeof(e.v) IN ('object', 'array')
                                       THEN outbox_canonical_json(e.v) ELSE e.v::text END,
                               ',' ORDER BY e.k COLLATE "C")
               FROM jsonb_each(value) AS e(k, v)), '') || '}';
    WHEN 'array' THEN
        RETURN '[' || coalesce(
            (SELECT string_agg(CASE WHEN jsonb_typeof(a.v) IN ('object', 'array')
                                    THEN outbox_canonical_json(a.v) ELSE a.v::text END,
                               ',' ORDER BY a.n)
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

-- Refuse an argument (OB001) or a JSON value (OB002), naming the field and
-- showing the value as outbox.errors.ValidationError does; rule is the
-- outbox.intent_rules code when one applies.
CREATE FUNCTION outbox_refuse(code text, field text, value text, reason text,
                              rule text DEFAULT NULL) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    shown text := CASE WHEN value IS NULL THEN 'NULL'
                       WHEN char_length(value) > 77 THEN quote_literal(left(value, 74)) || '...'
                       ELSE quote_literal(value) END;
BEGIN
    RAISE EXCEPTION USING ERRCODE = code, MESSAGE = field || '=' || shown || ': ' || reason,
        COLUMN = field,
        DETAIL = jsonb_strip_nulls(jsonb_build_object(
            'field', field, 'value', left(value, 200), 'reason', reason, 'rule', rule))::text;
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
-- character (rule control-character: they forge log lines and break the
-- headers a key is sent in), not blank if so asked.
CREATE FUNCTION outbox_check_text(
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

-- An effect kind (or a compensation's kind).
CREATE FUNCTION outbox_check_kind(field text, value text) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    rules jsonb := outbox_intent_rules();
BEGIN
    PERFORM outbox_check_text(field, value, (rules->>'max_kind_length')::integer);
    IF value !~ (rules->>'kind_pattern') THEN
        PERFORM outbox_refuse('OB001', field, value, 'must match ' || (rules->>'kind_pattern'));
    END IF;
END
$$;

-- An amount (budget, cost, spend): finite, not negative (positive if so asked),
-- at most max_amount.
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
    IF value > (outbox_intent_rules()->>'max_amount')::numeric THEN
        PERFORM outbox_refuse('OB001', field, value::text,
            'must be at most ' || (outbox_intent_rules()->>'max_amount'));
    END IF;
END
$$;

-- A JSON value to store (payload, inputs, state, result, error): readable by
-- every client (at most max_json_depth levels of nesting; no integer of more
-- than max_integer_digits digits, which Python cannot read; no fraction beyond
-- a double's range, which would read as infinity) and at most max_bytes of
-- canonical JSON. Returns the canonical text. NUL characters and NaN never
-- reach here: jsonb refuses them when the argument is cast.
CREATE FUNCTION outbox_check_json(field text, value jsonb, max_bytes integer) RETURNS text
    LANGUAGE plpgsql AS $$
DECLARE
    rules jsonb := outbox_intent_rules();
    depth integer := (rules->>'max_json_depth')::integer;
    digits integer := (rules->>'max_integer_digits')::integer;
    canonical text := outbox_canonical_json(value);
    size integer := octet_length(canonical);
BEGIN
    IF size > max_bytes THEN
        PERFORM outbox_refuse('OB002', field, format('<%s bytes>', size),
            format('is %s bytes, over the limit of %s bytes', size, max_bytes));
    END IF;
    -- The exact checks walk the whole value; the text tells cheaply when they
    -- cannot fail (fewer brackets than levels, no run of digits that long).
    IF length(canonical) - length(translate(canonical, '[{', '')) > depth
       AND jsonb_path_exists(value, ('strict $.**{' || depth
                                     || '} ? (@.type() == "object" || @.type() == "array")')::jsonpath)
    THEN
        PERFORM outbox_refuse('OB002', field, left(value::text, 80),
            format('is nested more than %s levels deep', depth));
    END IF;
    IF canonical ~ '[0-9]{200}[0-9]{109}'  -- (a bound is at most 255)
       AND jsonb_path_exists(value,
            'strict $.** ? (@.type() == "number" && (@ >= $big || @ <= -$big
                            || (@.floor() != @ && (@ >= 1e308 || @ <= -1e308))))',
            jsonb_build_object('big', ('1e' || digits)::numeric))
    THEN
        PERFORM outbox_refuse('OB002', field, left(value::text, 80),
            format('holds an integer too long to write (over %s digits) or a fraction beyond '
                   'the range of a double', digits));
    END IF;
    RETURN canonical;
END
$$;

-- The Python type name of a JSON value, as outbox.intent_rules shows it.
CREATE FUNCTION outbox_json_type_name(value jsonb) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT CASE jsonb_typeof(value)
       WHEN 'object' THEN 'dict' WHEN 'array' THEN 'list' WHEN 'string' THEN 'str'
       WHEN 'boolean' THEN 'bool' WHEN 'null' THEN 'NoneType'
       ELSE CASE WHEN value::text ~ '^-?[0-9]+$' THEN 'int' ELSE 'float' END END
$$;

-- A value shown in an error with control and non-ASCII characters escaped
-- (Python's ascii()), so an error cannot forge a log line.
CREATE FUNCTION outbox_printable(value text) RETURNS text
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
SELECT string_agg(CASE
         WHEN c = '\' THEN '\\'
         WHEN c = E'\t' THEN '\t' WHEN c = E'\n' THEN '\n' WHEN c = E'\r' THEN '\r'
         WHEN ascii(c) BETWEEN 32 AND 126 THEN c
         WHEN ascii(c) < 256 THEN '\x' || lpad(to_hex(ascii(c)), 2, '0')
         WHEN ascii(c) < 65536 THEN '\u' || lpad(to_hex(ascii(c)), 4, '0')
         ELSE '\U' || lpad(to_hex(ascii(c)), 8, '0') END, '' ORDER BY n)
  FROM regexp_split_to_table(value, '') WITH ORDINALITY AS t(c, n)
$$;

-- The code of the first rule of rule_list (outbox.intent_rules.NameRule) that
-- refuses a normalised name, or NULL.
CREATE FUNCTION outbox_name_rule(rule_list jsonb, normalised text) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT r.rule->>'code'
  FROM jsonb_array_elements(rule_list) WITH ORDINALITY AS r(rule, n)
 WHERE r.rule->'names' ? normalised
    OR EXISTS (SELECT 1 FROM jsonb_array_elements_text(r.rule->'prefixes') AS p(prefix)
                WHERE starts_with(normalised, p.prefix))
    OR (jsonb_typeof(r.rule->'pattern') = 'string' AND normalised ~* (r.rule->>'pattern'))
 ORDER BY r.n
 LIMIT 1
$$;

-- A URL query name decoded as urllib.parse.unquote_plus does ('+' is a space,
-- %XX a UTF-8 byte); left as it is when the bytes are not UTF-8.
CREATE FUNCTION outbox_url_unquote(value text) RETURNS text
    LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
DECLARE
    plain text := replace(value, '+', ' ');
    bytes bytea := ''::bytea;
    part text;
BEGIN
    IF position('%' IN plain) = 0 THEN
        RETURN plain;
    END IF;
    FOR part IN SELECT m[1] FROM regexp_matches(plain, '(%[0-9A-Fa-f]{2}|[^%]+|%)', 'g') AS m LOOP
        IF part ~ '^%[0-9A-Fa-f]{2}$' THEN
            bytes := bytes || decode(substr(part, 2), 'hex');
        ELSE
            bytes := bytes || convert_to(part, 'UTF8');
        END IF;
    END LOOP;
    BEGIN
        RETURN convert_from(bytes, 'UTF8');
    EXCEPTION WHEN character_not_in_repertoire OR untranslatable_character THEN
        RETURN plain;
    END;
END
$$;

-- A URL as it may be shown: no userinfo, no query or fragment values.
CREATE FUNCTION outbox_url_redacted(scheme text, netloc text, path text, query text, fragment text)
    RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT coalesce(scheme, '') || '://' || regexp_replace(coalesce(netloc, ''), '^.*@', '')
       || coalesce(path, '')
       || CASE WHEN coalesce(query, '') = '' THEN ''
               ELSE '?' || (SELECT string_agg(outbox_url_unquote(split_part(q, '=', 1)) || '=...', '&')
                              FROM unnest(string_to_array(query, '&')) AS q
                             WHERE q <> '') END
       || CASE WHEN coalesce(fragment, '') = '' THEN '' ELSE '#...' END
$$;

-- The first rule of outbox.intent_rules a payload breaks, as
-- {"rule": code, "field": ..., "shown": ...}, or NULL. Only a JSON object's
-- top-level "headers" object and "url" string are looked at (whatever the
-- kind: a deliverer config may map any kind to http.request); headers first.
CREATE FUNCTION outbox_payload_violation(payload jsonb, field text) RETURNS jsonb
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    rules jsonb := outbox_intent_rules();
    headers jsonb;
    where_ text;
    h record;
    code text;
    url text;
    parts text[];
    scheme text;
    rest text;
    netloc text;
    query text;
    fragment text;
    piece text;
    param text;
BEGIN
    IF jsonb_typeof(payload) IS DISTINCT FROM 'object' THEN
        RETURN NULL;
    END IF;
    headers := payload->(rules->>'headers_field');
    where_ := field || '.' || (rules->>'headers_field');
    IF headers IS NOT NULL AND jsonb_typeof(headers) <> 'null' THEN
        IF jsonb_typeof(headers) <> 'object' THEN
            RETURN jsonb_build_object('rule', 'headers-type', 'field', where_,
                                      'shown', outbox_json_type_name(headers));
        END IF;
        FOR h IN SELECT e.k AS name, e.v AS value FROM jsonb_each(headers) AS e(k, v) LOOP
            IF h.name !~ (rules->>'header_name_pattern') THEN
                RETURN jsonb_build_object('rule', 'header-name-syntax', 'field', where_,
                                          'shown', outbox_printable(h.name));
            END IF;
            code := outbox_name_rule(rules->'header_name_rules', replace(lower(h.name), '_', '-'));
            IF code IS NOT NULL THEN
                RETURN jsonb_build_object('rule', code, 'field', where_, 'shown', h.name);
            END IF;
            IF jsonb_typeof(h.value) <> 'string' THEN
                RETURN jsonb_build_object('rule', 'header-value-type', 'field', where_ || '.' || h.name,
                                          'shown', outbox_json_type_name(h.value));
            END IF;
            IF (h.value #>> '{}') ~ (rules->>'header_value_forbidden') THEN
                -- the value itself is not shown: it may be a secret
                RETURN jsonb_build_object('rule', 'header-value-control', 'field', where_ || '.' || h.name,
                    'shown', format('<%s characters>', char_length(h.value #>> '{}')));
            END IF;
            IF (h.value #>> '{}') ~* (rules->>'credential_value_pattern') THEN
                RETURN jsonb_build_object('rule', 'credential-value', 'field', where_ || '.' || h.name,
                    'shown', (regexp_match(h.value #>> '{}', '(\S+)'))[1] || ' <hidden>');
            END IF;
        END LOOP;
    END IF;

    where_ := field || '.' || (rules->>'url_field');
    IF payload->(rules->>'url_field') IS NULL OR jsonb_typeof(payload->(rules->>'url_field')) = 'null' THEN
        RETURN NULL;
    END IF;
    IF jsonb_typeof(payload->(rules->>'url_field')) <> 'string' THEN
        RETURN jsonb_build_object('rule', 'url-type', 'field', where_,
                                  'shown', outbox_json_type_name(payload->(rules->>'url_field')));
    END IF;
    url := payload->>(rules->>'url_field');
    -- urllib.parse.urlsplit: scheme, then //netloc up to / ? #, then #fragment, then ?query
    parts := regexp_match(ltrim(url, ' '), '^([A-Za-z][A-Za-z0-9+.-]*):(.*)$');
    scheme := lower(parts[1]);
    rest := coalesce(parts[2], ltrim(url, ' '));
    IF left(rest, 2) = '//' THEN
        parts := regexp_match(substr(rest, 3), '^([^/?#]*)(.*)$');
        netloc := parts[1];
        rest := parts[2];
    END IF;
    IF position('#' IN rest) > 0 THEN
        fragment := substr(rest, position('#' IN rest) + 1);
        rest := left(rest, position('#' IN rest) - 1);
    END IF;
    IF position('?' IN rest) > 0 THEN
        query := substr(rest, position('?' IN rest) + 1);
        rest := left(rest, position('?' IN rest) - 1);
    END IF;
    IF url ~ (rules->>'control_characters') THEN
        RETURN jsonb_build_object('rule', 'url-control', 'field', where_, 'shown',
            outbox_printable(outbox_url_redacted(scheme, netloc, rest, query, fragment)));
    END IF;
    IF (position('[' IN coalesce(netloc, '')) > 0) <> (position(']' IN coalesce(netloc, '')) > 0) THEN
        RETURN NULL;  -- urlsplit refuses it (ValueError); so does the deliverer
    END IF;
    IF position('@' IN coalesce(netloc, '')) > 0 THEN
        RETURN jsonb_build_object('rule', 'url-userinfo', 'field', where_,
            'shown', outbox_url_redacted(scheme, netloc, rest, query, fragment));
    END IF;
    FOREACH piece IN ARRAY ARRAY[query, fragment] LOOP
        CONTINUE WHEN piece IS NULL OR position('=' IN piece) = 0;
        -- some servers split parameters on ';' as well as '&'
        FOREACH param IN ARRAY string_to_array(replace(piece, ';', '&'), '&') LOOP
            CONTINUE WHEN position('=' IN param) = 0;  -- a name is what comes before "="
            code := outbox_name_rule(rules->'query_name_rules',
                replace(lower(outbox_url_unquote(split_part(param, '=', 1))), '_', '-'));
            IF code IS NOT NULL THEN
                RETURN jsonb_build_object('rule', code, 'field', where_,
                    'shown', outbox_url_redacted(scheme, netloc, rest, query, fragment));
            END IF;
        END LOOP;
    END LOOP;
    RETURN NULL;
END
$$;

-- Refuse a payload that breaks a rule of outbox.intent_rules (OB001, with the
-- rule's code and reason).
CREATE FUNCTION outbox_check_payload(payload jsonb, field text) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    found jsonb := outbox_payload_violation(payload, field);
BEGIN
    IF found IS NOT NULL THEN
        PERFORM outbox_refuse('OB001', found->>'field', found->>'shown',
                              outbox_intent_rules()->'reasons'->>(found->>'rule'), found->>'rule');
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
    window_us double precision := 1000 * outbox_setting('notify_window_ms')::double precision;
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
-- committed: the next intent index, how many intents and bytes, budget debits
-- and reservations. Kept in transaction-local settings, so a rollback (or a
-- rollback to a savepoint) forgets it together with the rows.
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
    PERFORM outbox_check_text('step_id', p_step_id, outbox_setting('max_step_id_length')::integer,
                              true, true);
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
    -- sees rows inserted while this setting is present
    PERFORM outbox_tx_save_step(p_run_id, p_step_id, entry);
    RETURN entry;
END
$$;

-- Record that effect kind with payload must happen, once, when this transaction
-- commits. With run_id and step_id the intent belongs to that step (call
-- outbox_commit_step for it before committing); without, it belongs to no run.
-- The rules are the Python client's (outbox.intent_rules, EffectIntent).
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
    max_bytes integer := outbox_setting('max_payload_bytes')::integer;
    canonical text;
    size bigint;
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
        IF existing.kind <> outbox_intend.kind THEN
            PERFORM outbox_raise_conflict(p_key,
                format('already intended as kind %L, not %L', existing.kind, outbox_intend.kind));
        END IF;
        -- equal payloads hash equally; a float Python writes with an exponent is
        -- compared as a jsonb value (see outbox_canonical_json)
        IF NOT (existing.payload_hash = p_hash OR existing.payload = outbox_intend.payload) THEN
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
                    'entry', 'reserve', 'reason', outbox_intend.kind,
                    'amount', outbox_intend.cost, 'effect_id', effect_id)));
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
        (outbox_intent_rules()->>'max_name_length')::integer, true, true);
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
    max_bytes integer := outbox_setting('max_payload_bytes')::integer;
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
    IF (tx_step->>'bytes')::bigint > 0 THEN
        -- Asked again at the step's end, nearer the commit: an intend that was
        -- refused a NOTIFY early in a long transaction may be granted one now.
        PERFORM outbox_wake('outbox_effects');
    END IF;
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
    PERFORM outbox_check_text('agent', outbox_start_run.agent, (rules->>'max_agent_length')::integer);
    PERFORM outbox_check_text('version', outbox_start_run.version, (rules->>'max_version_length')::integer);
    canonical := outbox_check_json('inputs', p_inputs, outbox_setting('max_payload_bytes')::integer);
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
    max_bytes integer := outbox_setting('max_payload_bytes')::integer;
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
    PERFORM outbox_check_text('name', outbox_signal.name, (rules->>'max_name_length')::integer,
                              true, true);
    PERFORM outbox_check_text('dedup_key', outbox_signal.dedup_key,
                              (rules->>'max_key_length')::integer, false);
    PERFORM outbox_check_json('payload', coalesce(outbox_signal.payload, 'null'::jsonb),
                              outbox_setting('max_payload_bytes')::integer);
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
