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
                    AND (v #>> '{}') ~ '^-?(0|[1-9][0-9]*)([.][0-9]+)?([eE][-+]?[0-9]{1,4})?$'
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

-- The approval a configured gate asks of an effect of p_kind with p_payload (the
-- first matching gate's, by name, as outbox_intent_effects decides a step's), or
-- NULL when no gate holds it. For what is written outside the step's statement:
-- the check `outbox roles` puts on every insert of its logins (a hand-written
-- INSERT skips no gate) and the compensations a stopping run intends.
CREATE OR REPLACE FUNCTION outbox_gate_hold(p_kind text, p_payload jsonb) RETURNS jsonb
    LANGUAGE sql STABLE AS $$
SELECT outbox_gate_hold_in(outbox_gates_of(ARRAY[p_kind]), p_kind, p_payload)
$$;

-- outbox_gate_hold among p_gates (outbox_gates_of's): a function of its arguments
-- alone, so Citus runs it on the shards in an INSERT ... SELECT.
CREATE OR REPLACE FUNCTION outbox_gate_hold_in(p_gates jsonb, p_kind text, p_payload jsonb)
    RETURNS jsonb
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT jsonb_build_object('gate', g.gate->>'name', 'timeout', g.gate->'timeout_seconds',
                          'on_timeout', g.gate->>'on_timeout',
                          'escalate_to', g.gate->>'escalate_to') || g.verdict
  FROM (SELECT gate, outbox_gate_match(gate->'conditions', p_payload) AS verdict
          FROM jsonb_array_elements(p_gates) AS gate WHERE gate->>'kind' = p_kind) AS g
 WHERE g.verdict IS NOT NULL
 ORDER BY g.gate->>'name' LIMIT 1
$$;
