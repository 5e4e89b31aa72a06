-- The hash chains of the tamper-evident record (`outbox audit verify`), computed here,
-- in PostgreSQL, by the statement that writes a row: an attempt-log row by a trigger,
-- a step by outbox_commit_step. outbox/chain.py and the independent script in
-- docs/reference/audit.md recompute them:
--
-- - lp(v) is '~' for NULL, else '<octet length of v in UTF-8>:<v>'; us(t) is a
--   timestamp as integer microseconds since the Unix epoch;
-- - an effect's chain starts at sha256('outbox.effect.v1' || lp(id) || lp(run_id)
--   || lp(kind) || lp(idempotency_key) || lp(payload_hash)); each attempt-log row is
--   sha256(prev || 'outbox.attempt.v1' || lp(effect_id) || lp(attempt) || lp(worker)
--   || lp(us(started_at)) || lp(us(finished_at)) || lp(outcome) || lp(detail::text));
--   since migration 0023 each row also records the effect's status and the sha256
--   of its result::text once the statement that logged it has changed the effect
--   (effect_status, result_hash), and its link is 'outbox.attempt.v2' with
--   || lp(effect_status) || lp(result_hash) appended, so the newest link covers
--   where the effect ended and what it returned;
-- - a run's chain starts at sha256('outbox.run.v1' || lp(id) || lp(agent) ||
--   lp(inputs_hash)); each completed step (since migration 0023) is sha256(prev ||
--   'outbox.step.v3' || lp(run_id) || lp(step_id) || lp(kind) || lp('completed') ||
--   lp(result) || lp(error) || lp(state) || lp(plan) || lp(us(completed_at)) ||
--   intents), where intents is, for each effect the step created in step_index
--   order, lp(id) || lp(idempotency_key) || lp(kind) || lp(payload_hash), and the
--   run keeps the newest in step_head. result, state and plan are the values' own
--   text, also when the row holds a reference to a large one. Earlier steps are
--   outbox.step.v2 links (0021: the values as stored, no intents) or v1 links (no
--   status, state or plan either); a verifier accepts each for its own steps, and a
--   link of one version never passes for another.
--
-- Text is UTF-8, || on the hash input concatenates bytes; detail::text, result,
-- state and plan are PostgreSQL's own rendering of the jsonb (value::text).

CREATE OR REPLACE FUNCTION outbox_lp(value text) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT CASE WHEN value IS NULL THEN '~' ELSE octet_length(value)::text || ':' || value END
$$;

-- The hashing helpers are SQL functions whose bodies call only immutable
-- functions, so that the planner inlines them into the statement that calls
-- them: an IMMUTABLE SQL function whose body calls a STABLE one (convert_to,
-- extract from a timestamptz) is run through the SQL-function executor on every
-- call instead, 15 us for an attempt's link against 2 us inlined. Hence
-- outbox_utf8 (shards.sql) instead of convert_to, and the epoch of the
-- time in UTC, which is the same number.
CREATE OR REPLACE FUNCTION outbox_us(ts timestamptz) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT (extract(epoch FROM ts AT TIME ZONE 'UTC') * 1000000)::bigint::text
$$;

CREATE OR REPLACE FUNCTION outbox_effect_genesis(
    effect_id uuid, run_id uuid, kind text, idempotency_key text, payload_hash text
) RETURNS bytea
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT sha256(outbox_utf8('outbox.effect.v1' || outbox_lp(effect_id::text)
    || outbox_lp(run_id::text) || outbox_lp(kind) || outbox_lp(idempotency_key)
    || outbox_lp(payload_hash)))
$$;

CREATE OR REPLACE FUNCTION outbox_attempt_hash(
    prev bytea, effect_id uuid, attempt integer, worker text, started_at timestamptz,
    finished_at timestamptz, outcome text, detail jsonb
) RETURNS bytea
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT sha256(prev || outbox_utf8('outbox.attempt.v1' || outbox_lp(effect_id::text)
    || outbox_lp(attempt::text) || outbox_lp(worker) || outbox_lp(outbox_us(started_at))
    || outbox_lp(outbox_us(finished_at)) || outbox_lp(outcome) || outbox_lp(detail::text)))
$$;

CREATE OR REPLACE FUNCTION outbox_run_genesis(run_id uuid, agent text, inputs_hash text) RETURNS bytea
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT sha256(outbox_utf8('outbox.run.v1' || outbox_lp(run_id::text) || outbox_lp(agent)
    || outbox_lp(inputs_hash)))
$$;

CREATE OR REPLACE FUNCTION outbox_step_hash(
    prev bytea, run_id uuid, step_id text, kind text, result jsonb, error jsonb,
    completed_at timestamptz
) RETURNS bytea
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT sha256(prev || outbox_utf8('outbox.step.v1' || outbox_lp(run_id::text)
    || outbox_lp(step_id) || outbox_lp(kind) || outbox_lp(result::text)
    || outbox_lp(error::text) || outbox_lp(outbox_us(completed_at))))
$$;

-- A step's link (outbox_step_hash, v1) covered its id, kind, result, error and
-- completion time, not the state and plan it set (a fork restarts from those) nor
-- its status. Steps completed from now on are chained with v2 links, which cover
-- them (the algorithm is at the top of this file). Links written before
-- stay as they are and still verify: a verifier accepts a v1 or a v2 link, and no
-- edit of a v2 step passes as a v1 one (the two hash different messages).
-- Nothing is rehashed: recomputing old links would bless any edit made before.
-- outbox_step_hash stays for processes still running the code before this change.
CREATE OR REPLACE FUNCTION outbox_step_hash_v2(
    prev bytea, run_id uuid, step_id text, kind text, result jsonb, error jsonb,
    state jsonb, plan jsonb, completed_at timestamptz
) RETURNS bytea
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    -- Each value rendered once: inlined into a SQL function, outbox_lp(state::text)
    -- renders the jsonb three times (5 us for a 600-byte state, each time).
    result_text text := result::text;
    error_text text := error::text;
    state_text text := state::text;
    plan_text text := plan::text;
BEGIN
    RETURN sha256(prev || convert_to('outbox.step.v2' || outbox_lp(run_id::text)
        || outbox_lp(step_id) || outbox_lp(kind) || outbox_lp('completed')
        || outbox_lp(result_text) || outbox_lp(error_text) || outbox_lp(state_text)
        || outbox_lp(plan_text) || outbox_lp(outbox_us(completed_at)), 'UTF8'));
END
$$;

-- An attempt-log row's v2 link (the algorithm at the top of this file).
CREATE OR REPLACE FUNCTION outbox_attempt_link(
    prev bytea, effect_id uuid, attempt integer, worker text, started_at timestamptz,
    finished_at timestamptz, outcome text, detail jsonb, effect_status text, result_hash text
) RETURNS bytea
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT sha256(prev || outbox_utf8('outbox.attempt.v2' || outbox_lp(effect_id::text)
    || outbox_lp(attempt::text) || outbox_lp(worker) || outbox_lp(outbox_us(started_at))
    || outbox_lp(outbox_us(finished_at)) || outbox_lp(outcome) || outbox_lp(detail::text)
    || outbox_lp(effect_status) || outbox_lp(result_hash)))
$$;

-- An effect's result as an attempt-log row records it (result_hash): the sha256 of
-- its text, hex. (Immutable, so that Citus accepts it in a RETURNING clause.)
CREATE OR REPLACE FUNCTION outbox_result_hash(result jsonb) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT encode(sha256(outbox_utf8(result::text)), 'hex')
$$;

-- Every attempt-log row is chained as it is written, with the status and result its
-- effect has then: the statement that logs an attempt changes the effect first (in
-- a CTE), and a volatile trigger sees that change. So the newest link covers where
-- the effect ended: a status or result edited by hand does not match it. The cost
-- is one rendering and sha256 of the effect's result per row logged, no statement.
--
-- A row written with its link (hash) is not chained again: a deliverer's
-- completion computes the links of the attempts that changed their effects in its
-- own statement, from the same inputs read under the effect's row lock
-- (outbox.storage.sql.effects), which saves the trigger's two reads a row (on
-- Citus each a distributed query). A link supplied wrong breaks the chain where
-- `outbox audit verify` recomputes it: a writer gains nothing it could not get
-- by letting the trigger compute the link of the row it inserts.
CREATE OR REPLACE FUNCTION outbox_attempts_chain() RETURNS trigger
    LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    ours boolean;
    prev bytea;
BEGIN
    PERFORM outbox_citus_plans_per_call();  -- on a worker, its shard's statements
    -- Appends to one effect's chain take turns on the effect's row. The statement that
    -- logs an attempt has nearly always just changed that row, so holds its lock; one
    -- that did not (a stale completion) takes the lock here, reads the row again as
    -- locked, and draws a new id, so that id order stays chain order.
    SELECT e.xmin::text = (pg_current_xact_id()::text::bigint % 4294967296)::text,
           outbox_effect_genesis(e.id, e.run_id, e.kind, e.idempotency_key, e.payload_hash),
           e.status, outbox_result_hash(e.result)
      INTO ours, prev, NEW.effect_status, NEW.result_hash
      FROM outbox_effects e WHERE e.id = NEW.effect_id AND e.shard = NEW.shard;
    IF NOT ours THEN
        SELECT e.status, outbox_result_hash(e.result)
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

DROP TRIGGER IF EXISTS outbox_attempts_chain ON outbox_effect_attempts;
CREATE TRIGGER outbox_attempts_chain
    BEFORE INSERT ON outbox_effect_attempts FOR EACH ROW WHEN (NEW.hash IS NULL)
    EXECUTE FUNCTION outbox_attempts_chain();

-- A step's v3 link (the algorithm at the top of this file): the texts are the
-- values' own (jsonb::text, NULL when not set), intents the text of the effects
-- the step created (outbox_intents_chain).
CREATE OR REPLACE FUNCTION outbox_step_link(
    prev bytea, run_id uuid, step_id text, kind text, result text, error text, state text,
    plan text, completed_at timestamptz, intents text
) RETURNS bytea
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT sha256(prev || outbox_utf8('outbox.step.v3' || outbox_lp(run_id::text) || outbox_lp(step_id)
    || outbox_lp(kind) || outbox_lp('completed') || outbox_lp(result) || outbox_lp(error)
    || outbox_lp(state) || outbox_lp(plan) || outbox_lp(outbox_us(completed_at)) || intents))
$$;
