-- Raise error code with message; detail is a JSON object of the error's fields
-- (clients build their typed errors from it: docs/sql-api.md, "Errors").
CREATE OR REPLACE FUNCTION outbox_raise(code text, message text, detail jsonb) RETURNS void
    LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION USING ERRCODE = code, MESSAGE = message, DETAIL = detail::text;
END
$$;

-- Refuse an argument (OB001) or a JSON value (OB002), naming the field and
-- showing the value as outbox.errors.ValidationError does; rule is the
-- outbox.intent_rules code when one applies.
CREATE OR REPLACE FUNCTION outbox_refuse(code text, field text, value text, reason text,
                              rule text DEFAULT NULL) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    shown text := CASE WHEN value IS NULL THEN 'NULL'
                       WHEN char_length(value) > 77 THEN quote_literal(left(value, 74)) || '...'
                       ELSE quote_literal(value) END;
BEGIN
    RAISE EXCEPTION USING ERRCODE = code, MESSAGE = field || '=' || shown || ': ' || reason,
        COLUMN = field,
        DETAIL = jsonb_strip_nulls(jsonb_build_object(
            'field', field, 'value', left(value, 200), 'reason', reason, 'rule', rule))::text;
END
$$;

CREATE OR REPLACE FUNCTION outbox_raise_conflict(key text, reason text) RETURNS void
    LANGUAGE sql AS $$
SELECT outbox_raise('OB003', format('idempotency_key=%L: %s', key, reason),
                    jsonb_build_object('key', key, 'reason', reason))
$$;

CREATE OR REPLACE FUNCTION outbox_raise_run_not_found(run_id uuid) RETURNS void
    LANGUAGE sql AS $$
SELECT outbox_raise('OB004', format('run_id=%L: no such run', run_id),
                    jsonb_build_object('run_id', run_id))
$$;

CREATE OR REPLACE FUNCTION outbox_raise_run_ended(run_id uuid, status text) RETURNS void
    LANGUAGE sql AS $$
SELECT outbox_raise('OB005',
                    format('run_id=%L is %s: a terminal run accepts no more work', run_id, status),
                    jsonb_build_object('run_id', run_id, 'status', status))
$$;

CREATE OR REPLACE FUNCTION outbox_raise_step_recorded(run_id uuid, step_id text) RETURNS void
    LANGUAGE sql AS $$
SELECT outbox_raise('OB006',
                    format('step_id=%L of run %s is already recorded: roll back and read its result '
                           'with outbox_step()', step_id, run_id),
                    jsonb_build_object('run_id', run_id, 'step_id', step_id))
$$;

CREATE OR REPLACE FUNCTION outbox_raise_run_paused(run_id uuid, reason text) RETURNS void
    LANGUAGE sql AS $$
SELECT outbox_raise('OB009',
                    format('run_id=%L is paused%s: resume it first', run_id,
                           coalesce(' (' || reason || ')', '')),
                    jsonb_strip_nulls(jsonb_build_object('run_id', run_id, 'reason', reason)))
$$;

CREATE OR REPLACE FUNCTION outbox_raise_run_exists(key text, run_id uuid) RETURNS void
    LANGUAGE sql AS $$
SELECT outbox_raise('OB010',
                    format('key=%L: run %s was already started with this key', key, run_id),
                    jsonb_build_object('key', key, 'run_id', run_id))
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
