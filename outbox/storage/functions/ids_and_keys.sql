-- Hex sha256 over length-prefixed parts (8-byte big-endian length, then the
-- UTF-8 bytes): the same bytes outbox.keys hashes.
CREATE OR REPLACE FUNCTION outbox_key_digest(VARIADIC parts text[]) RETURNS text
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
SELECT encode(sha256(string_agg(int8send(octet_length(b)::bigint) || b, ''::bytea ORDER BY n)), 'hex')
  FROM unnest(parts) WITH ORDINALITY AS p(part, n), convert_to(p.part, 'UTF8') AS b
$$;

-- The default idempotency key of the step_index-th intent of step_id in run_id
-- (outbox.keys.derive_key).
CREATE OR REPLACE FUNCTION outbox_derive_key(run_id uuid, step_id text, step_index integer) RETURNS text
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
SELECT outbox_key_digest(run_id::text, step_id, step_index::text)
$$;

-- The key of the effect that compensates the effect with key original_key.
CREATE OR REPLACE FUNCTION outbox_compensation_key(original_key text) RETURNS text
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
SELECT outbox_key_digest('compensate', original_key)
$$;

-- A time-ordered UUID (version 7), like outbox.ids.uuid7 (PostgreSQL 18 has
-- uuidv7(); this also runs on 13 to 17).
CREATE OR REPLACE FUNCTION outbox_uuid7() RETURNS uuid
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
CREATE OR REPLACE FUNCTION outbox_canonical_json(value jsonb) RETURNS text
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
