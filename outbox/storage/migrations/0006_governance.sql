-- 0006: effect governance (issue 16): approval gates, dry runs, read-back notes and a
-- tamper-evident record (hash chains over the attempt log and the steps of each run).

-- Two effect statuses: held by an approval gate, and rejected by a person or a deadline.
ALTER TABLE outbox_effects DROP CONSTRAINT outbox_effects_status_check;
ALTER TABLE outbox_effects ADD CONSTRAINT outbox_effects_status_check CHECK (status IN (
    'pending', 'in_flight', 'dispatched', 'succeeded', 'failed', 'unknown', 'cancelled',
    'compensated', 'awaiting_approval', 'rejected'));

-- The gate holding an effect, its deadline, and what a deliverer noted before calling.
ALTER TABLE outbox_effects ADD COLUMN approval JSONB;
ALTER TABLE outbox_effects ADD COLUMN approval_deadline TIMESTAMPTZ;
ALTER TABLE outbox_effects ADD COLUMN attempt_note JSONB;

-- An effect awaiting approval holds back later effects of its ordering key, and a
-- person must look at it.
DROP INDEX outbox_effects_ordering;
CREATE INDEX outbox_effects_ordering ON outbox_effects (ordering_key, seq)
    WHERE ordering_key IS NOT NULL
      AND status IN ('pending', 'in_flight', 'dispatched', 'unknown', 'awaiting_approval');
DROP INDEX outbox_effects_needs_operator;
CREATE INDEX outbox_effects_needs_operator ON outbox_effects (status, seq)
    WHERE status IN ('unknown', 'failed', 'awaiting_approval');
-- Approval deadlines fire by index.
CREATE INDEX outbox_effects_approval_due ON outbox_effects (approval_deadline)
    WHERE status = 'awaiting_approval' AND approval_deadline IS NOT NULL;

-- Dry runs, and the head of each run's step chain.
ALTER TABLE outbox_runs ADD COLUMN dry_run BOOLEAN NOT NULL DEFAULT false;
ALTER TABLE outbox_runs ADD COLUMN step_head BYTEA;
ALTER TABLE outbox_steps ADD COLUMN hash BYTEA;
ALTER TABLE outbox_effect_attempts ADD COLUMN hash BYTEA;
-- The newest row of an effect's chain is one probe of (effect, id).
DROP INDEX outbox_effect_attempts_effect;
CREATE INDEX outbox_effect_attempts_effect ON outbox_effect_attempts (effect_id, id);

-- Gates from the deliverers config, evaluated by the statement that writes an intent.
CREATE TABLE outbox_gates (
    name            TEXT NOT NULL PRIMARY KEY,
    kind            TEXT NOT NULL,
    conditions      JSONB NOT NULL DEFAULT '[]'::jsonb,
    timeout_seconds DOUBLE PRECISION,
    on_timeout      TEXT NOT NULL DEFAULT 'reject',
    escalate_to     TEXT,
    updated_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    CONSTRAINT outbox_gates_on_timeout_check
        CHECK (on_timeout IN ('reject', 'cancel_run', 'escalate'))
);
CREATE INDEX outbox_gates_kind ON outbox_gates (kind);

CREATE FUNCTION outbox_lp(value text) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT CASE WHEN value IS NULL THEN '~' ELSE octet_length(value)::text || ':' || value END
$$;

CREATE FUNCTION outbox_us(ts timestamptz) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT (extract(epoch FROM ts) * 1000000)::bigint::text
$$;

CREATE FUNCTION outbox_effect_genesis(
    effect_id uuid, run_id uuid, kind text, idempotency_key text, payload_hash text
) RETURNS bytea
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT sha256(convert_to('outbox.effect.v1' || outbox_lp(effect_id::text)
    || outbox_lp(run_id::text) || outbox_lp(kind) || outbox_lp(idempotency_key)
    || outbox_lp(payload_hash), 'UTF8'))
$$;

CREATE FUNCTION outbox_attempt_hash(
    prev bytea, effect_id uuid, attempt integer, worker text, started_at timestamptz,
    finished_at timestamptz, outcome text, detail jsonb
) RETURNS bytea
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT sha256(prev || convert_to('outbox.attempt.v1' || outbox_lp(effect_id::text)
    || outbox_lp(attempt::text) || outbox_lp(worker) || outbox_lp(outbox_us(started_at))
    || outbox_lp(outbox_us(finished_at)) || outbox_lp(outcome) || outbox_lp(detail::text),
    'UTF8'))
$$;

CREATE FUNCTION outbox_run_genesis(run_id uuid, agent text, inputs_hash text) RETURNS bytea
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT sha256(convert_to('outbox.run.v1' || outbox_lp(run_id::text) || outbox_lp(agent)
    || outbox_lp(inputs_hash), 'UTF8'))
$$;

CREATE FUNCTION outbox_step_hash(
    prev bytea, run_id uuid, step_id text, kind text, result jsonb, error jsonb,
    completed_at timestamptz
) RETURNS bytea
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT sha256(prev || convert_to('outbox.step.v1' || outbox_lp(run_id::text)
    || outbox_lp(step_id) || outbox_lp(kind) || outbox_lp(result::text)
    || outbox_lp(error::text) || outbox_lp(outbox_us(completed_at)), 'UTF8'))
$$;

CREATE FUNCTION outbox_gate_condition(cond jsonb, payload jsonb) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT CASE cond->>'op'
    WHEN 'exists' THEN v IS NOT NULL
    WHEN 'eq' THEN coalesce(v = cond->'value', false)
    WHEN 'ne' THEN coalesce(v <> cond->'value', false)
    WHEN 'in' THEN coalesce(v IN (SELECT x FROM jsonb_array_elements(cond->'value') AS x), false)
    ELSE coalesce(jsonb_typeof(v) = 'number' AND jsonb_typeof(cond->'value') = 'number'
        AND CASE cond->>'op'
            WHEN 'gt' THEN v > cond->'value'
            WHEN 'ge' THEN v >= cond->'value'
            WHEN 'lt' THEN v < cond->'value'
            WHEN 'le' THEN v <= cond->'value'
        END, false)
END
FROM (SELECT payload #> ARRAY(SELECT jsonb_array_elements_text(cond->'path'))) AS p(v)
$$;

CREATE FUNCTION outbox_gate_matches(conditions jsonb, payload jsonb) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT coalesce(bool_and(outbox_gate_condition(c, payload)), true)
FROM jsonb_array_elements(conditions) AS c
$$;

-- A rejected intent releases its cost reservation too.
DROP TRIGGER outbox_effects_settle_cost ON outbox_effects;
DROP FUNCTION outbox_effects_settle_cost();
CREATE FUNCTION outbox_effects_settle_cost() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.status = 'succeeded' THEN
        UPDATE outbox_runs
           SET reserved = reserved - NEW.cost, spent = spent + NEW.cost
         WHERE id = NEW.run_id;
        INSERT INTO outbox_budget_ledger (run_id, step_id, effect_id, reason, entry, amount)
        VALUES (NEW.run_id, NEW.step_id, NEW.id, NEW.kind, 'commit', NEW.cost);
    ELSIF NEW.status IN ('failed', 'cancelled', 'rejected') THEN
        UPDATE outbox_runs SET reserved = reserved - NEW.cost WHERE id = NEW.run_id;
        INSERT INTO outbox_budget_ledger (run_id, step_id, effect_id, reason, entry, amount)
        VALUES (NEW.run_id, NEW.step_id, NEW.id, NEW.kind, 'release', NEW.cost);
    ELSIF OLD.status IN ('failed', 'cancelled', 'rejected') THEN
        -- an operator put it back: it holds its reservation again
        UPDATE outbox_runs SET reserved = reserved + NEW.cost WHERE id = NEW.run_id;
        INSERT INTO outbox_budget_ledger (run_id, step_id, effect_id, reason, entry, amount)
        VALUES (NEW.run_id, NEW.step_id, NEW.id, NEW.kind, 'reserve', NEW.cost);
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER outbox_effects_settle_cost
    AFTER UPDATE OF status ON outbox_effects FOR EACH ROW
    WHEN (NEW.cost IS NOT NULL AND NEW.run_id IS NOT NULL
          AND OLD.status IS DISTINCT FROM NEW.status
          AND (NEW.status IN ('succeeded', 'failed', 'cancelled', 'rejected')
               OR OLD.status IN ('failed', 'cancelled', 'rejected')))
    EXECUTE FUNCTION outbox_effects_settle_cost();

-- History written before this migration joins the chains: each run's completed steps
-- in the order they were recorded, each effect's attempt-log rows in id order.
DO $$
DECLARE
    r record;
    s record;
    head bytea;
BEGIN
    FOR r IN SELECT id, agent, inputs_hash FROM outbox_runs LOOP
        head := NULL;
        FOR s IN SELECT step_id, kind, result, error, completed_at FROM outbox_steps
                  WHERE run_id = r.id AND status = 'completed' ORDER BY seq LOOP
            head := outbox_step_hash(coalesce(head, outbox_run_genesis(r.id, r.agent, r.inputs_hash)),
                                     r.id, s.step_id, s.kind, s.result, s.error, s.completed_at);
            UPDATE outbox_steps SET hash = head WHERE run_id = r.id AND step_id = s.step_id;
        END LOOP;
        UPDATE outbox_runs SET step_head = head WHERE id = r.id AND head IS NOT NULL;
    END LOOP;
    FOR r IN SELECT DISTINCT e.id, e.run_id, e.kind, e.idempotency_key, e.payload_hash
               FROM outbox_effects e JOIN outbox_effect_attempts a ON a.effect_id = e.id LOOP
        head := outbox_effect_genesis(r.id, r.run_id, r.kind, r.idempotency_key, r.payload_hash);
        FOR s IN SELECT * FROM outbox_effect_attempts WHERE effect_id = r.id ORDER BY id LOOP
            head := outbox_attempt_hash(head, s.effect_id, s.attempt, s.worker, s.started_at,
                                        s.finished_at, s.outcome, s.detail);
            UPDATE outbox_effect_attempts SET hash = head WHERE id = s.id;
        END LOOP;
    END LOOP;
END
$$;

-- From now on every attempt-log row is chained as it is written.
CREATE FUNCTION outbox_attempts_chain() RETURNS trigger
    LANGUAGE plpgsql AS $$
DECLARE
    ours boolean;
    prev bytea;
BEGIN
    -- Appends to one effect's chain take turns on the effect's row. The statement that
    -- logs an attempt has nearly always just changed that row, so holds its lock; one
    -- that did not (a stale completion) takes the lock here and draws a new id, so that
    -- id order stays chain order.
    SELECT e.xmin::text = (pg_current_xact_id()::text::bigint % 4294967296)::text,
           outbox_effect_genesis(e.id, e.run_id, e.kind, e.idempotency_key, e.payload_hash)
      INTO ours, prev
      FROM outbox_effects e WHERE e.id = NEW.effect_id;
    IF NOT ours THEN
        PERFORM 1 FROM outbox_effects WHERE id = NEW.effect_id FOR UPDATE;
        NEW.id := nextval(pg_get_serial_sequence('outbox_effect_attempts', 'id'));
    END IF;
    -- The newest link of this effect's chain, else its genesis.
    SELECT coalesce((SELECT a.hash FROM outbox_effect_attempts a
                      WHERE a.effect_id = NEW.effect_id ORDER BY a.id DESC LIMIT 1), prev)
      INTO prev;
    NEW.hash := outbox_attempt_hash(prev, NEW.effect_id, NEW.attempt, NEW.worker,
                                    NEW.started_at, NEW.finished_at, NEW.outcome, NEW.detail);
    RETURN NEW;
END
$$;

CREATE TRIGGER outbox_attempts_chain
    BEFORE INSERT ON outbox_effect_attempts FOR EACH ROW
    EXECUTE FUNCTION outbox_attempts_chain();
