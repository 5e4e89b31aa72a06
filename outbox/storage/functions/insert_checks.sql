-- What `outbox roles` checks of a login's own inserts into outbox_effects (the
-- intents policy of each role prefix, outbox/storage/admin/roles.py): functions
-- of the row's columns, each reading what it needs on the row's own node. On
-- Citus a policy runs inside a query on a shard, which may not query a
-- distributed or reference table ("cannot execute a distributed query from a
-- query on a shard"): each reads the placement its node holds by name
-- (outbox_placement_of), by dynamic SQL (planned per call: a kept plan on a
-- worker's shard grows, outbox_citus_plans_per_call). As the tables' owner: the
-- login need not read what its insert is checked against.

-- Where this node holds the rows of p_table on shard p_shard (NULL: a reference
-- table's one shard): on Citus its placement here, by name, when it is here;
-- else p_table itself.
CREATE OR REPLACE FUNCTION outbox_placement_of(p_table regclass, p_shard smallint)
    RETURNS regclass
    LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF NOT outbox_distributed() THEN
        RETURN p_table;
    END IF;
    -- (apart: on one server shard_name does not parse)
    RETURN coalesce(to_regclass(shard_name(p_table,
        CASE WHEN p_shard IS NULL THEN get_shard_id_for_distribution_column(p_table)
             ELSE get_shard_id_for_distribution_column(p_table, p_shard) END)), p_table);
END
$$;

-- An effect of p_kind with p_payload (on shard p_shard: a large payload's blob is
-- there) that no configured gate holds, or one held for approval: a hand-written
-- INSERT is judged by the gates as the step's statement judges an intent. A
-- payload whose stored value is missing is not cleared.
CREATE OR REPLACE FUNCTION outbox_intent_gated(
    p_kind text, p_payload jsonb, p_status text, p_approval jsonb, p_shard smallint
) RETURNS boolean
    LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    gates jsonb;
    payload jsonb := p_payload;
    sha text := outbox_reference_sha(p_payload);
BEGIN
    IF p_status = 'awaiting_approval' AND p_approval IS NOT NULL THEN
        RETURN true;
    END IF;
    EXECUTE format('SELECT coalesce(jsonb_agg(outbox_gate_json(g.name, g.kind, g.conditions,'
                   ' g.timeout_seconds, g.on_timeout, g.escalate_to) ORDER BY g.name), ''[]'')'
                   ' FROM %s AS g WHERE g.kind = $1', outbox_placement_of('outbox_gates', NULL))
       INTO gates USING p_kind;
    IF gates = '[]' THEN
        RETURN true;
    ELSIF sha IS NOT NULL THEN
        EXECUTE format('SELECT b.data::jsonb FROM %s AS b WHERE b.sha256 = $1 AND b.shard = $2',
                       outbox_placement_of('outbox_blobs', p_shard))
           INTO payload USING sha, p_shard;
        IF payload IS NULL THEN
            RETURN false;
        END IF;
    END IF;
    RETURN outbox_gate_hold_in(gates, p_kind, payload) IS NULL;
END
$$;

-- An intent (an effect with p_status, in namespace p_namespace) of run p_run that
-- the run takes: a live run's of that namespace (a paused run's only paused or
-- held); an intent of no run, always. None of a namespace that does not confine
-- the session (outbox_session_sees): called directly, it would tell whether
-- another namespace's run is live.
CREATE OR REPLACE FUNCTION outbox_intent_of_live_run(p_run uuid, p_status text, p_namespace text)
    RETURNS boolean
    LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    taken boolean;
BEGIN
    IF NOT outbox_session_sees(p_namespace) THEN
        RETURN false;
    ELSIF p_run IS NULL THEN
        RETURN true;
    END IF;
    EXECUTE format('SELECT r.status = ANY (outbox_active_run_statuses() || ''{paused}'')'
                   '   AND (r.paused_at IS NULL OR $3 <> ''pending'') AND r.namespace = $4'
                   '  FROM %s AS r WHERE r.id = $1 AND r.shard = $2',
                   outbox_placement_of('outbox_runs', outbox_shard_of(p_run)))
       INTO taken USING p_run, outbox_shard_of(p_run), p_status, p_namespace;
    RETURN coalesce(taken, false);
END
$$;

-- A compensation (p_kind, p_payload, in namespace p_namespace) of effect
-- p_original of run p_run, as that effect declared it, once it succeeded and
-- while the run is being stopped: the one insert a deliverer or an operator
-- makes into outbox_effects. None of a namespace that does not confine the
-- session (outbox_session_sees): called directly, it would tell whether another
-- namespace's effect succeeded, what it declared, and that its run is stopping.
CREATE OR REPLACE FUNCTION outbox_compensation_declared(
    p_original uuid, p_run uuid, p_kind text, p_payload jsonb, p_namespace text
) RETURNS boolean
    LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    shard smallint := outbox_shard_of(p_run);
    declared boolean;
BEGIN
    IF NOT outbox_session_sees(p_namespace) THEN
        RETURN false;
    END IF;
    EXECUTE format('SELECT EXISTS (SELECT 1 FROM %s AS o JOIN %s AS r'
                   '    ON r.id = o.run_id AND r.shard = o.shard'
                   ' WHERE o.id = $1 AND o.run_id = $2 AND o.shard = $3 AND o.namespace = $6'
                   '   AND o.compensates IS NULL AND o.status = ''succeeded'''
                   '   AND r.status IN (''cancelling'', ''compensating'')'
                   '   AND o.compensate ->> ''kind'' = $4 AND o.compensate -> ''payload'' = $5)',
                   outbox_placement_of('outbox_effects', shard),
                   outbox_placement_of('outbox_runs', shard))
       INTO declared USING p_original, p_run, shard, p_kind, p_payload, p_namespace;
    RETURN declared;
END
$$;

-- Whether the session's role is one whose inserts into outbox_effects some role
-- prefix's intents policy checks (`outbox roles` names its agent, deliverer and
-- operator roles in one): the policy that lets every other role insert any row
-- leaves those to their own. Read from the catalog, once a statement (no column
-- in it: a one-time filter).
CREATE OR REPLACE FUNCTION outbox_session_inserts_checked() RETURNS boolean
    LANGUAGE sql STABLE SET search_path FROM CURRENT AS $$
SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_policy AS p, unnest(p.polroles) AS r(role)
                WHERE p.polrelid = 'outbox_effects'::regclass AND p.polcmd = 'a'
                  AND p.polname LIKE '%intents' AND r.role <> 0
                  AND pg_has_role(current_user, r.role, 'USAGE'))
$$;
