-- agent-outbox 0013: run control for long agents. Pause and resume, forks,
-- large values by reference, priorities and fairness keys, declared rates,
-- one run per business key. Its indexes on the big tables are built by 0014,
-- CONCURRENTLY, after this file's columns exist.
-- Must stay equal to outbox/storage/schema.py (tests/integration/test_migrations.py checks it).

-- Runs: paused is a live status that takes no steps. The constraint is checked
-- for new rows at once and validated for old ones by 0014 (without blocking writes).
ALTER TABLE outbox_runs DROP CONSTRAINT outbox_runs_status_check;
ALTER TABLE outbox_runs ADD CONSTRAINT outbox_runs_status_check CHECK (status IN (
    'runnable', 'running', 'waiting', 'completed', 'failed', 'cancelling', 'cancelled',
    'compensating', 'compensated', 'compensation_failed', 'paused')) NOT VALID;
ALTER TABLE outbox_runs
    ADD COLUMN key TEXT,
    ADD COLUMN priority INTEGER NOT NULL DEFAULT 0,
    ADD COLUMN fairness_key TEXT NOT NULL DEFAULT '',
    ADD COLUMN paused_at TIMESTAMP WITH TIME ZONE,
    ADD COLUMN pause_reason TEXT,
    ADD COLUMN forked_from UUID,
    ADD COLUMN forked_at_step TEXT;

-- The state and plan each step set, so a fork starts from them.
ALTER TABLE outbox_steps ADD COLUMN state JSONB, ADD COLUMN plan JSONB;

-- Effects: held as paused while their run is paused.
ALTER TABLE outbox_effects DROP CONSTRAINT outbox_effects_status_check;
ALTER TABLE outbox_effects ADD CONSTRAINT outbox_effects_status_check CHECK (status IN (
    'pending', 'in_flight', 'dispatched', 'succeeded', 'failed', 'unknown', 'cancelled',
    'compensated', 'paused', 'awaiting_approval', 'rejected')) NOT VALID;
ALTER TABLE outbox_effects
    ADD COLUMN priority INTEGER NOT NULL DEFAULT 0,
    ADD COLUMN fairness_key TEXT NOT NULL DEFAULT '';

-- Every way back to pending (a retry, the reconciler, an operator) holds the
-- effect of a paused run as paused; commit_step decides it for new intents.
CREATE FUNCTION outbox_effects_hold_paused() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM outbox_runs WHERE id = NEW.run_id AND paused_at IS NOT NULL) THEN
        NEW.status := 'paused';
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER outbox_effects_hold_paused
    BEFORE UPDATE OF status ON outbox_effects FOR EACH ROW
    WHEN (NEW.status = 'pending' AND OLD.status <> 'pending' AND OLD.status <> 'paused'
          AND NEW.run_id IS NOT NULL)
    EXECUTE FUNCTION outbox_effects_hold_paused();

-- Large values, stored once by content (outbox.blobs), and who uses them.
CREATE TABLE outbox_blobs (
    sha256     TEXT NOT NULL,
    bytes      BIGINT NOT NULL,
    data       TEXT NOT NULL,
    created_at TIMESTAMP WITH TIME ZONE NOT NULL DEFAULT now(),
    used_at    TIMESTAMP WITH TIME ZONE NOT NULL DEFAULT now(),
    CONSTRAINT outbox_blobs_pkey PRIMARY KEY (sha256)
);
CREATE TABLE outbox_blob_refs (
    owner  UUID NOT NULL,
    sha256 TEXT NOT NULL,
    CONSTRAINT outbox_blob_refs_pkey PRIMARY KEY (owner, sha256),
    CONSTRAINT outbox_blob_refs_sha256_fkey FOREIGN KEY (sha256) REFERENCES outbox_blobs (sha256)
);
CREATE INDEX outbox_blob_refs_sha256 ON outbox_blob_refs (sha256);

-- A kind's declared rate, shared by every deliverer process (GCRA).
CREATE TABLE outbox_rate_limits (
    kind TEXT NOT NULL,
    tat  TIMESTAMP WITH TIME ZONE NOT NULL,
    CONSTRAINT outbox_rate_limits_pkey PRIMARY KEY (kind)
);

-- @functions: the SQL API (0007) with run control. outbox/storage/schema.py runs
-- everything below this line after 0007's and 0010's functions, so a fresh schema gets
-- exactly these definitions. A run started and an intent written through the
-- SQL API honour a pause, priorities and fairness keys, one run per business
-- key, and store large values by reference, as the Python client does.

-- Every limit and list the SQL API enforces, in one place: outbox.intent_rules
-- (the Python client's rules, with their codes and reasons), the Settings
-- defaults, and the limits that keep a value readable by every client (JSON
-- depth and integer digits). tests/integration/test_sql_api_rules.py holds it
-- equal to the Python constants. A session or database may override the
-- settings (outbox_setting: SET outbox.max_payload_bytes = ...).
CREATE OR REPLACE FUNCTION outbox_intent_rules() RETURNS jsonb
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
  "max_payload_bytes": 67108864,
  "blob_threshold_bytes": 16384,
  "max_priority": 1000,
  "max_fairness_key_length": 200,
  "max_step_intents": 10000,
  "max_step_bytes": 67108864,
  "max_step_id_length": 200,
  "notify_window_ms": 3.0,
  "max_json_depth": 100,
  "max_integer_digits": 4300,
  "live_run_statuses": ["runnable", "running", "waiting", "paused"],
  "active_run_statuses": ["runnable", "running", "waiting"],
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

-- Statuses in which a run takes steps and intents (models.ACTIVE_RUN_STATUSES):
-- the live ones but paused (a paused run still takes signals).
CREATE FUNCTION outbox_active_run_statuses() RETURNS text[]
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT ARRAY(SELECT jsonb_array_elements_text(outbox_intent_rules()->'active_run_statuses'))
$$;

CREATE FUNCTION outbox_raise_run_paused(run_id uuid, reason text) RETURNS void
    LANGUAGE sql AS $$
SELECT outbox_raise('OB009',
                    format('run_id=%L is paused%s: resume it first', run_id,
                           coalesce(' (' || reason || ')', '')),
                    jsonb_strip_nulls(jsonb_build_object('run_id', run_id, 'reason', reason)))
$$;

CREATE FUNCTION outbox_raise_run_exists(key text, run_id uuid) RETURNS void
    LANGUAGE sql AS $$
SELECT outbox_raise('OB010',
                    format('key=%L: run %s was already started with this key', key, run_id),
                    jsonb_build_object('key', key, 'run_id', run_id))
$$;

-- Refuse a run that takes no steps now: missing (OB004), paused (OB009) or
-- ended (OB005).
CREATE FUNCTION outbox_raise_run_refusal(p_run_id uuid) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    found_run record;
BEGIN
    SELECT r.status, r.pause_reason INTO found_run FROM outbox_runs AS r WHERE r.id = p_run_id;
    IF NOT FOUND THEN
        PERFORM outbox_raise_run_not_found(p_run_id);
    ELSIF found_run.status = 'paused' THEN
        PERFORM outbox_raise_run_paused(p_run_id, found_run.pause_reason);
    ELSE
        PERFORM outbox_raise_run_ended(p_run_id, found_run.status);
    END IF;
END
$$;

-- A priority (-max_priority .. max_priority) and a fairness key (at most
-- max_fairness_key_length characters, may be empty); NULL: inherited.
CREATE FUNCTION outbox_check_lane(priority integer, fairness_key text) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    rules jsonb := outbox_intent_rules();
    top integer := (rules->>'max_priority')::integer;
BEGIN
    IF priority IS NOT NULL AND priority NOT BETWEEN -top AND top THEN
        PERFORM outbox_refuse('OB001', 'priority', priority::text,
            format('must be between %s and %s', -top, top));
    END IF;
    IF fairness_key IS NOT NULL AND fairness_key <> '' THEN
        PERFORM outbox_check_text('fairness_key', fairness_key,
                                  (rules->>'max_fairness_key_length')::integer);
    END IF;
END
$$;

-- What a row holds for a value whose canonical JSON is canonical: the value, or
-- (over outbox.blob_threshold_bytes) a reference to it, stored once by its
-- sha256 in outbox_blobs and recorded as used by owner (a run, or an effect of
-- no run), as outbox.blobs and outbox.storage.blob_store do. The upsert locks
-- the blob until commit, so `outbox gc` cannot take it meanwhile.
CREATE FUNCTION outbox_store_value(owner uuid, value jsonb, canonical text) RETURNS jsonb
    LANGUAGE plpgsql AS $$
DECLARE
    size bigint := octet_length(canonical);
    sha text;
BEGIN
    IF size <= outbox_setting('blob_threshold_bytes')::bigint THEN
        RETURN value;
    END IF;
    sha := encode(sha256(convert_to(canonical, 'UTF8')), 'hex');
    INSERT INTO outbox_blobs AS b (sha256, bytes, data) VALUES (sha, size, canonical)
    ON CONFLICT ON CONSTRAINT outbox_blobs_pkey DO UPDATE SET used_at = now();
    INSERT INTO outbox_blob_refs AS f (owner, sha256) VALUES (outbox_store_value.owner, sha)
    ON CONFLICT ON CONSTRAINT outbox_blob_refs_pkey DO NOTHING;
    RETURN jsonb_build_object('__outbox_blob__', jsonb_build_object('bytes', size, 'sha256', sha));
END
$$;

-- A value as read from a row, with a reference replaced by the value it names.
CREATE FUNCTION outbox_resolve(value jsonb) RETURNS jsonb
    LANGUAGE plpgsql STABLE AS $$
DECLARE
    sha text;
    resolved jsonb;
BEGIN
    IF jsonb_typeof(value) IS DISTINCT FROM 'object' OR NOT value ? '__outbox_blob__'
       OR jsonb_typeof(value->'__outbox_blob__'->'sha256') IS DISTINCT FROM 'string'
       OR (SELECT count(*) FROM jsonb_object_keys(value)) <> 1 THEN
        RETURN value;
    END IF;
    sha := value->'__outbox_blob__'->>'sha256';
    SELECT b.data::jsonb INTO resolved FROM outbox_blobs AS b WHERE b.sha256 = sha;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'stored value sha256=% is missing from outbox_blobs', sha;
    END IF;
    RETURN resolved;
END
$$;

-- A top-level object shaped like a reference is refused: it would be read back
-- as another value (outbox.blobs.store_value).
CREATE FUNCTION outbox_check_not_reference(field text, value jsonb) RETURNS void
    LANGUAGE plpgsql AS $$
BEGIN
    IF jsonb_typeof(value) = 'object' AND value ? '__outbox_blob__' THEN
        PERFORM outbox_refuse('OB002', field, '<object with ''__outbox_blob__''>',
                              '''__outbox_blob__'' is reserved');
    END IF;
END
$$;

-- The state of (run_id, step_id) in this transaction. The first time a step is
-- met, the run must exist and accept steps, and the step must not be recorded
-- yet; a step already committed in this transaction takes no more writes.
CREATE OR REPLACE FUNCTION outbox_tx_step(p_run_id uuid, p_step_id text) RETURNS jsonb
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
    IF NOT FOUND OR NOT run_status = ANY (outbox_active_run_statuses()) THEN
        -- missing, paused (it takes no steps until resumed) or ended
        PERFORM outbox_raise_run_refusal(p_run_id);
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
-- Approval gates (0010) hold an intent as awaiting_approval; a dry run's goes
-- to the dry-run namespace. priority and fairness_key default to the run's (0
-- and '' without a run); an intent of a paused run is held as paused; a payload over
-- outbox.blob_threshold_bytes is stored by reference.
DROP FUNCTION outbox_intend(text, jsonb, text, text, uuid, text, integer, integer,
                            double precision, integer, jsonb, numeric, jsonb);
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
    priority integer DEFAULT NULL,
    fairness_key text DEFAULT NULL,
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
    lane record;
    p_kind text := outbox_intend.kind;
    dry boolean := false;
    policy jsonb;
    stored jsonb;
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
    PERFORM outbox_check_lane(outbox_intend.priority, outbox_intend.fairness_key);
    PERFORM outbox_check_not_reference('payload', outbox_intend.payload);
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
        -- the run's lane; a pause already set holds the intent (outbox_commit_step
        -- holds it too when a pause commits while this transaction runs)
        SELECT r.priority, r.fairness_key, r.paused_at IS NOT NULL AS paused, r.dry_run
          INTO lane FROM outbox_runs AS r WHERE r.id = outbox_intend.run_id;
    ELSE
        p_key := coalesce(p_key, replace(gen_random_uuid()::text, '-', ''));
        SELECT 0 AS priority, '' AS fairness_key, false AS paused, false AS dry_run INTO lane;
    END IF;
    dry := coalesce(lane.dry_run, false);
    IF dry THEN
        -- A dry run's intents are served by the recording deliverer, never a sink
        -- (outbox.runs.intents does the same), and ask for no approval.
        p_kind := (outbox_reserved_kind_prefixes())[1] || p_kind;
        IF outbox_intend.key IS NOT NULL THEN
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
    stored := outbox_store_value(coalesce(outbox_intend.run_id, new_id), outbox_intend.payload,
                                 canonical);

    INSERT INTO outbox_effects AS e (
        id, run_id, step_id, step_index, kind, payload, payload_hash, schema_version,
        idempotency_key, ordering_key, max_attempts, compensate, cost, priority, fairness_key,
        status, available_at, approval, approval_deadline)
    VALUES (
        new_id, outbox_intend.run_id, outbox_intend.step_id, idx, p_kind,
        stored, p_hash, outbox_intend.schema_version, p_key,
        outbox_intend.ordering_key, outbox_intend.max_attempts, outbox_intend.compensate,
        outbox_intend.cost, coalesce(outbox_intend.priority, lane.priority),
        coalesce(outbox_intend.fairness_key, lane.fairness_key),
        CASE WHEN policy IS NOT NULL THEN 'awaiting_approval'
             WHEN lane.paused THEN 'paused' ELSE 'pending' END,
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
        IF NOT (existing.payload_hash = p_hash
                OR outbox_resolve(existing.payload) = outbox_intend.payload) THEN
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
-- commits with the caller's transaction, or none of it.
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
    stored_result jsonb;
    stored_state jsonb;
    stored_plan jsonb;
    run_paused boolean;
    head bytea;
    p_result jsonb;
BEGIN
    IF outbox_commit_step.step_kind IS NULL OR outbox_commit_step.step_kind NOT IN ('transaction', 'call') THEN
        PERFORM outbox_refuse('OB001', 'step_kind', outbox_commit_step.step_kind,
            'must be transaction or call');
    END IF;
    -- values over outbox.blob_threshold_bytes are stored by reference, owned by the run
    IF outbox_commit_step.result IS NOT NULL THEN
        PERFORM outbox_check_not_reference('result', outbox_commit_step.result);
        stored_result := outbox_store_value(outbox_commit_step.run_id, outbox_commit_step.result,
            outbox_check_json('result', outbox_commit_step.result, max_bytes));
    END IF;
    IF outbox_commit_step.state IS NOT NULL THEN
        PERFORM outbox_check_not_reference('state', outbox_commit_step.state);
        stored_state := outbox_store_value(outbox_commit_step.run_id, outbox_commit_step.state,
            outbox_check_json('state', outbox_commit_step.state, max_bytes));
    END IF;
    IF outbox_commit_step.plan IS NOT NULL THEN
        PERFORM outbox_check_not_reference('plan', outbox_commit_step.plan);
        stored_plan := outbox_store_value(outbox_commit_step.run_id, outbox_commit_step.plan,
            outbox_check_json('plan', outbox_commit_step.plan, max_bytes));
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
                             'delay_seconds', 'schema_version', 'compensate', 'cost', 'approval',
                             'priority', 'fairness_key')
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
                approval => item->'approval',
                priority => (item->>'priority')::integer,
                fairness_key => item->>'fairness_key');
            effect_ids := effect_ids || made.effect_id;
            n := n + 1;
        END LOOP;
        tx_step := outbox_tx_steps()->outbox_tx_step_slot(outbox_commit_step.run_id, outbox_commit_step.step_id);
    END IF;

    -- the step chain hashes the result as stored (a reference for a large one), as Python does
    p_result := coalesce(stored_result, 'null'::jsonb);
    UPDATE outbox_runs AS r
       SET state = coalesce(stored_state, r.state),
           plan = coalesce(stored_plan, r.plan),
           current_step = outbox_commit_step.step_id,
           spent = r.spent + (tx_step->>'debit')::numeric,
           reserved = r.reserved + (tx_step->>'reserve')::numeric,
           -- the run's step chain (see outbox/storage/governance_ddl.py)
           step_head = outbox_step_hash(
               coalesce(r.step_head, outbox_run_genesis(r.id, r.agent, r.inputs_hash)),
               r.id, outbox_commit_step.step_id, outbox_commit_step.step_kind, p_result, NULL, now())
           -- updated_at is left alone: a step's update must stay HOT (see sql/steps.py)
     WHERE r.id = outbox_commit_step.run_id
       AND r.status = ANY (outbox_active_run_statuses())
       AND (r.budget IS NULL
            OR r.spent + r.reserved + (tx_step->>'debit')::numeric + (tx_step->>'reserve')::numeric <= r.budget)
    RETURNING r.paused_at IS NOT NULL, r.step_head INTO run_paused, head;
    IF NOT FOUND THEN
        SELECT r.status, r.budget, r.spent, r.reserved INTO found_run
          FROM outbox_runs AS r WHERE r.id = outbox_commit_step.run_id;
        IF NOT FOUND OR NOT found_run.status = ANY (outbox_active_run_statuses()) THEN
            PERFORM outbox_raise_run_refusal(outbox_commit_step.run_id);
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

    -- the step keeps the state and plan it set, so a fork can start from it
    INSERT INTO outbox_steps AS s (run_id, step_id, kind, result, state, plan, hash)
    VALUES (outbox_commit_step.run_id, outbox_commit_step.step_id, outbox_commit_step.step_kind,
            p_result, stored_state, stored_plan, head)
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
    -- A pause (outbox runs pause locks the run row FOR UPDATE) cannot commit
    -- after this step's first intent: the intent's foreign key holds the row
    -- (KEY SHARE) until this transaction ends, so each intent saw any pause
    -- already committed and was written paused. Only a pause set without that
    -- lock leaves pending intents here; they are held with the run's others.
    IF run_paused AND EXISTS (
           SELECT 1 FROM outbox_effects AS e
            WHERE e.run_id = outbox_commit_step.run_id AND e.step_id = outbox_commit_step.step_id
              AND e.status = 'pending') THEN
        UPDATE outbox_effects AS e SET status = 'paused'
         WHERE e.run_id = outbox_commit_step.run_id AND e.step_id = outbox_commit_step.step_id
           AND e.status = 'pending';
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

-- Start a run of agent pinned to version, with immutable inputs; returns its
-- id. Starting again with the same run_id, agent, version and inputs returns
-- the same run (a retried start is harmless); anything else is refused (OB001).
-- key (a business key) starts one run per key: with the same agent, version and
-- inputs a second start returns the existing run's id (on_conflict
-- 'return_existing') or is refused with OB010 ('reject'); with others it is
-- OB003. Workers claim higher priority first and share capacity between
-- fairness keys; the run's intents inherit both. Inputs over
-- outbox.blob_threshold_bytes are stored by reference.
DROP FUNCTION outbox_start_run(text, text, jsonb, numeric, uuid);
CREATE FUNCTION outbox_start_run(
    agent text,
    version text,
    inputs jsonb DEFAULT NULL,
    budget numeric DEFAULT NULL,
    run_id uuid DEFAULT NULL,
    key text DEFAULT NULL,
    on_conflict text DEFAULT 'return_existing',
    priority integer DEFAULT 0,
    fairness_key text DEFAULT ''
) RETURNS uuid
    LANGUAGE plpgsql AS $$
DECLARE
    rules jsonb := outbox_intent_rules();
    p_inputs jsonb := coalesce(outbox_start_run.inputs, 'null'::jsonb);
    p_id uuid := coalesce(outbox_start_run.run_id, outbox_uuid7());
    canonical text;
    p_hash text;
    stored jsonb;
    started uuid;
    existing record;
BEGIN
    PERFORM outbox_check_text('agent', outbox_start_run.agent, (rules->>'max_agent_length')::integer);
    PERFORM outbox_check_text('version', outbox_start_run.version, (rules->>'max_version_length')::integer);
    PERFORM outbox_check_not_reference('inputs', p_inputs);
    canonical := outbox_check_json('inputs', p_inputs, outbox_setting('max_payload_bytes')::integer);
    PERFORM outbox_check_amount('budget', outbox_start_run.budget);
    PERFORM outbox_check_text('key', outbox_start_run.key, (rules->>'max_key_length')::integer, false);
    IF outbox_start_run.on_conflict IS NULL
       OR outbox_start_run.on_conflict NOT IN ('return_existing', 'reject') THEN
        PERFORM outbox_refuse('OB001', 'on_conflict', outbox_start_run.on_conflict,
            'must be return_existing or reject');
    END IF;
    IF outbox_start_run.priority IS NULL THEN
        PERFORM outbox_refuse('OB001', 'priority', NULL, 'is required');
    END IF;
    IF outbox_start_run.fairness_key IS NULL THEN
        PERFORM outbox_refuse('OB001', 'fairness_key', NULL, 'is required ('''' for none)');
    END IF;
    PERFORM outbox_check_lane(outbox_start_run.priority, outbox_start_run.fairness_key);
    p_hash := encode(sha256(convert_to(canonical, 'UTF8')), 'hex');
    -- (a start answered with another run leaves this reference ownerless: gc takes it)
    stored := outbox_store_value(p_id, p_inputs, canonical);
    -- no conflict target: the id and the business key are both unique
    INSERT INTO outbox_runs AS r (id, agent, agent_version, inputs, inputs_hash, status, budget,
                                  key, priority, fairness_key)
    VALUES (p_id, outbox_start_run.agent, outbox_start_run.version, stored, p_hash, 'runnable',
            outbox_start_run.budget, outbox_start_run.key, outbox_start_run.priority,
            outbox_start_run.fairness_key)
    ON CONFLICT DO NOTHING
    RETURNING r.id INTO started;
    IF started IS NULL THEN
        SELECT r.id, r.agent, r.agent_version, r.inputs, r.inputs_hash INTO existing
          FROM outbox_runs AS r WHERE r.id = p_id;
        IF FOUND THEN
            IF existing.agent <> outbox_start_run.agent
               OR existing.agent_version <> outbox_start_run.version
               OR NOT (existing.inputs_hash = p_hash OR outbox_resolve(existing.inputs) = p_inputs) THEN
                PERFORM outbox_refuse('OB001', 'run_id', p_id::text,
                    'names a run started with another agent, version or inputs');
            END IF;
            RETURN p_id;
        END IF;
        SELECT r.id, r.agent, r.agent_version, r.inputs, r.inputs_hash INTO existing
          FROM outbox_runs AS r WHERE r.key = outbox_start_run.key;
        IF NOT FOUND THEN
            PERFORM outbox_raise_conflict(outbox_start_run.key,
                'started concurrently by another transaction');
        END IF;
        IF existing.agent <> outbox_start_run.agent
           OR existing.agent_version <> outbox_start_run.version
           OR NOT (existing.inputs_hash = p_hash OR outbox_resolve(existing.inputs) = p_inputs) THEN
            PERFORM outbox_raise_conflict(outbox_start_run.key,
                format('run %s was started with this key as %s %s with other inputs',
                       existing.id, existing.agent, existing.agent_version));
        END IF;
        IF outbox_start_run.on_conflict = 'reject' THEN
            PERFORM outbox_raise_run_exists(outbox_start_run.key, existing.id);
        END IF;
        RETURN existing.id;
    END IF;
    PERFORM outbox_wake('outbox_runs');
    RETURN p_id;
END
$$;

-- End a live run as completed (with an optional result) or failed (with an error).
-- A paused run is refused (OB009): resume it first. Values over
-- outbox.blob_threshold_bytes are stored by reference.
CREATE OR REPLACE FUNCTION outbox_finish_run(run_id uuid, status text, result jsonb DEFAULT NULL,
                                  error jsonb DEFAULT NULL) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    max_bytes integer := outbox_setting('max_payload_bytes')::integer;
    stored_result jsonb;
    stored_error jsonb;
BEGIN
    IF outbox_finish_run.status IS NULL OR outbox_finish_run.status NOT IN ('completed', 'failed') THEN
        PERFORM outbox_refuse('OB001', 'status', outbox_finish_run.status, 'must be completed or failed');
    END IF;
    IF outbox_finish_run.result IS NOT NULL THEN
        PERFORM outbox_check_not_reference('result', outbox_finish_run.result);
        stored_result := outbox_store_value(outbox_finish_run.run_id, outbox_finish_run.result,
            outbox_check_json('result', outbox_finish_run.result, max_bytes));
    END IF;
    IF outbox_finish_run.error IS NOT NULL THEN
        PERFORM outbox_check_not_reference('error', outbox_finish_run.error);
        stored_error := outbox_store_value(outbox_finish_run.run_id, outbox_finish_run.error,
            outbox_check_json('error', outbox_finish_run.error, max_bytes));
    END IF;
    UPDATE outbox_runs AS r
       SET status = outbox_finish_run.status, result = stored_result,
           error = stored_error, lease_owner = NULL, lease_expires_at = NULL,
           updated_at = now()
     WHERE r.id = outbox_finish_run.run_id AND r.status = ANY (outbox_active_run_statuses());
    IF NOT FOUND THEN
        PERFORM outbox_raise_run_refusal(outbox_finish_run.run_id);
    END IF;
END
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
    SELECT r.status INTO run_status FROM outbox_runs AS r WHERE r.id = outbox_signal.run_id FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM outbox_raise_run_not_found(outbox_signal.run_id);
    END IF;
    IF NOT run_status = ANY (outbox_live_run_statuses()) THEN
        PERFORM outbox_raise_run_ended(outbox_signal.run_id, run_status);
    END IF;
    INSERT INTO outbox_signals AS s (id, run_id, name, payload, dedup_key)
    VALUES (outbox_uuid7(), outbox_signal.run_id, outbox_signal.name,
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

-- A recorded step (what a replay returns): one row, or none when not recorded.
CREATE OR REPLACE FUNCTION outbox_step(run_id uuid, step_id text)
    RETURNS TABLE (step_kind text, status text, result jsonb, error jsonb, seq bigint,
                   completed_at timestamptz)
    LANGUAGE sql STABLE AS $$
SELECT s.kind, s.status, outbox_resolve(s.result), outbox_resolve(s.error), s.seq, s.completed_at
  FROM outbox_steps AS s
 WHERE s.run_id = outbox_step.run_id AND s.step_id = outbox_step.step_id
$$;

-- A run as stored: one row, or none when no run has this id.
CREATE OR REPLACE FUNCTION outbox_run_status(run_id uuid)
    RETURNS TABLE (id uuid, agent text, agent_version text, status text, inputs jsonb, state jsonb,
                   plan jsonb, current_step text, result jsonb, error jsonb, budget numeric,
                   spent numeric, reserved numeric, created_at timestamptz, updated_at timestamptz)
    LANGUAGE sql STABLE AS $$
SELECT r.id, r.agent, r.agent_version, r.status, outbox_resolve(r.inputs), outbox_resolve(r.state),
       outbox_resolve(r.plan), r.current_step, outbox_resolve(r.result), outbox_resolve(r.error),
       r.budget, r.spent, r.reserved, r.created_at, r.updated_at
  FROM outbox_runs AS r WHERE r.id = outbox_run_status.run_id
$$;
