-- Hex sha256 over length-prefixed parts (8-byte big-endian length, then the
-- UTF-8 bytes): the same bytes outbox.keys hashes.
CREATE OR REPLACE FUNCTION outbox_key_digest(VARIADIC parts text[]) RETURNS text
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
SELECT encode(sha256(string_agg(int8send(octet_length(b)::bigint) || b, ''::bytea ORDER BY n)), 'hex')
  FROM unnest(parts) WITH ORDINALITY AS p(part, n), convert_to(p.part, 'UTF8') AS b
$$;

-- The default idempotency key of the step_index-th intent of step_id in run_id
-- (outbox.keys.derive_key).
-- (outbox_key_digest of the three, spelled out: it runs for every intent; no
-- '\x...' literal, which standard_conforming_strings=off would read otherwise.)
CREATE OR REPLACE FUNCTION outbox_derive_key(run_id uuid, step_id text, step_index integer) RETURNS text
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
SELECT encode(sha256(int8send(36::bigint) || outbox_utf8(run_id::text)
    || int8send(octet_length(outbox_utf8(step_id))::bigint) || outbox_utf8(step_id)
    || int8send(octet_length(step_index::text)::bigint) || outbox_utf8(step_index::text)),
    'hex')
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

