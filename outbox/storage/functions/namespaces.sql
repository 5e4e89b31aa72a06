-- A login confined to a namespace (`outbox roles --namespace NS`): the group roles
-- made for NS carry the role setting outbox.namespace=NS, and a login in one of
-- them may touch only NS's runs, effects and what belongs to them. The tables'
-- row-level security policies say so for statements a login sends itself (with
-- NS as a constant: `outbox roles` writes them); these functions say so where a
-- policy cannot: in the SECURITY DEFINER step writers, which run as the tables'
-- owner, and for the tables that name their run but not its namespace.
--
-- The setting is read from the catalog, never from the session (a login may SET
-- any outbox.* it likes), for the login (session_user) and for the role it SET
-- ROLE to: a login cannot shed its confinement by switching to a group of its
-- own. Superusers are confined by nothing (pg_has_role is true for them of every
-- role). Catalogs are on every node, so on Citus this reads the same on a worker.

-- The namespaces that confine this session: one per confining group role it is
-- in (a login in two namespaces' groups records steps in neither), NULL when none
-- does.
CREATE OR REPLACE FUNCTION outbox_session_namespaces() RETURNS text[]
    LANGUAGE sql STABLE AS $$
SELECT array_agg(DISTINCT substr(c.setting, length('outbox.namespace=') + 1))
  FROM pg_catalog.pg_db_role_setting AS s, unnest(s.setconfig) AS c(setting)
 WHERE s.setdatabase = 0 AND s.setrole <> 0 AND c.setting LIKE 'outbox.namespace=%'
   AND EXISTS (SELECT FROM pg_catalog.pg_roles AS u
                WHERE u.rolname IN (session_user, nullif(current_setting('role'), 'none'))
                  AND NOT u.rolsuper AND pg_has_role(u.oid, s.setrole, 'USAGE'))
$$;

-- Whether no namespace can confine this session, from cached lookups only (a few
-- microseconds; outbox_session_namespaces reads the role settings, 60-70 us): no
-- role is confined at all; a superuser login that did not SET ROLE (confined by
-- nothing: outbox_session_namespaces leaves superusers out); a session whose login
-- and role are in no role of outbox_confined, which every group role `outbox roles
-- --namespace` confines is in (a role given outbox.namespace by hand confines
-- nothing, as through the tables' policies). is_superuser and role are the
-- session's, read-only but through SET ROLE, which checks membership.
CREATE OR REPLACE FUNCTION outbox_session_unconfined() RETURNS boolean
    LANGUAGE sql STABLE AS $$
SELECT CASE WHEN to_regrole('outbox_confined') IS NULL THEN true
            WHEN current_setting('role') = 'none' AND current_setting('is_superuser') = 'on'
                THEN true
            ELSE NOT pg_has_role(session_user, to_regrole('outbox_confined'), 'USAGE')
                 AND NOT coalesce(pg_has_role(
                     to_regrole(quote_ident(nullif(current_setting('role'), 'none'))),
                     to_regrole('outbox_confined'), 'USAGE'), false) END
$$;

-- A step writer's (outbox_write_step, chain_writes.sql) check of its caller: the
-- run p_run_id is in every namespace that confines the session, or permission is
-- denied naming both. Every step pays for it: for a session no namespace can
-- confine, cached lookups (outbox_session_unconfined); the settings and the run
-- are read only for a session in a confined role. By dynamic SQL: planned per call
-- on Citus, where a kept plan on a worker's shard grows
-- (outbox_citus_plans_per_call).
CREATE OR REPLACE FUNCTION outbox_confined_to_run(p_shard smallint, p_run_id uuid) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    confined text[];
    ns text;
BEGIN
    IF outbox_session_unconfined() THEN
        RETURN;
    END IF;
    confined := outbox_session_namespaces();
    IF confined IS NULL THEN
        RETURN;
    END IF;
    EXECUTE 'SELECT r.namespace FROM outbox_runs AS r WHERE r.id = $1 AND r.shard = $2'
       INTO ns USING p_run_id, p_shard;
    IF ns IS NOT NULL AND NOT ns = ALL (confined) THEN
        RAISE EXCEPTION 'permission denied: role % is confined to namespace %, and run % is in '
                        'namespace %', coalesce(nullif(current_setting('role'), 'none'),
                                                session_user::text),
            array_to_string(confined, ', '), p_run_id, ns
            USING ERRCODE = 'insufficient_privilege';
    END IF;
END
$$;

-- Whether the SECURITY DEFINER checks the policies call (here, insert_checks.sql,
-- effect_guards.sql) may tell this session about rows of namespace p_namespace:
-- any session no namespace confines, a confined one only about its own. Every
-- login may call those checks directly, and they read as the tables' owner:
-- asked about another namespace they would tell a confined login what its
-- policies hide (that a run exists, is live, paused or stopping, what an effect
-- declared). A policy calls them once a row (a confined reader's every step), so
-- the common answers come from cached role lookups, not outbox_session_namespaces
-- (60-70 us a call): no confined role at all; a session in no role of
-- outbox_confined (which every role `outbox roles --namespace` confines is in: one
-- that is not sees every row through the policies anyway); a confined session
-- asking about its own namespace (one role setting it is in, about 5 us).
CREATE OR REPLACE FUNCTION outbox_session_sees(p_namespace text) RETURNS boolean
    LANGUAGE plpgsql STABLE AS $$
DECLARE
    confined oid := to_regrole('outbox_confined');
    switched oid := to_regrole(quote_ident(nullif(current_setting('role'), 'none')));
BEGIN
    IF outbox_session_unconfined() THEN
        RETURN true;
    END IF;
    -- (only the group roles `outbox roles --namespace` made, which are members of
    -- outbox_confined themselves: a role given the setting by hand confines nothing
    -- through the policies, so a login in one is told nothing of its namespace)
    IF EXISTS (SELECT FROM pg_catalog.pg_db_role_setting AS s
                WHERE s.setdatabase = 0 AND s.setrole <> 0
                  AND 'outbox.namespace=' || p_namespace = ANY (s.setconfig)
                  AND EXISTS (SELECT FROM pg_catalog.pg_auth_members AS m
                               WHERE m.roleid = confined AND m.member = s.setrole)
                  AND (pg_has_role(session_user, s.setrole, 'USAGE')
                       OR coalesce(pg_has_role(switched, s.setrole, 'USAGE'), false))) THEN
        RETURN true;
    END IF;
    RETURN outbox_session_namespaces() IS NULL;
END
$$;

-- Whether the row p_id of table p_table (outbox_runs or outbox_effects) on shard
-- p_shard is in namespace p_namespace: the policy, for a login confined to
-- p_namespace, of a table that names its run or effect but not its namespace
-- (steps, signals, budget ledger; the attempt log). As the tables' owner (the
-- login may not read the row it asks about); no such row is in no namespace, and
-- to a confined session no row is in another namespace (outbox_session_sees).
-- On Citus the row is read from its placement on this node, with the row asked
-- about (co-located): see insert_checks.sql.
CREATE OR REPLACE FUNCTION outbox_row_in_namespace(
    p_table regclass, p_shard smallint, p_id uuid, p_namespace text
) RETURNS boolean
    LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    ns text;
BEGIN
    IF p_table NOT IN ('outbox_runs'::regclass, 'outbox_effects'::regclass) THEN
        RAISE EXCEPTION 'outbox_row_in_namespace: not a table with a namespace: %', p_table;
    END IF;
    IF NOT outbox_session_sees(p_namespace) THEN
        RETURN false;
    END IF;
    EXECUTE format('SELECT t.namespace FROM %s AS t WHERE t.id = $1 AND t.shard = $2',
                   outbox_placement_of(p_table, p_shard))
       INTO ns USING p_id, p_shard;
    RETURN coalesce(ns = p_namespace, false);
END
$$;

-- Whether the stored value p_sha on shard p_shard is one a login confined to
-- namespace p_namespace may read: a run or a run-less effect of the namespace uses
-- it (outbox_blob_refs), or its own transaction recorded a use of it (a run's
-- inputs are stored before the run is). The policy of outbox_blobs for such a
-- login. A value is stored once for every namespace that stored the same text;
-- each reads it through a use of its own (a confined login read every
-- namespace's large payloads, inputs and results). As outbox_row_in_namespace:
-- as the tables' owner, from this node's placements, and false to a confined
-- session asking about another namespace.
CREATE OR REPLACE FUNCTION outbox_blob_in_namespace(
    p_shard smallint, p_sha text, p_namespace text
) RETURNS boolean
    LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    used boolean;
BEGIN
    IF NOT outbox_session_sees(p_namespace) THEN
        RETURN false;
    END IF;
    EXECUTE format(
        'SELECT EXISTS (SELECT FROM %s AS f WHERE f.sha256 = $1 AND f.shard = $2 AND ('
        ' outbox_written_here(f.written_in)'
        ' OR EXISTS (SELECT FROM %s AS r'
        '             WHERE r.id = f.owner AND r.shard = $2 AND r.namespace = $3)'
        ' OR EXISTS (SELECT FROM %s AS e'
        '             WHERE e.id = f.owner AND e.shard = $2 AND e.namespace = $3)))',
        outbox_placement_of('outbox_blob_refs', p_shard),
        outbox_placement_of('outbox_runs', p_shard),
        outbox_placement_of('outbox_effects', p_shard))
       INTO used USING p_sha, p_shard, p_namespace;
    RETURN used;
END
$$;
