-- Composite types the functions pass between them. Loaded before every other file
-- (outbox.storage.functions.functions_ddl); a type cannot be replaced in place, so
-- a change to one is a migration written by hand (DROP ... CASCADE, then the
-- functions that use it again).

-- An intent as outbox_intent_rows derives it from a caller's JSON: the row to
-- write (payload as stored: itself, or a reference to a large one), what the
-- checks and the step chain need of it (its text, size, whether its key is the
-- caller's), whether the cheap checks cleared it (screened) and, when its key
-- names an effect already, that effect's id (existing), or the ordinal of the
-- first intent of the same call under the same key (first_n): nothing to write.
CREATE TYPE outbox_intent AS (
    n integer,
    id uuid,
    step_index integer,
    kind text,
    payload jsonb,
    payload_text text,
    payload_size bigint,
    payload_hash text,
    idempotency_key text,
    caller_key boolean,
    ordering_key text,
    max_attempts integer,
    available_at timestamptz,
    schema_version integer,
    compensate jsonb,
    cost numeric,
    approval jsonb,
    priority integer,
    fairness_key text,
    trace_parent text,
    screened boolean,
    existing uuid,
    first_n integer
);
