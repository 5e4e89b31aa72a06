CREATE OR REPLACE FUNCTION outbox_gate_condition(cond jsonb, payload jsonb) RETURNS boolean
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

CREATE OR REPLACE FUNCTION outbox_gate_matches(conditions jsonb, payload jsonb) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT coalesce(bool_and(outbox_gate_condition(c, payload)), true)
FROM jsonb_array_elements(conditions) AS c
$$;
