-- Where an effect is: one row, or none when no effect has this id. Read first on
-- the shard its id names (on Citus that shard alone), then, for an id written
-- before ids named their shard or one its caller chose, on every shard.
CREATE OR REPLACE FUNCTION outbox_effect_status(effect_id uuid)
    RETURNS TABLE (id uuid, kind text, status text, idempotency_key text, attempt integer,
                   result jsonb, last_error text, run_id uuid, step_id text, step_index integer,
                   created_at timestamptz, updated_at timestamptz, completed_at timestamptz)
    LANGUAGE plpgsql STABLE AS $$
DECLARE
    p_id uuid := outbox_effect_status.effect_id;
    p_shard smallint := outbox_shard_of(outbox_effect_status.effect_id);
BEGIN
    RETURN QUERY
    SELECT e.id, e.kind, e.status, e.idempotency_key, e.attempt, e.result, e.last_error,
           e.run_id, e.step_id, e.step_index, e.created_at, e.updated_at, e.completed_at
      FROM outbox_effects AS e WHERE e.id = p_id AND e.shard = p_shard;
    IF NOT FOUND THEN
        RETURN QUERY
        SELECT e.id, e.kind, e.status, e.idempotency_key, e.attempt, e.result, e.last_error,
               e.run_id, e.step_id, e.step_index, e.created_at, e.updated_at, e.completed_at
          FROM outbox_effects AS e WHERE e.id = p_id;
    END IF;
END
$$;

-- The same, found by idempotency key.
CREATE OR REPLACE FUNCTION outbox_effect_by_key(key text)
    RETURNS TABLE (id uuid, kind text, status text, idempotency_key text, attempt integer,
                   result jsonb, last_error text, run_id uuid, step_id text, step_index integer,
                   created_at timestamptz, updated_at timestamptz, completed_at timestamptz)
    LANGUAGE sql STABLE AS $$
SELECT e.id, e.kind, e.status, e.idempotency_key, e.attempt, e.result, e.last_error, e.run_id,
       e.step_id, e.step_index, e.created_at, e.updated_at, e.completed_at
  FROM outbox_effects AS e WHERE e.idempotency_key = outbox_effect_by_key.key
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

-- Which of p_owners (deliverers or relays) hold an attempt in flight or an effect
-- dispatched, in any namespace. A deliverer forgets a gone owner only when it holds
-- nothing: one confined to a namespace sees only that namespace's effects, and the
-- owners' registry is shared, so it asks here, as the tables' owner. It tells no
-- more than whether a named owner holds anything. (On Citus the registry stays on
-- the coordinator and the effects are distributed: one statement may not join
-- them, so the caller deletes in a statement of its own.)
CREATE OR REPLACE FUNCTION outbox_owners_holding(p_owners text[]) RETURNS text[]
    LANGUAGE sql STABLE SECURITY DEFINER SET search_path FROM CURRENT AS $$
SELECT coalesce(array_agg(DISTINCT e.lease_owner), '{}')
  FROM outbox_effects AS e
 WHERE e.status IN ('in_flight', 'dispatched') AND e.lease_owner = ANY (p_owners)
$$;
