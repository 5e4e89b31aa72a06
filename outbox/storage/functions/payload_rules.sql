-- The code of the first rule of rule_list (outbox.intent_rules.NameRule) that
-- refuses a normalised name, or NULL.
CREATE OR REPLACE FUNCTION outbox_name_rule(rule_list jsonb, normalised text) RETURNS text
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
CREATE OR REPLACE FUNCTION outbox_url_unquote(value text) RETURNS text
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
CREATE OR REPLACE FUNCTION outbox_url_redacted(scheme text, netloc text, path text, query text, fragment text)
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
CREATE OR REPLACE FUNCTION outbox_payload_violation(payload jsonb, field text) RETURNS jsonb
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
                    'shown', (regexp_match(h.value #>> '{}', '([^[:space:]]+)'))[1] || ' <hidden>');
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
CREATE OR REPLACE FUNCTION outbox_check_payload(payload jsonb, field text) RETURNS void
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
