-- agent-outbox 0010: effect governance (issue 16): approval gates, dry runs, read-back notes and a
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

-- Its indexes are rebuilt by 0011_governance_indexes.sql (CONCURRENTLY, outside a
-- transaction): until then a held effect is found by a scan, never missed.

-- Dry runs, and the head of each run's step chain.
ALTER TABLE outbox_runs ADD COLUMN dry_run BOOLEAN NOT NULL DEFAULT false;
ALTER TABLE outbox_runs ADD COLUMN step_head BYTEA;
ALTER TABLE outbox_steps ADD COLUMN hash BYTEA;
ALTER TABLE outbox_effect_attempts ADD COLUMN hash BYTEA;

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

-- @functions: the SQL API under governance. outbox/storage/schema.py runs everything
-- below this line after 0007's functions, so a fresh schema gets these definitions.
-- An intent written through SQL is held by the same gates as one written by the
-- Python client (and may ask for approval itself), a dry run's intents go to the
-- dry-run namespace, and a step recorded through SQL joins its run's hash chain.

-- Kinds a caller cannot name (outbox.intent_rules.RESERVED_KIND_PREFIXES).
CREATE FUNCTION outbox_reserved_kind_prefixes() RETURNS text[]
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT ARRAY['dry-run:']
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

-- An intent's own approval policy (the argument approval of outbox_intend) as the
-- effect records it, or NULL for none. true or {} asks for approval with no
-- deadline; {"timeout": seconds, "on_timeout": "reject"|"cancel_run"|"escalate",
-- "escalate_to": "who"} as outbox.gates.ApprovalPolicy.
CREATE FUNCTION outbox_approval_policy(approval jsonb) RETURNS jsonb
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

DROP FUNCTION outbox_intend(text, jsonb, text, text, uuid, text, integer, integer,
                            double precision, integer, jsonb, numeric);

-- Record that effect kind with payload must happen, once, when this transaction
-- commits. With run_id and step_id the intent belongs to that step (call
-- outbox_commit_step for it before committing); without, it belongs to no run.
-- The rules are the Python client's (outbox.intent_rules, EffectIntent); so are
-- approval gates (outbox_gates) and an intent's own approval policy: a held
-- intent commits as awaiting_approval. In a dry run the intent goes to the
-- dry-run namespace and asks for no approval.
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
    approval jsonb DEFAULT NULL,
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
    p_kind text := outbox_intend.kind;
    dry boolean := false;
    policy jsonb;
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
    policy := outbox_approval_policy(outbox_intend.approval);
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
        SELECT r.dry_run INTO dry FROM outbox_runs AS r WHERE r.id = outbox_intend.run_id;
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
    IF dry THEN
        -- A dry run's intents are served by the recording deliverer, never a sink
        -- (outbox.runs.intents does the same), and ask for no approval.
        p_kind := (outbox_reserved_kind_prefixes())[1] || p_kind;
        IF p_key IS NOT NULL THEN
            p_key := (outbox_reserved_kind_prefixes())[1] || outbox_intend.run_id::text || ':' || p_key;
        END IF;
        policy := NULL;
    ELSE
        -- A configured gate wins over the intent's own policy: an intent can add a
        -- gate, never loosen one (as the Python client's statement does).
        SELECT CASE WHEN g.name IS NULL THEN policy
                    ELSE jsonb_build_object('gate', g.name, 'timeout', g.timeout_seconds,
                                            'on_timeout', g.on_timeout, 'escalate_to', g.escalate_to)
               END
          INTO policy
          FROM (SELECT 1) AS one
          LEFT JOIN LATERAL (
              SELECT gg.name, gg.timeout_seconds, gg.on_timeout, gg.escalate_to
                FROM outbox_gates AS gg
               WHERE gg.kind = p_kind AND outbox_gate_matches(gg.conditions, outbox_intend.payload)
               ORDER BY gg.name LIMIT 1) AS g ON true;
    END IF;
    IF outbox_intend.run_id IS NOT NULL THEN
        p_key := coalesce(p_key, outbox_derive_key(outbox_intend.run_id, outbox_intend.step_id, idx));
    ELSE
        p_key := coalesce(p_key, replace(gen_random_uuid()::text, '-', ''));
    END IF;

    INSERT INTO outbox_effects AS e (
        id, run_id, step_id, step_index, kind, payload, payload_hash, schema_version,
        idempotency_key, ordering_key, max_attempts, compensate, cost, status, available_at,
        approval, approval_deadline)
    VALUES (
        new_id, outbox_intend.run_id, outbox_intend.step_id, idx, p_kind,
        outbox_intend.payload, p_hash, outbox_intend.schema_version, p_key,
        outbox_intend.ordering_key, outbox_intend.max_attempts, outbox_intend.compensate,
        outbox_intend.cost, CASE WHEN policy IS NULL THEN 'pending' ELSE 'awaiting_approval' END,
        now() + outbox_intend.delay_seconds * interval '1 second',
        policy, now() + (policy->>'timeout')::double precision * interval '1 second')
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
        IF existing.kind <> p_kind THEN
            PERFORM outbox_raise_conflict(p_key,
                format('already intended as kind %L, not %L', existing.kind, p_kind));
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
                    'entry', 'reserve', 'reason', p_kind,
                    'amount', outbox_intend.cost, 'effect_id', effect_id)));
        END IF;
        PERFORM outbox_tx_save_step(outbox_intend.run_id, outbox_intend.step_id, entry);
    END IF;
    IF created AND policy IS NULL THEN
        -- a held intent wakes nobody: no deliverer may claim it until it is approved
        PERFORM outbox_wake('outbox_effects');
    END IF;
END
$$;

-- Record step_id of run_id: its result, the run's new state and plan (NULL
-- keeps them), the budget its intents reserve and its debits, and (with
-- intents, a JSON array of outbox_intend arguments) more intents. All of it
-- commits with the caller's transaction, or none of it. The step joins the run's
-- hash chain (step_head), computed here as the Python client's commit_step does.
CREATE OR REPLACE FUNCTION outbox_commit_step(
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
    head bytea;
    p_result jsonb := coalesce(outbox_commit_step.result, 'null'::jsonb);
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
                             'delay_seconds', 'schema_version', 'compensate', 'cost', 'approval')
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
                cost => (item->>'cost')::numeric,
                approval => item->'approval');
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
           reserved = r.reserved + (tx_step->>'reserve')::numeric,
           -- the run's step chain (see outbox/storage/governance_ddl.py)
           step_head = outbox_step_hash(
               coalesce(r.step_head, outbox_run_genesis(r.id, r.agent, r.inputs_hash)),
               r.id, outbox_commit_step.step_id, outbox_commit_step.step_kind, p_result, NULL, now())
           -- updated_at is left alone: a step's update must stay HOT (see sql/steps.py)
     WHERE r.id = outbox_commit_step.run_id
       AND r.status = ANY (outbox_live_run_statuses())
       AND (r.budget IS NULL
            OR r.spent + r.reserved + (tx_step->>'debit')::numeric + (tx_step->>'reserve')::numeric <= r.budget)
    RETURNING r.step_head INTO head;
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

    INSERT INTO outbox_steps AS s (run_id, step_id, kind, result, hash)
    VALUES (outbox_commit_step.run_id, outbox_commit_step.step_id, outbox_commit_step.step_kind,
            p_result, head)
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
