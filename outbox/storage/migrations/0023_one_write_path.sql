-- agent-outbox 0023: one write path.
--
-- It rewrites the run-scoped tables (a column added to every row, keys rebuilt):
-- writers wait while it runs. Written by hand (the tables): every run-scoped table
-- carries its run's logical
-- shard (outbox.shards, functions/shards.sql), which every key includes: on Citus
-- the column the tables are distributed by. A caller's key is unique in its
-- namespace through a registry on the key's own shard. A run numbers its steps
-- itself (step_count), so that their order never comes from a sequence.

CREATE OR REPLACE FUNCTION outbox_shard_of(id uuid) RETURNS smallint
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
SELECT (get_byte(uuid_send(id), 15) & 31)::smallint
$$;

CREATE OR REPLACE FUNCTION outbox_key_shard(namespace text, key text) RETURNS smallint
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
SELECT (get_byte(sha256(convert_to(namespace || chr(31) || key, 'UTF8')), 31) & 31)::smallint
$$;

-- the foreign keys go first: they name the primary keys that change
ALTER TABLE outbox_effect_attempts DROP CONSTRAINT outbox_effect_attempts_effect_id_fkey;
ALTER TABLE outbox_signals DROP CONSTRAINT outbox_signals_run_id_fkey;
ALTER TABLE outbox_budget_ledger DROP CONSTRAINT outbox_budget_ledger_run_id_fkey;
ALTER TABLE outbox_blob_refs DROP CONSTRAINT outbox_blob_refs_sha256_fkey;

-- runs: the step counter first (next to current_step: a step's update changes both)
ALTER TABLE outbox_runs ADD COLUMN step_count bigint NOT NULL DEFAULT 0;
ALTER TABLE outbox_runs ADD COLUMN shard smallint;
ALTER TABLE outbox_runs ADD COLUMN namespace text NOT NULL DEFAULT 'default';
UPDATE outbox_runs AS r
   SET shard = outbox_shard_of(r.id),
       step_count = coalesce((SELECT max(s.seq) FROM outbox_steps AS s WHERE s.run_id = r.id), 0);
ALTER TABLE outbox_runs ALTER COLUMN shard SET NOT NULL;
ALTER TABLE outbox_runs DROP CONSTRAINT outbox_runs_pkey;
ALTER TABLE outbox_runs ADD CONSTRAINT outbox_runs_pkey PRIMARY KEY (id, shard);
ALTER TABLE outbox_runs ADD CONSTRAINT outbox_runs_shard_check CHECK (shard = outbox_shard_of(id));

CREATE TABLE outbox_run_keys (
    namespace text NOT NULL,
    key text NOT NULL,
    shard smallint NOT NULL,
    run_id uuid NOT NULL,
    CONSTRAINT outbox_run_keys_pkey PRIMARY KEY (namespace, key, shard),
    CONSTRAINT outbox_run_keys_shard_check CHECK (shard = outbox_key_shard(namespace, key))
);
INSERT INTO outbox_run_keys (namespace, key, shard, run_id)
SELECT 'default', r.key, outbox_key_shard('default', r.key), r.id
  FROM outbox_runs AS r WHERE r.key IS NOT NULL;
DROP INDEX outbox_runs_key;

-- steps: numbered by their run from now on
ALTER TABLE outbox_steps ALTER COLUMN seq DROP IDENTITY;
ALTER TABLE outbox_steps ADD COLUMN shard smallint;
UPDATE outbox_steps SET shard = outbox_shard_of(run_id);
ALTER TABLE outbox_steps ALTER COLUMN shard SET NOT NULL;
ALTER TABLE outbox_steps DROP CONSTRAINT outbox_steps_pkey;
ALTER TABLE outbox_steps ADD CONSTRAINT outbox_steps_pkey PRIMARY KEY (run_id, step_id, shard);
ALTER TABLE outbox_steps ADD CONSTRAINT outbox_steps_shard_check
    CHECK (shard = outbox_shard_of(run_id));

-- effects: on their run's shard (of no run: their id's), keys unique per namespace
ALTER TABLE outbox_effects ADD COLUMN shard smallint;
ALTER TABLE outbox_effects ADD COLUMN namespace text NOT NULL DEFAULT 'default';
UPDATE outbox_effects SET shard = outbox_shard_of(coalesce(run_id, id));
ALTER TABLE outbox_effects ALTER COLUMN shard SET NOT NULL;
ALTER TABLE outbox_effects DROP CONSTRAINT outbox_effects_pkey;
ALTER TABLE outbox_effects ADD CONSTRAINT outbox_effects_pkey PRIMARY KEY (id, shard);
ALTER TABLE outbox_effects DROP CONSTRAINT outbox_effects_idempotency_key;
ALTER TABLE outbox_effects ADD CONSTRAINT outbox_effects_idempotency_key
    UNIQUE (namespace, idempotency_key, shard);
ALTER TABLE outbox_effects ADD CONSTRAINT outbox_effects_shard_check
    CHECK (shard = outbox_shard_of(coalesce(run_id, id)));

CREATE TABLE outbox_effect_keys (
    namespace text NOT NULL,
    key text NOT NULL,
    shard smallint NOT NULL,
    effect_id uuid NOT NULL,
    run_id uuid,
    kind text NOT NULL,
    payload_hash text NOT NULL,
    mirror boolean NOT NULL DEFAULT false,
    CONSTRAINT outbox_effect_keys_pkey PRIMARY KEY (namespace, key, shard),
    CONSTRAINT outbox_effect_keys_shard_check
        CHECK (mirror OR shard = outbox_key_shard(namespace, key))
);
-- Every caller's key an effect holds (not derived from its run, step and index)
INSERT INTO outbox_effect_keys (namespace, key, shard, effect_id, run_id, kind, payload_hash)
SELECT 'default', e.idempotency_key, outbox_key_shard('default', e.idempotency_key), e.id,
       e.run_id, e.kind, e.payload_hash
  FROM outbox_effects AS e
 WHERE e.run_id IS NULL OR e.step_index IS NULL
    OR e.idempotency_key <> outbox_derive_key(e.run_id, e.step_id, e.step_index);

-- the rows that hang off an effect or a run
ALTER TABLE outbox_effect_attempts ADD COLUMN shard smallint;
UPDATE outbox_effect_attempts AS a SET shard = e.shard FROM outbox_effects AS e WHERE e.id = a.effect_id;
ALTER TABLE outbox_effect_attempts ALTER COLUMN shard SET NOT NULL;
ALTER TABLE outbox_effect_attempts DROP CONSTRAINT outbox_effect_attempts_pkey;
ALTER TABLE outbox_effect_attempts ADD CONSTRAINT outbox_effect_attempts_pkey PRIMARY KEY (id, shard);
ALTER TABLE outbox_effect_attempts ADD CONSTRAINT outbox_effect_attempts_effect_id_fkey
    FOREIGN KEY (effect_id, shard) REFERENCES outbox_effects (id, shard) ON DELETE CASCADE;

ALTER TABLE outbox_signals ADD COLUMN shard smallint;
UPDATE outbox_signals SET shard = outbox_shard_of(run_id);
ALTER TABLE outbox_signals ALTER COLUMN shard SET NOT NULL;
ALTER TABLE outbox_signals DROP CONSTRAINT outbox_signals_pkey;
ALTER TABLE outbox_signals ADD CONSTRAINT outbox_signals_pkey PRIMARY KEY (id, shard);
ALTER TABLE outbox_signals DROP CONSTRAINT outbox_signals_dedup;
ALTER TABLE outbox_signals ADD CONSTRAINT outbox_signals_dedup UNIQUE (run_id, dedup_key, shard);
ALTER TABLE outbox_signals ADD CONSTRAINT outbox_signals_run_id_fkey
    FOREIGN KEY (run_id, shard) REFERENCES outbox_runs (id, shard) ON DELETE CASCADE;
ALTER TABLE outbox_signals ADD CONSTRAINT outbox_signals_shard_check
    CHECK (shard = outbox_shard_of(run_id));

ALTER TABLE outbox_budget_ledger ADD COLUMN shard smallint;
UPDATE outbox_budget_ledger SET shard = outbox_shard_of(run_id);
ALTER TABLE outbox_budget_ledger ALTER COLUMN shard SET NOT NULL;
ALTER TABLE outbox_budget_ledger DROP CONSTRAINT outbox_budget_ledger_pkey;
ALTER TABLE outbox_budget_ledger ADD CONSTRAINT outbox_budget_ledger_pkey PRIMARY KEY (id, shard);
ALTER TABLE outbox_budget_ledger ADD CONSTRAINT outbox_budget_ledger_run_id_fkey
    FOREIGN KEY (run_id, shard) REFERENCES outbox_runs (id, shard) ON DELETE CASCADE;
ALTER TABLE outbox_budget_ledger ADD CONSTRAINT outbox_budget_ledger_shard_check
    CHECK (shard = outbox_shard_of(run_id));

-- large values: stored once per shard, beside the rows that use them
ALTER TABLE outbox_blob_refs ADD COLUMN shard smallint;
UPDATE outbox_blob_refs SET shard = outbox_shard_of(owner);
ALTER TABLE outbox_blob_refs ALTER COLUMN shard SET NOT NULL;
CREATE TABLE outbox_blobs_sharded AS
SELECT DISTINCT ON (b.sha256, f.shard) b.sha256, b.bytes, b.data, b.created_at, b.used_at, f.shard
  FROM outbox_blobs AS b JOIN outbox_blob_refs AS f ON f.sha256 = b.sha256;
ALTER TABLE outbox_blobs ADD COLUMN shard smallint;
DELETE FROM outbox_blobs;
INSERT INTO outbox_blobs (sha256, bytes, data, created_at, used_at, shard)
SELECT sha256, bytes, data, created_at, used_at, shard FROM outbox_blobs_sharded;
DROP TABLE outbox_blobs_sharded;
ALTER TABLE outbox_blobs ALTER COLUMN shard SET NOT NULL;
ALTER TABLE outbox_blobs DROP CONSTRAINT outbox_blobs_pkey;
ALTER TABLE outbox_blobs ADD CONSTRAINT outbox_blobs_pkey PRIMARY KEY (sha256, shard);
ALTER TABLE outbox_blob_refs DROP CONSTRAINT outbox_blob_refs_pkey;
ALTER TABLE outbox_blob_refs ADD CONSTRAINT outbox_blob_refs_pkey PRIMARY KEY (owner, sha256, shard);
ALTER TABLE outbox_blob_refs ADD CONSTRAINT outbox_blob_refs_sha256_fkey
    FOREIGN KEY (sha256, shard) REFERENCES outbox_blobs (sha256, shard);
ALTER TABLE outbox_blob_refs ADD CONSTRAINT outbox_blob_refs_shard_check
    CHECK (shard = outbox_shard_of(owner));

-- the attempt log records where its effect stood once each row was logged (status,
-- sha256 of the result), covered by the row's link: rows written before keep v1 links
ALTER TABLE outbox_effect_attempts ADD COLUMN effect_status text;
ALTER TABLE outbox_effect_attempts ADD COLUMN result_hash text;

-- Generated by `python -m tools.new_migration` from outbox/storage/functions;
-- a frozen copy once released: change the function files, never this part.

-- Bodies refer to each other in any order (as pg_dump's do); the search path the
-- SECURITY DEFINER functions keep (outbox.storage.functions.LOAD_SETTINGS).
SET LOCAL check_function_bodies = off;
SELECT set_config('search_path', format('%I, pg_catalog, pg_temp', current_schema()), true);

DROP FUNCTION outbox_canonical_json(value jsonb);

DROP FUNCTION outbox_check_json(field text, value jsonb, max_bytes integer);

DROP FUNCTION outbox_commit_step(run_id uuid, step_id text, result jsonb, state jsonb, plan jsonb, intents jsonb, step_kind text, OUT step_seq bigint, OUT effect_ids uuid[]);

DROP FUNCTION outbox_finish_run(run_id uuid, status text, result jsonb, error jsonb);

DROP FUNCTION outbox_gate_condition(cond jsonb, payload jsonb);

DROP FUNCTION outbox_gate_matches(conditions jsonb, payload jsonb);

DROP FUNCTION outbox_intend(kind text, payload jsonb, key text, ordering_key text, run_id uuid, step_id text, step_index integer, max_attempts integer, delay_seconds double precision, schema_version integer, compensate jsonb, cost numeric, approval jsonb, priority integer, fairness_key text, OUT effect_id uuid, OUT idempotency_key text, OUT created boolean);

DROP FUNCTION outbox_resolve(value jsonb);

DROP FUNCTION outbox_start_run(agent text, version text, inputs jsonb, budget numeric, run_id uuid, key text, on_conflict text, priority integer, fairness_key text, mode text);

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

-- The intents' part of a step's link: the parts ([step_index, id, link text] of
-- every effect the step created, in whatever order they were written) joined in
-- step_index order.
CREATE OR REPLACE FUNCTION outbox_intents_chain(parts jsonb) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT coalesce(string_agg(p->>2, '' ORDER BY (p->>0)::integer, p->>1), '')
  FROM jsonb_array_elements(parts) AS p
$$;

-- An attempt-log row's v2 link (the algorithm at the top of this file).
CREATE OR REPLACE FUNCTION outbox_attempt_link(
    prev bytea, effect_id uuid, attempt integer, worker text, started_at timestamptz,
    finished_at timestamptz, outcome text, detail jsonb, effect_status text, result_hash text
) RETURNS bytea
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT sha256(prev || convert_to('outbox.attempt.v2' || outbox_lp(effect_id::text)
    || outbox_lp(attempt::text) || outbox_lp(worker) || outbox_lp(outbox_us(started_at))
    || outbox_lp(outbox_us(finished_at)) || outbox_lp(outcome) || outbox_lp(detail::text)
    || outbox_lp(effect_status) || outbox_lp(result_hash), 'UTF8'))
$$;

-- outbox_resolve without the hash check, for `outbox audit verify` alone: the
-- audit hashes every referenced blob itself and reports an altered one as a break
-- naming it (outbox.chain), where a raised error would stop the whole report.
-- Nothing else may read through it: what it returns is not vouched for.
CREATE OR REPLACE FUNCTION outbox_resolve_unchecked(value jsonb) RETURNS jsonb
    LANGUAGE plpgsql STABLE AS $$
DECLARE
    sha text := outbox_reference_sha(value);
    stored text;
BEGIN
    IF sha IS NULL THEN
        RETURN value;
    END IF;
    SELECT b.data INTO stored FROM outbox_blobs AS b WHERE b.sha256 = sha LIMIT 1;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'stored value sha256=% is missing from outbox_blobs', sha;
    END IF;
    RETURN stored::jsonb;
END
$$;

-- Refuse a run that takes no steps now: missing (OB004), paused (OB009) or
-- ended (OB005).
CREATE OR REPLACE FUNCTION outbox_raise_run_refusal(p_run_id uuid) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    found_run record;
BEGIN
    SELECT r.status, r.pause_reason INTO found_run FROM outbox_runs AS r
     WHERE r.id = p_run_id AND r.shard = outbox_shard_of(p_run_id);
    IF NOT FOUND THEN
        PERFORM outbox_raise_run_not_found(p_run_id);
    ELSIF found_run.status = 'paused' THEN
        PERFORM outbox_raise_run_paused(p_run_id, found_run.pause_reason);
    ELSE
        PERFORM outbox_raise_run_ended(p_run_id, found_run.status);
    END IF;
END
$$;

-- The step writers run as the tables' owner (SECURITY DEFINER): one refuses a
-- session whose login could not record a step by hand (no INSERT on outbox_steps),
-- as PostgreSQL would have refused its statements.
CREATE OR REPLACE FUNCTION outbox_raise_not_step_writer() RETURNS void
    LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'permission denied: role % records no steps (it has no INSERT on outbox_steps)',
        session_user USING ERRCODE = 'insufficient_privilege';
END
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
    SELECT coalesce(bool_and(x.screened), true)
           AND count(*) + (entry->>'count')::integer <= outbox_limit('max_step_intents')
           AND coalesce(sum(x.payload_size), 0) + (entry->>'bytes')::bigint
               <= outbox_limit('max_step_bytes'),
           coalesce(array_agg(x ORDER BY x.n), '{}')
      INTO screened, rows
      FROM outbox_intent_rows(p_run_id, p_step_id, intents, coalesce((entry->>'next')::integer, 0),
                              run.priority, run.fairness_key, run.dry_run, NULL,
                              coalesce(run.namespace, 'default')) AS x;
    IF NOT screened THEN
        -- checked exactly (and callers' keys locked), then derived again: the
        -- effects a locked key names are seen now
        SELECT * INTO firsts, checked, existing FROM outbox_check_intents(p_run_id, p_step_id, intents,
            coalesce((entry->>'next')::integer, 0), (entry->>'count')::integer,
            (entry->>'bytes')::bigint, coalesce(run.dry_run, false), indexed,
            coalesce(run.namespace, 'default'));
        SELECT coalesce(array_agg(x ORDER BY x.n), '{}') INTO rows
          FROM outbox_intent_rows(p_run_id, p_step_id, checked, coalesce((entry->>'next')::integer, 0),
                                  run.priority, run.fairness_key, run.dry_run, firsts,
                                  coalesce(run.namespace, 'default'), existing) AS x;
    END IF;
    -- once (as an argument of outbox_intent_effects it would run once per use)
    gates := outbox_gates_of(ARRAY(SELECT DISTINCT r.kind FROM unnest(rows) AS r));
    WITH ins AS (
        INSERT INTO outbox_effects AS e (
            id, run_id, step_id, step_index, kind, payload, payload_hash, schema_version,
            idempotency_key, ordering_key, max_attempts, compensate, cost, priority,
            fairness_key, status, available_at, approval, approval_deadline, trace_parent,
            shard, namespace)
        SELECT * FROM outbox_intent_effects(rows, p_run_id, p_step_id, run.held,
            coalesce(run.namespace, 'default'), gates, now())
        RETURNING e.status
    )
    SELECT coalesce(bool_or(ins.status = 'pending'), false) INTO claimable FROM ins;
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

-- What the step chain covers of a step's intents (outbox_step_link): each new
-- effect's id, key, kind and payload hash, in step_index order.
CREATE OR REPLACE FUNCTION outbox_intent_link(id uuid, key text, kind text, payload_hash text)
    RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT outbox_lp(id::text) || outbox_lp(key) || outbox_lp(kind) || outbox_lp(payload_hash)
$$;

-- Whether a step's values (their text) pass the cheap checks: small enough to be
-- stored in the row, not nested near the depth limit, no run of 17 digits and
-- points (which a number needs to be too long or to miss a double), and not a
-- reference (outbox_check_json and outbox_check_not_reference check exactly).
CREATE OR REPLACE FUNCTION outbox_values_screened(result text, state text, plan text)
    RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT octet_length(result) + coalesce(octet_length(state), 0) + coalesce(octet_length(plan), 0)
           <= outbox_limit('blob_threshold_bytes')
   AND length(result || coalesce(state, '') || coalesce(plan, ''))
       - length(translate(result || coalesce(state, '') || coalesce(plan, ''), '[{', ''))
       <= (outbox_intent_rules()->>'max_json_depth')::integer
   AND (result || ' ' || coalesce(state, '') || ' ' || coalesce(plan, ''))
       !~ '[0-9.]{17}|"__outbox_blob__"'
$$;

-- Every attempt-log row is chained as it is written, with the status and result its
-- effect has then: the statement that logs an attempt changes the effect first (in
-- a CTE), and a volatile trigger sees that change. So the newest link covers where
-- the effect ended: a status or result edited by hand does not match it. The cost
-- is one rendering and sha256 of the effect's result per row logged, no statement.
CREATE OR REPLACE FUNCTION outbox_attempts_chain() RETURNS trigger
    LANGUAGE plpgsql AS $$
DECLARE
    ours boolean;
    prev bytea;
BEGIN
    -- Appends to one effect's chain take turns on the effect's row. The statement that
    -- logs an attempt has nearly always just changed that row, so holds its lock; one
    -- that did not (a stale completion) takes the lock here, reads the row again as
    -- locked, and draws a new id, so that id order stays chain order.
    SELECT e.xmin::text = (pg_current_xact_id()::text::bigint % 4294967296)::text,
           outbox_effect_genesis(e.id, e.run_id, e.kind, e.idempotency_key, e.payload_hash),
           e.status, encode(sha256(convert_to(e.result::text, 'UTF8')), 'hex')
      INTO ours, prev, NEW.effect_status, NEW.result_hash
      FROM outbox_effects e WHERE e.id = NEW.effect_id AND e.shard = NEW.shard;
    IF NOT ours THEN
        SELECT e.status, encode(sha256(convert_to(e.result::text, 'UTF8')), 'hex')
          INTO NEW.effect_status, NEW.result_hash
          FROM outbox_effects e WHERE e.id = NEW.effect_id AND e.shard = NEW.shard FOR UPDATE;
        NEW.id := nextval(pg_get_serial_sequence('outbox_effect_attempts', 'id'));
    END IF;
    -- The newest link of this effect's chain, else its genesis.
    SELECT coalesce((SELECT a.hash FROM outbox_effect_attempts a
                      WHERE a.effect_id = NEW.effect_id AND a.shard = NEW.shard
                      ORDER BY a.id DESC LIMIT 1), prev)
      INTO prev;
    NEW.hash := outbox_attempt_link(prev, NEW.effect_id, NEW.attempt, NEW.worker,
                                    NEW.started_at, NEW.finished_at, NEW.outcome, NEW.detail,
                                    NEW.effect_status, NEW.result_hash);
    RETURN NEW;
END
$$;

-- A step's v3 link (the algorithm at the top of this file): the texts are the
-- values' own (jsonb::text, NULL when not set), intents the text of the effects
-- the step created (outbox_intents_chain).
CREATE OR REPLACE FUNCTION outbox_step_link(
    prev bytea, run_id uuid, step_id text, kind text, result text, error text, state text,
    plan text, completed_at timestamptz, intents text
) RETURNS bytea
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT sha256(prev || convert_to('outbox.step.v3' || outbox_lp(run_id::text) || outbox_lp(step_id)
    || outbox_lp(kind) || outbox_lp('completed') || outbox_lp(result) || outbox_lp(error)
    || outbox_lp(state) || outbox_lp(plan) || outbox_lp(outbox_us(completed_at)) || intents,
    'UTF8'))
$$;

-- The writers of the hash chain's columns (outbox_runs.step_head, outbox_steps.hash)
-- besides outbox_write_step: a wait that ends, a signal a wait takes, a fork's
-- copied history. Each is SECURITY DEFINER (it runs as the tables' owner), so
-- `outbox roles` can leave those columns out of every role's grants: an agent
-- login cannot write a head or a link of its own making, only have one of these
-- compute it from what is recorded. The search path is pinned to the one the
-- schema was loaded with (the outbox schema, pg_catalog, then pg_temp: a
-- caller's temporary table cannot stand in for an outbox table). `outbox roles`
-- grants EXECUTE on them to the agent role only.

-- A wait step of run p_run_id (outbox.runs.waits) is over: record its result or
-- error and join it to the run's hash chain (a waiting step is not in it yet).
-- Refused: a step recorded before (OB006), a step that is not a waiting one of
-- this run (OB001).
CREATE OR REPLACE FUNCTION outbox_complete_wait(
    p_run_id uuid,
    p_step_id text,
    p_result jsonb DEFAULT NULL,
    p_error jsonb DEFAULT NULL,
    OUT step_seq bigint,
    OUT completed_at timestamptz
)
    LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    p_shard smallint := outbox_shard_of(p_run_id);
    v_now timestamptz := now();
    v_kind text;
    v_status text;
    head bytea;
BEGIN
    IF NOT has_any_column_privilege(session_user, 'outbox_steps', 'INSERT') THEN
        PERFORM outbox_raise_not_step_writer();
    END IF;
    SELECT s.kind, s.status INTO v_kind, v_status FROM outbox_steps AS s
     WHERE s.run_id = p_run_id AND s.shard = p_shard AND s.step_id = p_step_id FOR UPDATE;
    IF v_status = 'completed' THEN
        PERFORM outbox_raise_step_recorded(p_run_id, p_step_id);
    ELSIF v_status IS DISTINCT FROM 'waiting' THEN
        PERFORM outbox_refuse('OB001', 'step_id', p_step_id,
                              format('is not a waiting step of run %s', p_run_id));
    END IF;
    UPDATE outbox_runs AS r
       SET current_step = p_step_id,
           step_head = outbox_step_link(
               coalesce(r.step_head, outbox_run_genesis(r.id, r.agent, r.inputs_hash)),
               r.id, p_step_id, v_kind, outbox_resolve(p_result)::text,
               outbox_resolve(p_error)::text, NULL, NULL, v_now, '')
     WHERE r.id = p_run_id AND r.shard = p_shard
    RETURNING r.step_head INTO head;
    UPDATE outbox_steps AS s
       SET status = 'completed', result = p_result, error = p_error, completed_at = v_now,
           hash = head
     WHERE s.run_id = p_run_id AND s.shard = p_shard AND s.step_id = p_step_id
    RETURNING s.seq, s.completed_at INTO step_seq, completed_at;
END
$$;

-- The wait step p_step_id of run p_run_id takes the run's oldest unconsumed signal
-- p_name: the signal is marked consumed by that step and the step completes with
-- its payload (as stored: a large one by reference), in one call. So a signal is
-- consumed only by a wait of the run it was sent to that records it; no login can
-- mark one consumed without the run getting it. taken is false (and nothing
-- changes) when no such signal is there. Refused (OB001): a step that is not
-- this run's wait for p_name; a step recorded before (OB006).
CREATE OR REPLACE FUNCTION outbox_take_signal(
    p_run_id uuid,
    p_step_id text,
    p_name text,
    OUT taken boolean,
    OUT payload jsonb,
    OUT step_seq bigint,
    OUT completed_at timestamptz
)
    LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    p_shard smallint := outbox_shard_of(p_run_id);
    v_status text;
BEGIN
    IF NOT has_any_column_privilege(session_user, 'outbox_steps', 'INSERT') THEN
        PERFORM outbox_raise_not_step_writer();
    END IF;
    SELECT s.status INTO v_status FROM outbox_steps AS s
     WHERE s.run_id = p_run_id AND s.shard = p_shard AND s.step_id = p_step_id
       AND s.kind = 'signal' AND s.result->>'signal' = p_name FOR UPDATE;
    IF v_status = 'completed' THEN
        PERFORM outbox_raise_step_recorded(p_run_id, p_step_id);
    ELSIF v_status IS DISTINCT FROM 'waiting' THEN
        PERFORM outbox_refuse('OB001', 'step_id', p_step_id,
                              format('is not a wait of run %s for signal %L', p_run_id, p_name));
    END IF;
    UPDATE outbox_signals AS g
       SET consumed_by = p_step_id, consumed_at = now()
     WHERE g.shard = p_shard
       AND g.id = (SELECT o.id FROM outbox_signals AS o
                    WHERE o.run_id = p_run_id AND o.shard = p_shard AND o.name = p_name
                      AND o.consumed_at IS NULL
                    ORDER BY o.created_at, o.id LIMIT 1 FOR UPDATE)
    RETURNING g.payload INTO payload;
    -- (not named found: PL/pgSQL's FOUND is the same name, whatever the case)
    taken := FOUND;
    IF taken THEN
        SELECT w.step_seq, w.completed_at INTO step_seq, completed_at
          FROM outbox_complete_wait(p_run_id, p_step_id, payload, NULL) AS w;
    END IF;
END
$$;

-- Chain a fork's copied steps from the fork's own genesis and set its step_head
-- (outbox.storage.sql.control.fork_chain; a link covers the run's id, so a copied
-- step's hash cannot be copied). Only a run with no chain yet (step_head NULL)
-- and only its unlinked steps: called on any other run it changes nothing, so it
-- cannot relink a recorded history.
CREATE OR REPLACE FUNCTION outbox_chain_fork(p_original uuid, p_fork uuid) RETURNS void
    LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
    IF NOT has_any_column_privilege(session_user, 'outbox_steps', 'INSERT') THEN
        PERFORM outbox_raise_not_step_writer();
    END IF;
    WITH RECURSIVE copied AS (
        SELECT f.seq, f.step_id, f.kind, f.result, f.error, f.state, f.plan, f.completed_at,
               row_number() OVER (ORDER BY f.seq) AS n
          FROM outbox_steps AS f
          JOIN outbox_steps AS o ON o.run_id = p_original AND o.step_id = f.step_id
         WHERE f.run_id = p_fork AND f.hash IS NULL AND f.status = 'completed'
           AND o.hash IS NOT NULL
    ), chain (n, seq, head) AS (
        SELECT 0::bigint, NULL::bigint, outbox_run_genesis(r.id, r.agent, r.inputs_hash)
          FROM outbox_runs AS r WHERE r.id = p_fork AND r.step_head IS NULL
        UNION ALL
        SELECT c.n, c.seq, outbox_step_link(chain.head, p_fork, c.step_id, c.kind,
                                            outbox_resolve(c.result)::text,
                                            outbox_resolve(c.error)::text,
                                            outbox_resolve(c.state)::text,
                                            outbox_resolve(c.plan)::text, c.completed_at, '')
          FROM chain JOIN copied AS c ON c.n = chain.n + 1
    ), linked AS (
        UPDATE outbox_steps AS s SET hash = chain.head
          FROM chain WHERE s.run_id = p_fork AND s.seq = chain.seq
        RETURNING s.seq
    )
    UPDATE outbox_runs SET step_head = (SELECT head FROM chain ORDER BY n DESC LIMIT 1)
     WHERE id = p_fork AND step_head IS NULL AND EXISTS (SELECT FROM linked);
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

-- Whether a step id is refused (absent, blank, too long, a control character).
CREATE OR REPLACE FUNCTION outbox_step_id_refused(step_id text) RETURNS boolean
    LANGUAGE sql STABLE PARALLEL SAFE AS $$
SELECT step_id IS NULL OR btrim(step_id) = ''
    OR char_length(step_id) > outbox_limit('max_step_id_length')
    OR step_id ~ (outbox_intent_rules()->>'control_characters')
$$;

-- Record step_id of run_id (on its shard, outbox_shard_of(run_id)) in the caller's
-- transaction: the one implementation of a step's checkpoint, for every client
-- (the Python client calls it too; SQL callers call outbox_commit_step, below).
--
-- SECURITY DEFINER (it runs as the tables' owner, its search path pinned as in
-- chain_writes.sql): it writes the run's chain head and the step's link, which
-- `outbox roles` grants no login; only a session whose login may insert into
-- outbox_steps may call it (outbox_raise_not_step_writer).
--
-- What it writes, all of it or none: the step's result; the run's new state and
-- plan (NULL keeps them); its intents (intents: a JSON array of outbox_intend's
-- arguments) and those outbox_intend wrote for this step earlier in the
-- transaction; its budget debits (spends: a JSON array of {"reason", "amount"},
-- and outbox_spend's) and the reservations of its intents' costs, with their
-- ledger entries. The step joins its run's hash chain (outbox_step_link), which
-- covers the ids, keys, kinds and payload hashes of the intents it created.
--
-- Refused, writing nothing: a run that is missing, paused or ended (OB004,
-- OB009, OB005), a step recorded before (OB006: roll back and replay it), a
-- budget that cannot cover the step (OB007), and with lease_owner and
-- lease_attempt (a worker's fence, G4) a run leased to someone else since
-- (OB011). paused is true when a pause waits for this step: its intents are
-- held as paused with the run's others.
--
-- wake: true sends the deliverers' NOTIFY if the step wrote a claimable intent,
-- false never, NULL leaves it to outbox_wake's shared window.
--
-- The common step (small values, intents the cheap checks of outbox_intent_rows
-- clear, nothing written for it earlier in the transaction) is one statement and
-- a handful of expressions: PL/pgSQL builds each expression's state anew in every
-- transaction, so the function keeps few. Anything else is checked exactly first
-- (outbox_check_step, outbox_check_intents, outbox_store_values), then written by
-- the same statement.
CREATE OR REPLACE FUNCTION outbox_write_step(
    shard smallint,
    run_id uuid,
    step_id text,
    result jsonb DEFAULT NULL,
    state jsonb DEFAULT NULL,
    plan jsonb DEFAULT NULL,
    intents jsonb DEFAULT NULL,
    step_kind text DEFAULT 'transaction',
    spends jsonb DEFAULT NULL,
    lease_owner text DEFAULT NULL,
    lease_attempt integer DEFAULT NULL,
    wake boolean DEFAULT NULL,
    OUT step_seq bigint,
    OUT effect_ids uuid[],
    OUT paused boolean,
    OUT notify boolean
)
    LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    -- what outbox_intend and outbox_spend wrote for this step in this transaction
    tx_step jsonb;
    debit numeric := 0;
    ledger jsonb := '[]';
    chain jsonb := '[]';
    stored jsonb[];
    firsts integer[];
    existing uuid[];
    p_intents jsonb := coalesce(nullif(intents, 'null'), '[]');
    screened boolean;
    run_ok boolean;
    rows outbox_intent[];
    claimable boolean;
    v_now timestamptz := now();
BEGIN
    -- It runs as the tables' owner (the only writer of the chain's columns besides
    -- chain_writes.sql): a login that could not record a step by hand cannot
    -- through it either, whatever EXECUTE it was left.
    IF NOT has_any_column_privilege(session_user, 'outbox_steps', 'INSERT') THEN
        PERFORM outbox_raise_not_step_writer();
    END IF;
    IF outbox_write_step.shard IS DISTINCT FROM outbox_shard_of(outbox_write_step.run_id) THEN
        PERFORM outbox_refuse('OB001', 'shard', outbox_write_step.shard::text,
            format('is not the shard of run_id %s (outbox_shard_of: %s)',
                   outbox_write_step.run_id, outbox_shard_of(outbox_write_step.run_id)));
    END IF;
    IF current_setting('outbox.tx_steps', true) <> '' OR spends IS NOT NULL
       OR step_kind IS NULL OR step_kind NOT IN ('transaction', 'call')
       OR outbox_step_id_refused(outbox_write_step.step_id)
       OR (lease_owner IS NULL) <> (lease_attempt IS NULL) THEN
        tx_step := outbox_tx_steps()->outbox_tx_step_slot(outbox_write_step.run_id,
                                                          outbox_write_step.step_id);
        SELECT * INTO debit, ledger, chain
          FROM outbox_check_step(outbox_write_step.run_id, outbox_write_step.step_id, step_kind,
                                 lease_owner, lease_attempt, spends, tx_step);
    END IF;
    notify := false;
    IF outbox_distributed() THEN
        SELECT w.step_seq, w.effect_ids, w.paused, w.notify INTO step_seq, effect_ids, paused, notify
          FROM outbox_write_step_apart(outbox_write_step.shard, outbox_write_step.run_id,
            outbox_write_step.step_id, result, state, plan, p_intents, step_kind, lease_owner,
            lease_attempt, wake, tx_step, debit, ledger, chain) AS w;
        RETURN;
    END IF;
    LOOP
        -- one statement: the values and the intents derived, the run checked and
        -- moved on (a compare-and-set on its status, budget and, for a worker, its
        -- lease, with the chain's new head), the step recorded (a racer on the
        -- same step waited on the run's row and finds it recorded), the effects
        -- and the budget ledger written
        WITH v AS (
            SELECT coalesce(outbox_write_step.result, 'null')::text AS result_text,
                   outbox_write_step.state::text AS state_text,
                   outbox_write_step.plan::text AS plan_text
        ), agg AS (
            -- the gates of the step's kinds (outbox_gates_of's lookup), read here once
            -- and planned with the statement: as a call it costs about 80 us a step
            SELECT a.*, (SELECT coalesce(jsonb_agg(outbox_gate_json(g.name, g.kind,
                                   g.conditions, g.timeout_seconds, g.on_timeout, g.escalate_to)
                                   ORDER BY g.name), '[]')
                           FROM outbox_gates AS g WHERE g.kind = ANY (a.kinds)) AS gates
              FROM outbox_runs AS r, v, outbox_step_intents(outbox_write_step.run_id,
                outbox_write_step.step_id, p_intents, r.priority, r.fairness_key, r.dry_run,
                r.namespace, tx_step, firsts, existing, chain,
                stored IS NOT NULL OR outbox_values_screened(v.result_text, v.state_text,
                                                             v.plan_text)) AS a
             WHERE r.id = outbox_write_step.run_id AND r.shard = outbox_write_step.shard
        ), run_upd AS (
            UPDATE outbox_runs AS r
               SET state = coalesce(stored[2], outbox_write_step.state, r.state),
                   plan = coalesce(stored[3], outbox_write_step.plan, r.plan),
                   current_step = outbox_write_step.step_id,
                   step_count = r.step_count + 1,
                   spent = r.spent + debit,
                   reserved = r.reserved + agg.reserve,
                   step_head = outbox_step_link(
                       coalesce(r.step_head, outbox_run_genesis(r.id, r.agent, r.inputs_hash)),
                       r.id, outbox_write_step.step_id, step_kind, v.result_text, NULL,
                       v.state_text, v.plan_text, v_now, agg.chain_text)
                   -- updated_at is left alone: it is indexed, and a step's update must stay HOT
              FROM agg, v
             WHERE r.id = outbox_write_step.run_id AND r.shard = outbox_write_step.shard
               AND (agg.screened OR firsts IS NOT NULL)
               AND r.status = ANY (outbox_active_run_statuses())
               AND (r.budget IS NULL OR r.spent + r.reserved + debit + agg.reserve <= r.budget)
               AND (outbox_write_step.lease_owner IS NULL
                    OR (r.lease_owner = outbox_write_step.lease_owner
                        AND r.attempt = outbox_write_step.lease_attempt))
            RETURNING r.paused_at IS NOT NULL AS paused, r.step_head, r.step_count, r.namespace
        ), step_ins AS (
            -- the step keeps the state and plan it set, so a fork can start from it
            INSERT INTO outbox_steps AS s (run_id, shard, seq, step_id, kind, result, state, plan,
                                           hash)
            SELECT outbox_write_step.run_id, outbox_write_step.shard, u.step_count,
                   outbox_write_step.step_id, step_kind,
                   coalesce(stored[1], outbox_write_step.result, 'null'),
                   coalesce(stored[2], outbox_write_step.state),
                   coalesce(stored[3], outbox_write_step.plan), u.step_head
              FROM run_upd AS u
            ON CONFLICT ON CONSTRAINT outbox_steps_pkey DO NOTHING
            RETURNING s.seq
        ), effect_ins AS (
            INSERT INTO outbox_effects AS e (
                id, run_id, step_id, step_index, kind, payload, payload_hash, schema_version,
                idempotency_key, ordering_key, max_attempts, compensate, cost, priority,
                fairness_key, status, available_at, approval, approval_deadline, trace_parent,
                shard, namespace)
            SELECT h.*
              FROM step_ins, run_upd AS u, agg,
                   outbox_intent_effects(agg.rows, outbox_write_step.run_id,
                                         outbox_write_step.step_id, u.paused, u.namespace,
                                         agg.gates, v_now) AS h
            RETURNING e.status
        ), ledger_ins AS (
            INSERT INTO outbox_budget_ledger (run_id, shard, step_id, effect_id, reason, entry,
                                              amount)
            SELECT outbox_write_step.run_id, outbox_write_step.shard, outbox_write_step.step_id,
                   l.effect_id, l.reason, l.entry, l.amount
              FROM (SELECT * FROM jsonb_to_recordset(ledger)
                           AS l(entry text, reason text, amount numeric, effect_id uuid)
                    UNION ALL
                    SELECT 'reserve', i.kind, i.cost, i.id FROM agg, unnest(agg.rows) AS i
                     WHERE i.cost IS NOT NULL AND i.existing IS NULL AND i.first_n IS NULL) AS l
             CROSS JOIN step_ins
        )
        SELECT s.seq, agg.ids, u.paused, agg.screened, u.paused IS NOT NULL AS run_ok, agg.rows,
               (SELECT bool_or(e.status = 'pending') FROM effect_ins AS e) AS claimable
          INTO step_seq, effect_ids, paused, screened, run_ok, rows, claimable
          FROM v LEFT JOIN agg ON true LEFT JOIN run_upd AS u ON true
               LEFT JOIN step_ins AS s ON true;
        EXIT WHEN screened OR firsts IS NOT NULL;
        -- something the cheap checks did not clear: check it exactly (raising the
        -- refusal, taking the locks of callers' keys; a large value stored by
        -- reference), then write it
        stored := outbox_store_values(outbox_write_step.run_id, ARRAY['result', 'state', 'plan'],
                                      ARRAY[coalesce(result, 'null'), state, plan]);
        SELECT c.firsts, c.intents, c.existing INTO firsts, p_intents, existing
          FROM outbox_runs AS r, outbox_check_intents(outbox_write_step.run_id,
            outbox_write_step.step_id, p_intents, coalesce((tx_step->>'next')::integer, 0),
            coalesce((tx_step->>'count')::integer, 0), coalesce((tx_step->>'bytes')::bigint, 0),
            r.dry_run, true, r.namespace) AS c
         WHERE r.id = outbox_write_step.run_id AND r.shard = outbox_write_step.shard;
        IF NOT FOUND THEN
            -- no run to check the intents against: the statement above says why
            firsts := '{}';
        END IF;
    END LOOP;
    IF step_seq IS NULL OR firsts IS NOT NULL OR tx_step IS NOT NULL
       OR (claimable AND NOT paused AND wake IS DISTINCT FROM false) THEN
        PERFORM outbox_finish_step(outbox_write_step.run_id, outbox_write_step.step_id,
            lease_owner, lease_attempt, run_ok, step_seq, debit, rows, tx_step, paused,
            claimable AND NOT paused, wake);
        IF firsts IS NOT NULL OR tx_step IS NOT NULL THEN
            effect_ids := coalesce(array(SELECT jsonb_array_elements_text(tx_step->'ids')::uuid),
                                   '{}')
                          || CASE WHEN firsts IS NULL THEN effect_ids
                                  ELSE outbox_intent_ids(rows) END;
        END IF;
    END IF;
END
$$;

-- outbox_write_step on the run's own shard: what SQL callers call. (On Citus the
-- planner inlines it, and the call runs on the node holding the shard.)
CREATE OR REPLACE FUNCTION outbox_commit_step(
    run_id uuid,
    step_id text,
    result jsonb DEFAULT NULL,
    state jsonb DEFAULT NULL,
    plan jsonb DEFAULT NULL,
    intents jsonb DEFAULT NULL,
    step_kind text DEFAULT 'transaction',
    spends jsonb DEFAULT NULL,
    lease_owner text DEFAULT NULL,
    lease_attempt integer DEFAULT NULL,
    wake boolean DEFAULT NULL,
    OUT step_seq bigint,
    OUT effect_ids uuid[],
    OUT paused boolean
)
    LANGUAGE sql AS $$
SELECT w.step_seq, w.effect_ids, w.paused
  FROM outbox_write_step(outbox_shard_of(run_id), run_id, step_id, result, state, plan, intents,
                         step_kind, spends, lease_owner, lease_attempt, wake) AS w
$$;

-- outbox_write_step on Citus, where it runs on the node holding the run's shard:
-- the same step in a statement each (Citus plans a statement that writes through
-- common table expressions over several shards' worth of tasks), every value it
-- sets computed first. The deliverers' NOTIFY there would wake only that node's
-- listeners: notify asks the caller to send it from the coordinator instead.
CREATE OR REPLACE FUNCTION outbox_write_step_apart(
    p_shard smallint, p_run_id uuid, p_step_id text, p_result jsonb, p_state jsonb,
    p_plan jsonb, p_intents jsonb, p_kind text, p_owner text, p_attempt integer,
    p_wake boolean, p_tx_step jsonb, p_debit numeric, p_ledger jsonb, p_chain jsonb,
    OUT step_seq bigint, OUT effect_ids uuid[], OUT paused boolean, OUT notify boolean
)
    LANGUAGE plpgsql AS $$
DECLARE
    run outbox_runs;
    v_now timestamptz := now();
    result_text text := coalesce(p_result, 'null')::text;
    state_text text := p_state::text;
    plan_text text := p_plan::text;
    stored jsonb[];
    firsts integer[];
    existing uuid[];
    a record;
    head bytea;
    inserted bigint;
    gates jsonb;
BEGIN
    SELECT r.* INTO run FROM outbox_runs AS r
     WHERE r.id = p_run_id AND r.shard = p_shard FOR NO KEY UPDATE;
    LOOP
        SELECT x.* INTO a FROM outbox_step_intents(p_run_id, p_step_id, p_intents, run.priority,
            run.fairness_key, run.dry_run, run.namespace, p_tx_step, firsts, existing, p_chain,
            stored IS NOT NULL OR outbox_values_screened(result_text, state_text, plan_text)) AS x;
        EXIT WHEN a.screened OR firsts IS NOT NULL OR run.id IS NULL;
        stored := outbox_store_values(p_run_id, ARRAY['result', 'state', 'plan'],
                                      ARRAY[coalesce(p_result, 'null'), p_state, p_plan]);
        SELECT c.firsts, c.intents, c.existing INTO firsts, p_intents, existing
          FROM outbox_check_intents(p_run_id, p_step_id, p_intents,
            coalesce((p_tx_step->>'next')::integer, 0), coalesce((p_tx_step->>'count')::integer, 0),
            coalesce((p_tx_step->>'bytes')::bigint, 0), run.dry_run, true, run.namespace) AS c;
    END LOOP;
    IF run.id IS NULL OR NOT run.status = ANY (outbox_active_run_statuses())
       OR (run.budget IS NOT NULL AND run.spent + run.reserved + p_debit + a.reserve > run.budget)
       OR (p_owner IS NOT NULL AND (run.lease_owner IS DISTINCT FROM p_owner
                                    OR run.attempt <> p_attempt)) THEN
        PERFORM outbox_raise_step_refusal(p_run_id, p_owner, p_attempt, p_debit + a.reserve);
    END IF;
    paused := run.paused_at IS NOT NULL;
    head := outbox_step_link(coalesce(run.step_head, outbox_run_genesis(run.id, run.agent,
                                                                        run.inputs_hash)),
        run.id, p_step_id, p_kind, result_text, NULL, state_text, plan_text, v_now, a.chain_text);
    UPDATE outbox_runs AS r
       SET state = coalesce(stored[2], p_state, run.state),
           plan = coalesce(stored[3], p_plan, run.plan),
           current_step = p_step_id,
           step_count = run.step_count + 1,
           spent = run.spent + p_debit,
           reserved = run.reserved + a.reserve,
           step_head = head
     WHERE r.id = p_run_id AND r.shard = p_shard;
    step_seq := run.step_count + 1;
    INSERT INTO outbox_steps AS s (run_id, shard, seq, step_id, kind, result, state, plan, hash)
    VALUES (p_run_id, p_shard, step_seq, p_step_id, p_kind, coalesce(stored[1], p_result, 'null'),
            coalesce(stored[2], p_state), coalesce(stored[3], p_plan), head)
    ON CONFLICT ON CONSTRAINT outbox_steps_pkey DO NOTHING
    RETURNING s.seq INTO inserted;
    IF inserted IS NULL THEN
        PERFORM outbox_raise_step_recorded(p_run_id, p_step_id);
    END IF;
    gates := outbox_gates_of(a.kinds);  -- once (as an argument it would run once per use)
    INSERT INTO outbox_effects AS e (
        id, run_id, step_id, step_index, kind, payload, payload_hash, schema_version,
        idempotency_key, ordering_key, max_attempts, compensate, cost, priority, fairness_key,
        status, available_at, approval, approval_deadline, trace_parent, shard, namespace)
    SELECT h.* FROM outbox_intent_effects(a.rows, p_run_id, p_step_id, paused, run.namespace,
                                          gates, v_now) AS h;
    INSERT INTO outbox_budget_ledger (run_id, shard, step_id, effect_id, reason, entry, amount)
    SELECT p_run_id, p_shard, p_step_id, l.effect_id, l.reason, l.entry, l.amount
      FROM (SELECT * FROM jsonb_to_recordset(p_ledger)
                   AS l(entry text, reason text, amount numeric, effect_id uuid)
            UNION ALL
            SELECT 'reserve', i.kind, i.cost, i.id FROM unnest(a.rows) AS i
             WHERE i.cost IS NOT NULL AND i.existing IS NULL AND i.first_n IS NULL) AS l;
    -- (an intent a gate holds makes this true too: a NOTIFY for nothing, never one missed)
    notify := NOT paused AND p_wake IS DISTINCT FROM false
              AND (EXISTS (SELECT 1 FROM unnest(a.rows) AS i
                            WHERE i.existing IS NULL AND i.first_n IS NULL)
                   OR coalesce((p_tx_step->>'claimable')::boolean, false));
    effect_ids := a.ids;
    IF firsts IS NOT NULL OR p_tx_step IS NOT NULL THEN
        PERFORM outbox_finish_step(p_run_id, p_step_id, p_owner, p_attempt, true, step_seq,
            p_debit, a.rows, p_tx_step, paused, false, false);
        effect_ids := coalesce(array(SELECT jsonb_array_elements_text(p_tx_step->'ids')::uuid),
                               '{}')
                      || CASE WHEN firsts IS NULL THEN a.ids ELSE outbox_intent_ids(a.rows) END;
    END IF;
END
$$;

-- What a step's intents (p_intents, outbox_intent_rows' argument, for step p_step_id
-- of run p_run_id, in its lane, mode and namespace) come to: their rows; whether
-- they and the step's values (p_values_screened) pass the cheap checks and the
-- step's caps with what the transaction wrote for it before (p_tx_step); the
-- budget they reserve; the intents' part of the step's link (with the parts of
-- p_chain, outbox_intend's); the effect id of each (the one its key named, if
-- any); and their kinds. Both compositions of the step write use it: one
-- statement on one server, a statement each on Citus (outbox_write_step_apart).
CREATE OR REPLACE FUNCTION outbox_step_intents(
    p_run_id uuid, p_step_id text, p_intents jsonb, p_priority integer, p_fairness_key text,
    p_dry_run boolean, p_namespace text, p_tx_step jsonb, p_firsts integer[],
    p_existing uuid[], p_chain jsonb, p_values_screened boolean
) RETURNS TABLE (
    rows outbox_intent[], screened boolean, reserve numeric, chain_text text, ids uuid[],
    kinds text[]
)
    LANGUAGE sql STABLE AS $$
WITH i AS MATERIALIZED (
    SELECT x.* FROM outbox_intent_rows(p_run_id, p_step_id, p_intents,
        coalesce((p_tx_step->>'next')::integer, 0), p_priority, p_fairness_key, p_dry_run,
        p_firsts, p_namespace, p_existing) AS x
)
SELECT coalesce(array_agg(i::outbox_intent ORDER BY i.n) FILTER (WHERE i.id IS NOT NULL), '{}'),
       coalesce(bool_and(i.screened), true) AND p_values_screened
       AND count(i.id) + coalesce((p_tx_step->>'count')::integer, 0)
           <= outbox_limit('max_step_intents')
       AND coalesce(sum(i.payload_size), 0) + coalesce((p_tx_step->>'bytes')::bigint, 0)
           <= outbox_limit('max_step_bytes'),
       coalesce(sum(i.cost) FILTER (WHERE i.existing IS NULL AND i.first_n IS NULL), 0)
           + coalesce((p_tx_step->>'reserve')::numeric, 0),
       CASE WHEN p_chain = '[]' THEN coalesce(string_agg(outbox_intent_link(i.id,
                i.idempotency_key, i.kind, i.payload_hash), '' ORDER BY i.step_index, i.id)
                FILTER (WHERE i.id IS NOT NULL AND i.existing IS NULL AND i.first_n IS NULL), '')
            -- with outbox_intend's intents of this step: all of them in order
            ELSE outbox_intents_chain(p_chain || coalesce(jsonb_agg(jsonb_build_array(
                i.step_index, i.id, outbox_intent_link(i.id, i.idempotency_key, i.kind,
                                                       i.payload_hash)))
                FILTER (WHERE i.id IS NOT NULL AND i.existing IS NULL AND i.first_n IS NULL),
                '[]')) END,
       coalesce(array_agg(coalesce(i.existing, i.id) ORDER BY i.n) FILTER (WHERE i.id IS NOT NULL),
                '{}'),
       coalesce(array_agg(DISTINCT i.kind) FILTER (WHERE i.kind IS NOT NULL), '{}')
  FROM (SELECT 1) AS one LEFT JOIN i ON true
$$;

-- The rest of a step that is not the common one: its refusal (the run missing,
-- paused, ended, leased to someone else or over budget; the step recorded
-- before), the intents outbox_intend wrote for it held when a pause committed
-- meanwhile, the transaction's note that the step is done, and the wake-up.
CREATE OR REPLACE FUNCTION outbox_finish_step(
    p_run_id uuid, p_step_id text, p_owner text, p_attempt integer, p_run_ok boolean,
    p_seq bigint, p_debit numeric, p_rows outbox_intent[], p_tx_step jsonb, p_paused boolean,
    p_claimable boolean, p_wake boolean
) RETURNS void
    LANGUAGE plpgsql AS $$
BEGIN
    IF NOT p_run_ok THEN
        PERFORM outbox_raise_step_refusal(p_run_id, p_owner, p_attempt,
            p_debit + coalesce((SELECT sum(r.cost) FROM unnest(p_rows) AS r
                                 WHERE r.existing IS NULL AND r.first_n IS NULL), 0)
            + coalesce((p_tx_step->>'reserve')::numeric, 0));
    END IF;
    IF p_seq IS NULL THEN
        PERFORM outbox_raise_step_recorded(p_run_id, p_step_id);
    END IF;
    IF p_tx_step IS NOT NULL THEN
        IF p_paused THEN
            -- a pause committed while outbox_intend's intents waited holds them now
            UPDATE outbox_effects AS e SET status = 'paused'
             WHERE e.run_id = p_run_id AND e.shard = outbox_shard_of(p_run_id)
               AND e.step_id = p_step_id AND e.status = 'pending';
        END IF;
        PERFORM outbox_tx_save_step(p_run_id, p_step_id, p_tx_step || '{"done": true}'::jsonb);
    END IF;
    IF (p_claimable OR (p_tx_step->>'claimable')::boolean AND NOT p_paused)
       AND p_wake IS DISTINCT FROM false THEN
        IF p_wake THEN
            PERFORM pg_notify('outbox_effects', '');
        ELSE
            PERFORM outbox_wake('outbox_effects');
        END IF;
    END IF;
END
$$;

-- The exact checks of a step's own arguments (outbox_commit_step calls it when its
-- cheap ones do not clear them), and what the transaction wrote for the step
-- before (outbox_intend, outbox_spend: tx_step) with spends added: the debit, the
-- ledger entries and the chain parts so far.
CREATE OR REPLACE FUNCTION outbox_check_step(
    p_run_id uuid, p_step_id text, p_kind text, p_owner text, p_attempt integer,
    p_spends jsonb, p_tx_step jsonb, OUT debit numeric, OUT ledger jsonb, OUT chain jsonb
)
    LANGUAGE plpgsql AS $$
DECLARE
    spend jsonb;
BEGIN
    IF p_kind IS NULL OR p_kind NOT IN ('transaction', 'call') THEN
        PERFORM outbox_refuse('OB001', 'step_kind', p_kind, 'must be transaction or call');
    END IF;
    PERFORM outbox_check_text('step_id', p_step_id, outbox_limit('max_step_id_length')::integer,
                              true, true);
    IF (p_owner IS NULL) <> (p_attempt IS NULL) THEN
        PERFORM outbox_refuse('OB001', 'lease_attempt', p_attempt::text,
            'lease_owner and lease_attempt go together');
    END IF;
    debit := coalesce((p_tx_step->>'debit')::numeric, 0);
    ledger := coalesce(p_tx_step->'ledger', '[]');
    chain := coalesce(p_tx_step->'chain', '[]');
    IF (p_tx_step->>'done')::boolean THEN
        PERFORM outbox_refuse('OB001', 'step_id', p_step_id,
            'outbox_commit_step already recorded this step in this transaction');
    END IF;
    IF p_spends IS NOT NULL AND p_spends <> 'null' THEN
        IF jsonb_typeof(p_spends) <> 'array' THEN
            PERFORM outbox_refuse('OB001', 'spends', left(p_spends::text, 80),
                'must be a JSON array of {"reason": ..., "amount": ...}');
        END IF;
        FOR spend IN SELECT value FROM jsonb_array_elements(p_spends) LOOP
            spend := outbox_spend_entry(ledger, spend);
            ledger := ledger || jsonb_build_array(spend);
            debit := debit + (spend->>'amount')::numeric;
        END LOOP;
    END IF;
END
$$;

-- Values of a run (result, state, plan, ...: names and values in order) checked
-- exactly and returned as a row stores them: a large one as a reference to it,
-- stored once (outbox_store_value), owned by the run.
CREATE OR REPLACE FUNCTION outbox_store_values(p_run_id uuid, p_names text[], p_values jsonb[])
    RETURNS jsonb[]
    LANGUAGE plpgsql AS $$
DECLARE
    stored jsonb[] := '{}';
    rendered text;
BEGIN
    FOR k IN 1 .. cardinality(p_values) LOOP
        IF p_values[k] IS NULL THEN
            stored := stored || NULL::jsonb;
            CONTINUE;
        END IF;
        PERFORM outbox_check_not_reference(p_names[k], p_values[k]);
        rendered := outbox_check_json(p_names[k], p_values[k], outbox_limit('max_payload_bytes'));
        stored := stored || CASE WHEN octet_length(rendered) > outbox_limit('blob_threshold_bytes')
                                 THEN outbox_store_value(p_run_id, p_values[k], rendered)
                                 ELSE p_values[k] END;
    END LOOP;
    RETURN stored;
END
$$;

-- Why a step was refused (it wrote nothing): the run is missing, paused or ended,
-- leased to someone else since (OB011), or over its budget (OB007).
CREATE OR REPLACE FUNCTION outbox_raise_step_refusal(
    p_run_id uuid, p_owner text, p_attempt integer, p_needs numeric
) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    found_run record;
BEGIN
    SELECT r.status, r.budget, r.spent, r.reserved, r.lease_owner, r.attempt
      INTO found_run FROM outbox_runs AS r
     WHERE r.id = p_run_id AND r.shard = outbox_shard_of(p_run_id);
    IF NOT FOUND OR NOT found_run.status = ANY (outbox_active_run_statuses()) THEN
        PERFORM outbox_raise_run_refusal(p_run_id);
    ELSIF p_owner IS NOT NULL AND (found_run.lease_owner IS DISTINCT FROM p_owner
                                   OR found_run.attempt <> p_attempt) THEN
        PERFORM outbox_raise('OB011',
            format('run_id=%L: lease attempt %s of %L was taken over (now attempt %s of %L)',
                   p_run_id, p_attempt, p_owner, found_run.attempt, found_run.lease_owner),
            jsonb_build_object('run_id', p_run_id, 'attempt', p_attempt, 'owner', p_owner,
                               'current_attempt', found_run.attempt,
                               'current_owner', found_run.lease_owner));
    ELSE
        PERFORM outbox_raise('OB007',
            format('run_id=%L: step needs %s but only %s remains', p_run_id, p_needs,
                   found_run.budget - found_run.spent - found_run.reserved),
            jsonb_build_object('run_id', p_run_id, 'requested', p_needs,
                'remaining', found_run.budget - found_run.spent - found_run.reserved));
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION outbox_effects_settle_cost() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status = 'succeeded' THEN
        UPDATE outbox_runs
           SET reserved = reserved - NEW.cost, spent = spent + NEW.cost
         WHERE id = NEW.run_id AND shard = NEW.shard;
        INSERT INTO outbox_budget_ledger (run_id, shard, step_id, effect_id, reason, entry, amount)
        VALUES (NEW.run_id, NEW.shard, NEW.step_id, NEW.id, NEW.kind, 'commit', NEW.cost);
    ELSIF NEW.status IN ('failed', 'cancelled', 'rejected') THEN
        UPDATE outbox_runs SET reserved = reserved - NEW.cost
         WHERE id = NEW.run_id AND shard = NEW.shard;
        INSERT INTO outbox_budget_ledger (run_id, shard, step_id, effect_id, reason, entry, amount)
        VALUES (NEW.run_id, NEW.shard, NEW.step_id, NEW.id, NEW.kind, 'release', NEW.cost);
    ELSIF OLD.status IN ('failed', 'cancelled', 'rejected') THEN
        -- an operator put it back: it holds its reservation again
        UPDATE outbox_runs SET reserved = reserved + NEW.cost
         WHERE id = NEW.run_id AND shard = NEW.shard;
        INSERT INTO outbox_budget_ledger (run_id, shard, step_id, effect_id, reason, entry, amount)
        VALUES (NEW.run_id, NEW.shard, NEW.step_id, NEW.id, NEW.kind, 'reserve', NEW.cost);
    END IF;
    RETURN NULL;
END
$$;

-- Every way back to pending (a retry, the reconciler, an operator) holds the
-- effect of a paused run as paused; commit_step decides it for new intents. And
-- an effect held for approval leaves it only by an approval (a session with
-- EXECUTE on outbox_may_release: the operator's, under `outbox roles`), a
-- rejection or a cancellation, never by a deliverer's hand-written UPDATE. One
-- trigger for both, so the claims and completions pay for one WHEN clause.
CREATE OR REPLACE FUNCTION outbox_effects_hold_paused() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.status = 'awaiting_approval'
       AND NEW.status NOT IN ('awaiting_approval', 'rejected', 'cancelled')
       AND NOT has_function_privilege('outbox_may_release()', 'EXECUTE') THEN
        RAISE EXCEPTION 'permission denied: effect % is held for approval; only an approval '
            'releases it (a role with EXECUTE on outbox_may_release())', OLD.id
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    IF NEW.status = 'pending' AND NEW.run_id IS NOT NULL AND EXISTS (
        SELECT 1 FROM outbox_runs
         WHERE id = NEW.run_id AND shard = NEW.shard AND paused_at IS NOT NULL) THEN
        NEW.status := 'paused';
    END IF;
    RETURN NEW;
END
$$;

-- End run_id as completed (with an optional JSON result) or failed (with a JSON
-- error): the one implementation, for every client. Only an active run ends
-- (OB004, OB005, OB009 otherwise); with lease_owner and lease_attempt (a worker's
-- fence, G4) only while the run is still leased to it (OB011).
CREATE OR REPLACE FUNCTION outbox_finish_run(
    run_id uuid,
    status text,
    result jsonb DEFAULT NULL,
    error jsonb DEFAULT NULL,
    lease_owner text DEFAULT NULL,
    lease_attempt integer DEFAULT NULL
) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    p_run_id uuid := outbox_finish_run.run_id;
    max_bytes bigint := outbox_limit('max_payload_bytes');
    threshold bigint := outbox_limit('blob_threshold_bytes');
    rendered text;
    stored_result jsonb;
    stored_error jsonb;
BEGIN
    IF status IS NULL OR status NOT IN ('completed', 'failed') THEN
        PERFORM outbox_refuse('OB001', 'status', status, 'must be completed or failed');
    END IF;
    IF (lease_owner IS NULL) <> (lease_attempt IS NULL) THEN
        PERFORM outbox_refuse('OB001', 'lease_attempt', lease_attempt::text,
            'lease_owner and lease_attempt go together');
    END IF;
    IF result IS NOT NULL THEN
        PERFORM outbox_check_not_reference('result', result);
        rendered := outbox_check_json('result', result, max_bytes);
        stored_result := CASE WHEN octet_length(rendered) > threshold
                              THEN outbox_store_value(p_run_id, result, rendered) ELSE result END;
    END IF;
    IF error IS NOT NULL THEN
        PERFORM outbox_check_not_reference('error', error);
        rendered := outbox_check_json('error', error, max_bytes);
        stored_error := CASE WHEN octet_length(rendered) > threshold
                             THEN outbox_store_value(p_run_id, error, rendered) ELSE error END;
    END IF;
    UPDATE outbox_runs AS r
       SET status = outbox_finish_run.status, result = stored_result,
           error = stored_error, lease_owner = NULL, lease_expires_at = NULL,
           updated_at = now()
     WHERE r.id = p_run_id AND r.shard = outbox_shard_of(p_run_id)
       AND r.status = ANY (outbox_active_run_statuses())
       AND (outbox_finish_run.lease_owner IS NULL
            OR (r.lease_owner = outbox_finish_run.lease_owner AND r.attempt = outbox_finish_run.lease_attempt));
    IF NOT FOUND THEN
        PERFORM outbox_raise_step_refusal(p_run_id, lease_owner, lease_attempt, 0);
    END IF;
END
$$;

-- A value's JSON type with its article, for the reasons outbox_gate_verdict gives.
CREATE OR REPLACE FUNCTION outbox_gate_a(type text) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT CASE WHEN type IN ('array', 'object') THEN 'an ' || type
            WHEN type = 'null' THEN 'null' ELSE 'a ' || type END
$$;

-- One condition of a gate (outbox.gates.Condition) on a payload: NULL when it
-- does not hold, '' when it holds, or, when the value is of a type the condition
-- cannot judge (a list where gt wants a number, a number where eq names a
-- string), why: the gate then holds the intent and records the reason. An agent
-- that quotes a number or wraps it in a list must meet the gate, not pass it
-- (fail closed). A string that reads as a JSON number (at most 100 characters,
-- so the cast cannot overflow) compares as that number wherever a number is
-- wanted; `type` is the strict form, which takes no such string for a number.
CREATE OR REPLACE FUNCTION outbox_gate_verdict(cond jsonb, payload jsonb) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT CASE
    WHEN v IS NULL THEN NULL
    WHEN op = 'exists' THEN ''
    WHEN op = 'type' THEN CASE WHEN t = cond->>'value' THEN '' ELSE
        format('%s is %s, not %s', ptr, outbox_gate_a(t), outbox_gate_a(cond->>'value')) END
    WHEN op IN ('gt', 'ge', 'lt', 'le') THEN CASE
        WHEN n IS NULL THEN format('%s is %s, not a number (%s %s)', ptr, outbox_gate_a(t), op,
                                   cond->'value')
        WHEN CASE op WHEN 'gt' THEN n > (cond->'value')::numeric
                     WHEN 'ge' THEN n >= (cond->'value')::numeric
                     WHEN 'lt' THEN n < (cond->'value')::numeric
                     ELSE n <= (cond->'value')::numeric END THEN '' END
    ELSE (
        -- eq, ne, in: the values named, the value met equals one of them (a numeric
        -- string equals the number it reads as), and whether its type is one they
        -- can be compared with (any, when one of them is null)
        SELECT CASE
            WHEN NOT bool_or(jsonb_typeof(x) IN (t, 'null')
                             OR (jsonb_typeof(x) = 'number' AND n IS NOT NULL)) THEN
                format('%s is %s, not %s (%s %s)', ptr, outbox_gate_a(t),
                       string_agg(DISTINCT outbox_gate_a(jsonb_typeof(x)), ' or '), op,
                       cond->'value')
            WHEN bool_or(CASE WHEN jsonb_typeof(x) = 'number' AND n IS NOT NULL
                              THEN n = x::numeric ELSE x = v END) = (op <> 'ne') THEN ''
        END
          FROM jsonb_array_elements(CASE op WHEN 'in' THEN cond->'value'
                                            ELSE jsonb_build_array(cond->'value') END) AS x)
END
FROM (SELECT payload #> ARRAY(SELECT jsonb_array_elements_text(cond->'path')),
             cond->>'op', coalesce(nullif(cond->>'pointer', ''), 'the payload')) AS p(v, op, ptr)
CROSS JOIN LATERAL (
    SELECT jsonb_typeof(v),
           CASE jsonb_typeof(v) WHEN 'number' THEN v::numeric
                WHEN 'string' THEN CASE WHEN length(v #>> '{}') <= 100
                    AND (v #>> '{}') ~ '^-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]{1,4})?$'
                    THEN (v #>> '{}')::numeric END END) AS q(t, n)
$$;

-- A gate's conditions on a payload: NULL when one does not hold, else the
-- approval's extra fields: none ('{}'; no condition: every intent of the kind),
-- or the reasons of those that could not be judged, which hold the intent
-- whatever the others say (outbox_gate_verdict).
CREATE OR REPLACE FUNCTION outbox_gate_match(conditions jsonb, payload jsonb) RETURNS jsonb
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT CASE
    WHEN bool_or(r <> '') THEN
        jsonb_build_object('reason', string_agg(r, '; ') FILTER (WHERE r <> ''))
    WHEN coalesce(bool_and(r IS NOT NULL), true) THEN '{}'
END
FROM (SELECT outbox_gate_verdict(c, payload) FROM jsonb_array_elements(conditions) AS c) AS v(r)
$$;

-- The default idempotency key of the step_index-th intent of step_id in run_id
-- (outbox.keys.derive_key).
-- (outbox_key_digest of the three, spelled out: it runs for every intent.)
CREATE OR REPLACE FUNCTION outbox_derive_key(run_id uuid, step_id text, step_index integer) RETURNS text
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
SELECT encode(sha256('\x0000000000000024'::bytea || convert_to(run_id::text, 'UTF8')
    || int8send(octet_length(convert_to(step_id, 'UTF8'))::bigint) || convert_to(step_id, 'UTF8')
    || int8send(octet_length(step_index::text)::bigint) || convert_to(step_index::text, 'UTF8')),
    'hex')
$$;

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

-- The effect ids of rows (outbox_intent_rows), in order: each the effect written,
-- or the one its key named already.
CREATE OR REPLACE FUNCTION outbox_intent_ids(p_rows outbox_intent[]) RETURNS uuid[]
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT coalesce(array_agg(coalesce(r.existing, f.id, r.id) ORDER BY r.n), '{}')
  FROM unnest(p_rows) AS r LEFT JOIN unnest(p_rows) AS f ON f.n = r.first_n
$$;

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
-- key, so that one key's effects live together.
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
    SELECT (a.item->'payload')::text AS text,
           outbox_json_int(a.item->'step_index') AS step_index,
           outbox_json_str(a.item->'key') AS key) AS f
 CROSS JOIN LATERAL (
    SELECT coalesce(outbox_json_uuid(a.item->'id'),
                    CASE WHEN p_run_id IS NULL
                         THEN outbox_on_shard(outbox_uuid7(), outbox_key_shard(p_namespace,
                             coalesce(f.key, outbox_json_str(a.item->'ordering_key'),
                                      gen_random_uuid()::text)))
                         ELSE outbox_uuid7() END) AS id,
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
CREATE OR REPLACE FUNCTION outbox_check_intents(
    p_run_id uuid, p_step_id text, p_intents jsonb, p_next integer, p_count integer,
    p_bytes bigint, p_dry_run boolean, p_indexed boolean, p_namespace text,
    OUT firsts integer[], OUT intents jsonb, OUT existing uuid[]
)
    LANGUAGE plpgsql AS $$
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
         ORDER BY g.name LIMIT 1), r.approval) AS policy) AS h
 WHERE r.existing IS NULL AND r.first_n IS NULL
$$;

-- The gates configured for kinds (outbox_gates; on Citus a reference table, read
-- where the write runs), as outbox_intent_effects takes them: none, nearly always.
CREATE OR REPLACE FUNCTION outbox_gates_of(kinds text[]) RETURNS jsonb
    LANGUAGE plpgsql STABLE AS $$
BEGIN
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

-- Intend the compensations of a stopping run's succeeded effects (originals),
-- each as its original declared it, keyed from the original's key; one at a time,
-- newest original first (their ordering key). An original compensated already is
-- skipped. Returns how many were new.
CREATE OR REPLACE FUNCTION outbox_intend_compensations(p_run_id uuid, p_originals uuid[])
    RETURNS integer
    LANGUAGE plpgsql AS $$
DECLARE
    inserted integer;
BEGIN
    WITH o AS (
        SELECT x.*, k.n, (x.compensate->'payload')::text AS text
          FROM unnest(p_originals) WITH ORDINALITY AS k(id, n)
          JOIN outbox_effects AS x ON x.id = k.id AND x.run_id = p_run_id
                                  AND x.shard = outbox_shard_of(p_run_id)
         WHERE x.compensate IS NOT NULL
    ), ins AS (
        INSERT INTO outbox_effects AS e (
            id, run_id, step_id, step_index, kind, payload, payload_hash, schema_version,
            idempotency_key, ordering_key, compensates, priority, fairness_key, status, shard,
            namespace)
        SELECT outbox_uuid7(), p_run_id, 'compensate', o.n - 1, o.compensate->>'kind',
               o.compensate->'payload', encode(sha256(convert_to(o.text, 'UTF8')), 'hex'), 1,
               outbox_compensation_key(o.idempotency_key),
               -- one at a time, newest original first
               'compensate:' || p_run_id::text, o.id, o.priority, o.fairness_key, 'pending',
               o.shard, o.namespace
          FROM o ORDER BY o.n
        ON CONFLICT ON CONSTRAINT outbox_effects_idempotency_key DO NOTHING
        RETURNING e.id
    )
    SELECT count(*) INTO inserted FROM ins;
    IF inserted > 0 THEN
        PERFORM pg_notify('outbox_effects', '');
    END IF;
    RETURN inserted;
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
      LEFT JOIN outbox_intent_rows(outbox_take_keys.run_id, NULL, intents, 0, 0, '', run.dry_run,
                                   NULL, run.namespace) AS x ON x.n = a.n;
    FOR r IN SELECT * FROM outbox_intent_rows(outbox_take_keys.run_id, NULL, named, 0, 0, '',
                                              run.dry_run, NULL, run.namespace) LOOP
        IF (named->(r.n - 1))->'key' NOT IN ('null') AND r.kind IS NOT NULL THEN
            PERFORM outbox_take_key(run.namespace, r.idempotency_key, r.id,
                                    outbox_take_keys.run_id, r.kind, r.payload_hash,
                                    (named->(r.n - 1))->'payload');
        END IF;
    END LOOP;
    RETURN named;
END
$$;

-- A recorded step (what a replay returns): one row, or none when not recorded.
CREATE OR REPLACE FUNCTION outbox_step(run_id uuid, step_id text)
    RETURNS TABLE (step_kind text, status text, result jsonb, error jsonb, seq bigint,
                   completed_at timestamptz)
    LANGUAGE sql STABLE AS $$
SELECT s.kind, s.status, outbox_resolve(s.result, s.shard), outbox_resolve(s.error, s.shard), s.seq,
       s.completed_at
  FROM outbox_steps AS s
 WHERE s.run_id = outbox_step.run_id AND s.step_id = outbox_step.step_id
   AND s.shard = outbox_shard_of(outbox_step.run_id)
$$;

-- A run as stored: one row, or none when no run has this id.
CREATE OR REPLACE FUNCTION outbox_run_status(run_id uuid)
    RETURNS TABLE (id uuid, agent text, agent_version text, status text, inputs jsonb, state jsonb,
                   plan jsonb, current_step text, result jsonb, error jsonb, budget numeric,
                   spent numeric, reserved numeric, created_at timestamptz, updated_at timestamptz)
    LANGUAGE sql STABLE AS $$
SELECT r.id, r.agent, r.agent_version, r.status, outbox_resolve(r.inputs, r.shard),
       outbox_resolve(r.state, r.shard), outbox_resolve(r.plan, r.shard), r.current_step,
       outbox_resolve(r.result, r.shard), outbox_resolve(r.error, r.shard), r.budget, r.spent,
       r.reserved, r.created_at, r.updated_at
  FROM outbox_runs AS r
 WHERE r.id = outbox_run_status.run_id AND r.shard = outbox_shard_of(outbox_run_status.run_id)
$$;

-- Statuses in which a run takes steps and intents (models.ACTIVE_RUN_STATUSES):
-- the live ones but paused (a paused run still takes signals).
-- (A constant, not read from outbox_intent_rules(): it is inlined into every step.)
CREATE OR REPLACE FUNCTION outbox_active_run_statuses() RETURNS text[]
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT '{runnable,running,waiting}'::text[]
$$;

-- Statuses in which a run accepts steps, signals and intents (models.LIVE_RUN_STATUSES).
CREATE OR REPLACE FUNCTION outbox_live_run_statuses() RETURNS text[]
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT '{runnable,running,waiting,paused}'::text[]
$$;

-- What the database itself sets for outbox.<name> (ALTER DATABASE ... SET), if
-- anything: unlike current_setting, nothing a session does changes it.
CREATE OR REPLACE FUNCTION outbox_database_setting(name text) RETURNS text
    LANGUAGE sql STABLE PARALLEL SAFE AS $$
SELECT nullif(substr(c, length(name) + 9), '')
  FROM pg_catalog.pg_db_role_setting AS s, unnest(s.setconfig) AS c
 WHERE s.setdatabase = (SELECT d.oid FROM pg_catalog.pg_database AS d
                         WHERE d.datname = current_database())
   AND s.setrole = 0 AND c LIKE 'outbox.' || name || '=%'
$$;

-- A numeric limit (max_payload_bytes, max_step_intents, ...): outbox_setting's
-- value. The caps (all but blob_threshold_bytes, which only chooses where a value
-- is stored) a session can only lower: above the database's own value, or the
-- rule when the database sets none, the ceiling holds. The ceiling is read only
-- when the session asks for more than the rule, so a client on the defaults (or
-- stricter) pays nothing for it; a database that lowers a cap below the rule
-- binds sessions that do not set their own (SQL API callers), as before.
--
-- One expression, no FROM: the planner inlines it where it is called (a step asks
-- for seven limits; a call each costs about 12 us, the inlined form a fraction).
CREATE OR REPLACE FUNCTION outbox_limit(name text) RETURNS bigint
    LANGUAGE sql STABLE PARALLEL SAFE AS $$
SELECT CASE WHEN name = 'blob_threshold_bytes'
              OR outbox_setting(name)::bigint <= (outbox_intent_rules()->>name)::bigint
            THEN outbox_setting(name)::bigint
            ELSE least(outbox_setting(name)::bigint,
                       coalesce(outbox_database_setting(name)::bigint,
                                (outbox_intent_rules()->>name)::bigint)) END
$$;

-- Who may let go of what an operator holds: approve an effect held for
-- approval, resume a paused run. Everyone, until `outbox roles` revokes EXECUTE
-- from PUBLIC and grants it to the operator role: then an agent or deliverer
-- login that writes the status by hand is refused (outbox_effects_hold_paused,
-- outbox_runs_refuse_resume).
CREATE OR REPLACE FUNCTION outbox_may_release() RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT true
$$;

-- Refuses to resume a paused run (make it live again, or drop a pause asked of
-- a running one) in a session without EXECUTE on outbox_may_release: an agent
-- login cannot un-pause what an operator paused. The WHEN clause keeps it off
-- every other update.
CREATE OR REPLACE FUNCTION outbox_runs_refuse_resume() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    IF NOT has_function_privilege('outbox_may_release()', 'EXECUTE') THEN
        RAISE EXCEPTION 'permission denied: run % was paused by an operator; only a resume '
            'lets it go (a role with EXECUTE on outbox_may_release())', OLD.id
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN NEW;
END
$$;

-- A recorded step never changes: its result is what a replay returns, and the
-- run's hash chain covers it. Its hash may be relinked (a fork does), which only
-- verify can judge. The UPDATE trigger costs the step write (an INSERT) nothing.
-- The table's owner (and a superuser) is not refused, as row-level security
-- does not bind it: a hand edit by whoever owns the schema is for `outbox audit
-- verify` to find; an agent login can no longer make one.
CREATE OR REPLACE FUNCTION outbox_steps_refuse_rewrite() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    IF pg_has_role((SELECT c.relowner FROM pg_catalog.pg_class AS c WHERE c.oid = TG_RELID),
                   'USAGE') THEN
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'step % of run % is recorded: it never changes', OLD.step_id, OLD.run_id
        USING ERRCODE = 'integrity_constraint_violation';
END
$$;

-- id with its shard bits set to shard (a new id that must live on that shard).
CREATE OR REPLACE FUNCTION outbox_on_shard(id uuid, shard smallint) RETURNS uuid
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
SELECT encode(set_byte(uuid_send(id), 15, (get_byte(uuid_send(id), 15) & 224) | shard), 'hex')::uuid
$$;

-- Whether the tables are distributed (Citus): outbox migrate --distribute sets it
-- for the database. A session that unsets it only makes a delegated write refuse.
CREATE OR REPLACE FUNCTION outbox_distributed() RETURNS boolean
    LANGUAGE sql STABLE PARALLEL SAFE AS $$
SELECT coalesce(current_setting('outbox.distributed', true), '') = 'on'
$$;

-- Send signal name with a JSON payload to a live run; a run waiting for it
-- becomes runnable. The same dedup_key is accepted once (duplicate => true).
-- A paused run takes signals too: its wait sees them when it is resumed. A
-- payload over outbox.blob_threshold_bytes is stored by reference.
CREATE OR REPLACE FUNCTION outbox_signal(
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
    p_shard smallint := outbox_shard_of(outbox_signal.run_id);
    v_now timestamptz := now();
    run_status text;
    woke uuid;
    canonical text;
BEGIN
    PERFORM outbox_check_text('name', outbox_signal.name, (rules->>'max_name_length')::integer,
                              true, true);
    PERFORM outbox_check_text('dedup_key', outbox_signal.dedup_key,
                              (rules->>'max_key_length')::integer, false);
    PERFORM outbox_check_not_reference('payload', outbox_signal.payload);
    canonical := outbox_check_json('payload', coalesce(outbox_signal.payload, 'null'::jsonb),
                                   outbox_setting('max_payload_bytes')::integer);
    -- waits, signals and cancellation of a run serialise on its row (run_tx.lock)
    SELECT r.status INTO run_status FROM outbox_runs AS r
     WHERE r.id = outbox_signal.run_id AND r.shard = p_shard FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM outbox_raise_run_not_found(outbox_signal.run_id);
    END IF;
    IF NOT run_status = ANY (outbox_live_run_statuses()) THEN
        PERFORM outbox_raise_run_ended(outbox_signal.run_id, run_status);
    END IF;
    INSERT INTO outbox_signals AS s (id, run_id, shard, name, payload, dedup_key)
    VALUES (outbox_uuid7(), outbox_signal.run_id, p_shard, outbox_signal.name,
            outbox_store_value(outbox_signal.run_id, coalesce(outbox_signal.payload, 'null'::jsonb),
                               canonical),
            coalesce(outbox_signal.dedup_key, replace(gen_random_uuid()::text, '-', '')))
    ON CONFLICT ON CONSTRAINT outbox_signals_dedup DO NOTHING
    RETURNING s.id INTO signal_id;
    duplicate := signal_id IS NULL;
    woke_run := false;
    IF duplicate THEN
        RETURN;
    END IF;
    UPDATE outbox_runs AS r
       SET status = 'runnable', available_at = v_now, wake_at = NULL, wait_signal = NULL,
           updated_at = v_now
     WHERE r.id = outbox_signal.run_id AND r.shard = p_shard AND r.status = 'waiting'
       AND r.wait_signal = outbox_signal.name
    RETURNING r.id INTO woke;
    woke_run := woke IS NOT NULL;
    IF woke_run THEN
        PERFORM pg_notify('outbox_runs', '');
    END IF;
    -- plain scripts blocked in wait_signal listen here
    PERFORM pg_notify('outbox_signals', outbox_signal.run_id::text);
END
$$;

-- Debit run_id's budget by amount for reason when step_id commits (call it before
-- outbox_commit_step, in the same transaction). Keyed by (run, step, reason): a
-- step records each reason once, so a replay or a retry cannot spend twice (G7).
CREATE OR REPLACE FUNCTION outbox_spend(run_id uuid, step_id text, amount numeric, reason text) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    entry jsonb := outbox_tx_step(outbox_spend.run_id, outbox_spend.step_id);
    spent jsonb := outbox_spend_entry(entry->'ledger',
        jsonb_build_object('reason', outbox_spend.reason, 'amount', outbox_spend.amount));
BEGIN
    PERFORM outbox_tx_save_step(outbox_spend.run_id, outbox_spend.step_id, entry || jsonb_build_object(
        'debit', (entry->>'debit')::numeric + outbox_spend.amount,
        'ledger', (entry->'ledger') || jsonb_build_array(spent)));
END
$$;

-- One spend of a step ({"reason": ..., "amount": ...}) as its ledger entry, checked:
-- a positive, finite amount within the rules, a reason named once in the step
-- (ledger: the step's entries so far).
CREATE OR REPLACE FUNCTION outbox_spend_entry(ledger jsonb, spend jsonb) RETURNS jsonb
    LANGUAGE plpgsql AS $$
DECLARE
    amount numeric;
    reason text;
BEGIN
    IF jsonb_typeof(spend) IS DISTINCT FROM 'object' THEN
        PERFORM outbox_refuse('OB001', 'spends', left(spend::text, 80),
            'each spend must be {"reason": ..., "amount": ...}');
    END IF;
    amount := outbox_json_field_number(spend, 'amount', '');
    IF amount IS NULL THEN
        PERFORM outbox_refuse('OB001', 'amount', NULL, 'is required');
    END IF;
    PERFORM outbox_check_amount('amount', amount, true);
    reason := outbox_json_field_text(spend, 'reason', '');
    PERFORM outbox_check_text('reason', reason,
        (outbox_intent_rules()->>'max_name_length')::integer, true, true);
    IF jsonb_path_exists(ledger, '$[*] ? (@.entry == "spend" && @.reason == $r)',
                         jsonb_build_object('r', reason)) THEN
        PERFORM outbox_refuse('OB001', 'reason', reason, 'already spent for in this step');
    END IF;
    RETURN jsonb_build_object('entry', 'spend', 'reason', reason, 'amount', amount, 'effect_id', NULL);
END
$$;

-- Start a run of agent at version with inputs: the one implementation, for every
-- client. A run with a business key is the only one with that key in its
-- namespace (G5 for runs; the key is registered on its own shard, and a run
-- given no id gets one on that shard, so the start touches one shard):
-- starting it again returns the existing run when agent, version, inputs and mode
-- are the same (on_conflict 'return_existing'), or OB010 (on_conflict 'reject');
-- anything else is OB003. run_id names the run to start (a retry of a start that
-- may have committed returns it). mode 'dry_run' starts a dry run (its effects
-- go to the recording deliverer). The run is runnable: a worker of its agent and
-- version claims it; its lane (priority, fairness_key) orders claims.
--
-- outbox_start_run returns the run's id; outbox_begin_run, which it calls,
-- returns the row as stored and whether this call created it.
CREATE OR REPLACE FUNCTION outbox_begin_run(
    agent text,
    version text,
    inputs jsonb DEFAULT NULL,
    budget numeric DEFAULT NULL,
    run_id uuid DEFAULT NULL,
    key text DEFAULT NULL,
    on_conflict text DEFAULT 'return_existing',
    priority integer DEFAULT 0,
    fairness_key text DEFAULT '',
    mode text DEFAULT 'live',
    trace_parent text DEFAULT NULL,
    wake boolean DEFAULT NULL,
    namespace text DEFAULT NULL,
    OUT run outbox_runs,
    OUT created boolean
)
    LANGUAGE plpgsql AS $$
DECLARE
    rules jsonb := outbox_intent_rules();
    p_inputs jsonb := coalesce(outbox_begin_run.inputs, 'null'::jsonb);
    p_ns text := coalesce(outbox_begin_run.namespace, 'default');
    p_id uuid := outbox_begin_run.run_id;
    p_dry boolean := outbox_begin_run.mode = 'dry_run';
    holder uuid;
    rendered text;
    p_hash text;
    stored jsonb;
BEGIN
    PERFORM outbox_check_text('agent', outbox_begin_run.agent, (rules->>'max_agent_length')::integer);
    PERFORM outbox_check_text('version', outbox_begin_run.version, (rules->>'max_version_length')::integer);
    PERFORM outbox_check_not_reference('inputs', p_inputs);
    rendered := outbox_check_json('inputs', p_inputs, outbox_limit('max_payload_bytes'));
    PERFORM outbox_check_amount('budget', outbox_begin_run.budget);
    PERFORM outbox_check_text('key', outbox_begin_run.key, (rules->>'max_key_length')::integer, false);
    PERFORM outbox_check_namespace(p_ns);
    IF on_conflict IS NULL OR on_conflict NOT IN ('return_existing', 'reject') THEN
        PERFORM outbox_refuse('OB001', 'on_conflict', on_conflict, 'must be return_existing or reject');
    END IF;
    IF outbox_begin_run.priority IS NULL THEN
        PERFORM outbox_refuse('OB001', 'priority', NULL, 'is required');
    END IF;
    IF outbox_begin_run.fairness_key IS NULL THEN
        PERFORM outbox_refuse('OB001', 'fairness_key', NULL, 'is required ('''' for none)');
    END IF;
    PERFORM outbox_check_lane(outbox_begin_run.priority, outbox_begin_run.fairness_key);
    IF mode IS NULL OR mode NOT IN ('live', 'dry_run') THEN
        PERFORM outbox_refuse('OB001', 'mode', mode, 'must be live or dry_run');
    END IF;
    IF coalesce(outbox_begin_run.trace_parent, '') !~ '^([0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2})?$' THEN
        PERFORM outbox_refuse('OB001', 'trace_parent', outbox_begin_run.trace_parent,
            'must be a W3C traceparent (00-<trace id>-<span id>-<flags>)');
    END IF;
    p_hash := encode(sha256(convert_to(rendered, 'UTF8')), 'hex');
    IF outbox_begin_run.key IS NOT NULL THEN
        p_id := coalesce(p_id, outbox_on_shard(outbox_uuid7(),
                                               outbox_key_shard(p_ns, outbox_begin_run.key)));
        -- racers on one key queue on its row here; the first one's run holds it
        INSERT INTO outbox_run_keys AS k (namespace, key, shard, run_id)
        VALUES (p_ns, outbox_begin_run.key, outbox_key_shard(p_ns, outbox_begin_run.key), p_id)
        ON CONFLICT ON CONSTRAINT outbox_run_keys_pkey DO NOTHING
        RETURNING k.run_id INTO holder;
        IF holder IS NULL THEN
            SELECT k.run_id INTO holder FROM outbox_run_keys AS k
             WHERE k.namespace = p_ns AND k.key = outbox_begin_run.key
               AND k.shard = outbox_key_shard(p_ns, outbox_begin_run.key);
            IF holder <> p_id THEN
                PERFORM outbox_existing_run(holder, p_ns, outbox_begin_run.key, on_conflict,
                    outbox_begin_run.agent, outbox_begin_run.version, p_inputs, p_hash, p_dry);
                SELECT r.* INTO run FROM outbox_runs AS r
                 WHERE r.id = holder AND r.shard = outbox_shard_of(holder);
                created := false;
                RETURN;
            END IF;
        END IF;
    END IF;
    p_id := coalesce(p_id, outbox_uuid7());
    -- (a start answered with another run leaves this reference ownerless: gc takes it)
    stored := CASE WHEN octet_length(rendered) > outbox_limit('blob_threshold_bytes')
                   THEN outbox_store_value(p_id, p_inputs, rendered) ELSE p_inputs END;
    INSERT INTO outbox_runs AS r (id, shard, namespace, agent, agent_version, inputs, inputs_hash,
                                  status, budget, key, priority, fairness_key, dry_run, trace_parent)
    VALUES (p_id, outbox_shard_of(p_id), p_ns, outbox_begin_run.agent, outbox_begin_run.version,
            stored, p_hash, 'runnable', outbox_begin_run.budget, outbox_begin_run.key,
            outbox_begin_run.priority, outbox_begin_run.fairness_key, p_dry,
            nullif(outbox_begin_run.trace_parent, ''))
    ON CONFLICT ON CONSTRAINT outbox_runs_pkey DO NOTHING
    RETURNING r.* INTO run;
    created := run.id IS NOT NULL;
    IF created THEN
        IF wake IS DISTINCT FROM false THEN
            IF wake THEN
                PERFORM pg_notify('outbox_runs', '');
            ELSE
                PERFORM outbox_wake('outbox_runs');
            END IF;
        END IF;
        RETURN;
    END IF;
    -- the id names a run already: a retry of this start, or a conflict
    SELECT r.* INTO run FROM outbox_runs AS r WHERE r.id = p_id AND r.shard = outbox_shard_of(p_id);
    IF run.agent <> outbox_begin_run.agent OR run.agent_version <> outbox_begin_run.version
       OR NOT (run.inputs_hash = p_hash OR outbox_resolve(run.inputs, run.shard) = p_inputs)
       OR run.budget IS DISTINCT FROM outbox_begin_run.budget OR run.dry_run <> p_dry
       OR (outbox_begin_run.key IS NOT NULL AND run.key IS DISTINCT FROM outbox_begin_run.key)
       OR run.namespace <> p_ns THEN
        PERFORM outbox_refuse('OB001', 'run_id', p_id::text,
            'names a run started with another agent, version, inputs, budget, key or mode');
    END IF;
END
$$;

-- A start under a key another run (holder) holds: that run, when it was started
-- with the same agent, version, inputs and mode and on_conflict is
-- return_existing; else OB010 (reject) or OB003 (a conflict).
CREATE OR REPLACE FUNCTION outbox_existing_run(
    holder uuid, p_ns text, p_key text, p_on_conflict text, p_agent text, p_version text,
    p_inputs jsonb, p_hash text, p_dry boolean
) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    run outbox_runs;
BEGIN
    SELECT r.* INTO run FROM outbox_runs AS r
     WHERE r.id = holder AND r.shard = outbox_shard_of(holder);
    IF NOT FOUND THEN
        PERFORM outbox_raise_conflict(p_key, 'started concurrently by another transaction');
    END IF;
    IF run.agent <> p_agent OR run.agent_version <> p_version
       OR NOT (run.inputs_hash = p_hash OR outbox_resolve(run.inputs, run.shard) = p_inputs) THEN
        PERFORM outbox_raise_conflict(p_key,
            format('a run was started with this key as %s %s with other inputs',
                   run.agent, run.agent_version));
    END IF;
    IF run.dry_run <> p_dry THEN
        PERFORM outbox_raise_conflict(p_key, 'a run was started with this key in the other mode');
    END IF;
    IF p_on_conflict = 'reject' THEN
        PERFORM outbox_raise_run_exists(p_key, run.id);
    END IF;
END
$$;

-- A namespace: lower-case letters, digits, '.', '_' and '-', at most 63.
CREATE OR REPLACE FUNCTION outbox_check_namespace(namespace text) RETURNS void
    LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF namespace IS NULL OR namespace !~ '^[a-z0-9][a-z0-9._-]{0,62}$' THEN
        PERFORM outbox_refuse('OB001', 'namespace', namespace,
            'must be 1 to 63 lower-case letters, digits, ".", "_" or "-", starting with a letter or digit');
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION outbox_start_run(
    agent text,
    version text,
    inputs jsonb DEFAULT NULL,
    budget numeric DEFAULT NULL,
    run_id uuid DEFAULT NULL,
    key text DEFAULT NULL,
    on_conflict text DEFAULT 'return_existing',
    priority integer DEFAULT 0,
    fairness_key text DEFAULT '',
    mode text DEFAULT 'live',
    namespace text DEFAULT NULL
) RETURNS uuid
    LANGUAGE sql AS $$
SELECT (b.run).id FROM outbox_begin_run(agent, version, inputs, budget, run_id, key, on_conflict,
                                        priority, fairness_key, mode, NULL, NULL, namespace) AS b
$$;

-- The state of (run_id, step_id) in this transaction. The first time a step is
-- met, the run must exist and accept steps, and the step must not be recorded
-- yet; a step already committed in this transaction takes no more writes. The
-- run row stays locked (FOR NO KEY UPDATE) until commit, as outbox_commit_step's
-- update would lock it: a pause or a cancellation waits for the step's
-- transaction, and of two transactions writing the same step the second waits
-- for the first and then finds its step recorded (OB006).
CREATE OR REPLACE FUNCTION outbox_tx_step(p_run_id uuid, p_step_id text) RETURNS jsonb
    LANGUAGE plpgsql AS $$
DECLARE
    entry jsonb := outbox_tx_steps()->outbox_tx_step_slot(p_run_id, p_step_id);
    run_status text;
    recorded_here boolean;
BEGIN
    IF entry IS NULL AND outbox_distributed() THEN
        -- this transaction's notes are kept on the node it runs on, and on Citus the
        -- step's write runs on another (outbox_write_step is delegated)
        PERFORM outbox_refuse('OB001', 'run_id', p_run_id::text,
            'on a distributed database a step''s intents and debits go to outbox_commit_step '
            'in its one call (intents => ..., spends => ...)');
    END IF;
    IF entry IS NOT NULL THEN
        IF (entry->>'done')::boolean THEN
            PERFORM outbox_refuse('OB001', 'step_id', p_step_id,
                'outbox_commit_step already recorded this step in this transaction: '
                'write its intents and debits before committing it');
        END IF;
        RETURN entry;
    END IF;
    PERFORM outbox_check_text('step_id', p_step_id, outbox_limit('max_step_id_length')::integer,
                              true, true);
    SELECT r.status INTO run_status FROM outbox_runs AS r
     WHERE r.id = p_run_id AND r.shard = outbox_shard_of(p_run_id) FOR NO KEY UPDATE;
    IF NOT FOUND OR NOT run_status = ANY (outbox_active_run_statuses()) THEN
        -- missing, paused (it takes no steps until resumed) or ended
        PERFORM outbox_raise_run_refusal(p_run_id);
    END IF;
    SELECT s.xmin = pg_current_xact_id()::xid INTO recorded_here
      FROM outbox_steps AS s
     WHERE s.run_id = p_run_id AND s.step_id = p_step_id AND s.shard = outbox_shard_of(p_run_id);
    IF recorded_here THEN
        PERFORM outbox_refuse('OB001', 'step_id', p_step_id,
            'outbox_commit_step already recorded this step in this transaction: '
            'write its intents and debits before committing it');
    ELSIF FOUND THEN
        PERFORM outbox_raise_step_recorded(p_run_id, p_step_id);
    END IF;
    entry := jsonb_build_object('next', 0, 'count', 0, 'bytes', 0, 'debit', 0, 'reserve', 0,
                                'ledger', '[]'::jsonb, 'chain', '[]'::jsonb, 'claimable', false,
                                'ids', '[]'::jsonb, 'done', false);
    -- saved now: the commit-time check (outbox_effects_step_committed) only
    -- sees rows inserted while this setting is present
    PERFORM outbox_tx_save_step(p_run_id, p_step_id, entry);
    RETURN entry;
END
$$;

-- What a row holds for a value whose canonical JSON is canonical: the value, or
-- (over outbox.blob_threshold_bytes) a reference to it, stored once by its
-- sha256 in outbox_blobs and recorded as used by owner (a run, or an effect of
-- no run), on the owner's shard, as outbox.blobs and outbox.storage.blob_store
-- do. The upsert locks the blob until commit, so `outbox gc` cannot take it
-- meanwhile.
CREATE OR REPLACE FUNCTION outbox_store_value(owner uuid, value jsonb, canonical text) RETURNS jsonb
    LANGUAGE plpgsql AS $$
DECLARE
    size bigint := octet_length(canonical);
    p_shard smallint := outbox_shard_of(owner);
    v_now timestamptz := now();
    sha text;
BEGIN
    IF size <= outbox_setting('blob_threshold_bytes')::bigint THEN
        RETURN value;
    END IF;
    sha := encode(sha256(convert_to(canonical, 'UTF8')), 'hex');
    INSERT INTO outbox_blobs AS b (sha256, bytes, data, shard) VALUES (sha, size, canonical, p_shard)
    ON CONFLICT ON CONSTRAINT outbox_blobs_pkey DO UPDATE SET used_at = v_now;
    INSERT INTO outbox_blob_refs AS f (owner, sha256, shard)
    VALUES (outbox_store_value.owner, sha, p_shard)
    ON CONFLICT ON CONSTRAINT outbox_blob_refs_pkey DO NOTHING;
    RETURN jsonb_build_object('__outbox_blob__', jsonb_build_object('bytes', size, 'sha256', sha));
END
$$;

-- The sha256 a value names when it is a reference to a stored value (an object
-- whose one key is __outbox_blob__, naming a sha256 string), else NULL. One
-- expression (the planner inlines it), each test in its own branch.
CREATE OR REPLACE FUNCTION outbox_reference_sha(value jsonb) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT CASE WHEN jsonb_typeof(value) IS DISTINCT FROM 'object' THEN NULL
            WHEN NOT value ? '__outbox_blob__' THEN NULL
            WHEN value - '__outbox_blob__' <> '{}'::jsonb THEN NULL
            WHEN jsonb_typeof(value->'__outbox_blob__'->'sha256') IS DISTINCT FROM 'string'
                THEN NULL
            ELSE value->'__outbox_blob__'->>'sha256' END
$$;

-- A value as read from a row of shard (its owner's), with a reference replaced by
-- the value it names. (Without a shard: any shard's copy, on one server.)
-- The text read is hashed first, as outbox.storage.blob_store.fetch does: one that
-- is not its sha256's (edited after it was written) is refused with OB012 naming
-- it, never returned as a step's result, a run's state or a payload.
CREATE OR REPLACE FUNCTION outbox_resolve(value jsonb, shard smallint DEFAULT NULL) RETURNS jsonb
    LANGUAGE plpgsql STABLE AS $$
DECLARE
    sha text;
    stored text;
BEGIN
    sha := outbox_reference_sha(value);
    IF sha IS NULL THEN
        RETURN value;
    END IF;
    IF outbox_resolve.shard IS NULL THEN
        SELECT b.data INTO stored FROM outbox_blobs AS b WHERE b.sha256 = sha LIMIT 1;
    ELSE
        SELECT b.data INTO stored FROM outbox_blobs AS b
         WHERE b.sha256 = sha AND b.shard = outbox_resolve.shard;
    END IF;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'stored value sha256=% is missing from outbox_blobs', sha;
    END IF;
    IF encode(sha256(convert_to(stored, 'UTF8')), 'hex') IS DISTINCT FROM sha THEN
        PERFORM outbox_raise('OB012',
            format('stored value sha256=%s does not match its text in outbox_blobs '
                   '(altered after it was written): refused', sha),
            jsonb_build_object('sha256', sha));
    END IF;
    RETURN stored::jsonb;
END
$$;

DROP TRIGGER IF EXISTS outbox_effects_hold_paused ON outbox_effects;
CREATE TRIGGER outbox_effects_hold_paused
    BEFORE UPDATE OF status ON outbox_effects FOR EACH ROW
    WHEN ((NEW.status = 'pending' AND OLD.status <> 'pending' AND OLD.status <> 'paused'
           AND NEW.run_id IS NOT NULL)
          OR (OLD.status = 'awaiting_approval'
              AND NEW.status NOT IN ('awaiting_approval', 'rejected', 'cancelled')))
    EXECUTE FUNCTION outbox_effects_hold_paused();

DROP TRIGGER IF EXISTS outbox_runs_resume_guard ON outbox_runs;
CREATE TRIGGER outbox_runs_resume_guard
    BEFORE UPDATE OF status, paused_at ON outbox_runs FOR EACH ROW
    WHEN (NEW.status IN ('runnable', 'running', 'waiting')
          AND (OLD.status = 'paused' OR (OLD.paused_at IS NOT NULL AND NEW.paused_at IS NULL)))
    EXECUTE FUNCTION outbox_runs_refuse_resume();

DROP TRIGGER IF EXISTS outbox_steps_recorded_immutable ON outbox_steps;
CREATE TRIGGER outbox_steps_recorded_immutable
    BEFORE UPDATE ON outbox_steps FOR EACH ROW
    WHEN (OLD.status = 'completed'
          AND (OLD.run_id, OLD.shard, OLD.seq, OLD.step_id, OLD.kind, OLD.result, OLD.error,
               OLD.state, OLD.plan, OLD.completed_at, OLD.status)
              IS DISTINCT FROM
              (NEW.run_id, NEW.shard, NEW.seq, NEW.step_id, NEW.kind, NEW.result, NEW.error,
               NEW.state, NEW.plan, NEW.completed_at, NEW.status))
    EXECUTE FUNCTION outbox_steps_refuse_rewrite();
