-- Record step_id of run_id (on its shard, outbox_shard_of(run_id)) in the caller's
-- transaction: the one implementation of a step's checkpoint, for every client
-- (the Python client calls it too; SQL callers call outbox_commit_step, below).
--
-- SECURITY DEFINER (it runs as the tables' owner, its search path pinned as in
-- chain_writes.sql): it writes the run's chain head and the step's link, which
-- `outbox roles` grants no login; only a session whose login may insert into
-- outbox_steps may call it (outbox_raise_not_step_writer).
--
-- What it writes, all of it or none: the step's result; the run's new state and
-- plan (NULL keeps them); its intents (intents: a JSON array of outbox_intend's
-- arguments) and those outbox_intend wrote for this step earlier in the
-- transaction; its budget debits (spends: a JSON array of {"reason", "amount"},
-- and outbox_spend's) and the reservations of its intents' costs, with their
-- ledger entries. The step joins its run's hash chain (outbox_step_link), which
-- covers the ids, keys, kinds and payload hashes of the intents it created.
--
-- Refused, writing nothing: a run that is missing, paused or ended (OB004,
-- OB009, OB005), a step recorded before (OB006: roll back and replay it), a
-- budget that cannot cover the step (OB007), and with lease_owner and
-- lease_attempt (a worker's fence, G4) a run leased to someone else since
-- (OB011). paused is true when a pause waits for this step: its intents are
-- held as paused with the run's others.
--
-- wake: true sends the deliverers' NOTIFY if the step wrote a claimable intent,
-- false never, NULL leaves it to outbox_wake's shared window.
--
-- The common step (small values, intents the cheap checks of outbox_intent_rows
-- clear, nothing written for it earlier in the transaction) is one statement and
-- a handful of expressions: PL/pgSQL builds each expression's state anew in every
-- transaction, so the function keeps few. Anything else is checked exactly first
-- (outbox_check_step, outbox_check_intents, outbox_store_values), then written by
-- the same statement.
--
-- Its statements keep one generic plan from a session's first step: PostgreSQL
-- would plan the step statement afresh for each of a session's first five steps
-- (about 6.7 ms each, a plan of hundreds of nodes) before settling on the generic
-- plan it then keeps. A short-lived process paid that on every step.
CREATE OR REPLACE FUNCTION outbox_write_step(
    shard smallint,
    run_id uuid,
    step_id text,
    result jsonb DEFAULT NULL,
    state jsonb DEFAULT NULL,
    plan jsonb DEFAULT NULL,
    intents jsonb DEFAULT NULL,
    step_kind text DEFAULT 'transaction',
    spends jsonb DEFAULT NULL,
    lease_owner text DEFAULT NULL,
    lease_attempt integer DEFAULT NULL,
    wake boolean DEFAULT NULL,
    OUT step_seq bigint,
    OUT effect_ids uuid[],
    OUT paused boolean,
    OUT notify boolean
)
    LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT
    SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    -- what outbox_intend and outbox_spend wrote for this step in this transaction
    tx_step jsonb;
    debit numeric := 0;
    ledger jsonb := '[]';
    chain jsonb := '[]';
    stored jsonb[];
    firsts integer[];
    existing uuid[];
    p_intents jsonb := coalesce(nullif(intents, 'null'), '[]');
    screened boolean;
    run_ok boolean;
    rows outbox_intent[];
    claimable boolean;
    v_now timestamptz := now();
BEGIN
    -- It runs as the tables' owner (the only writer of the chain's columns besides
    -- chain_writes.sql): a login that could not record a step by hand cannot
    -- through it either, whatever EXECUTE it was left.
    IF NOT has_any_column_privilege(session_user, 'outbox_steps', 'INSERT') THEN
        PERFORM outbox_raise_not_step_writer();
    END IF;
    IF outbox_write_step.shard IS DISTINCT FROM outbox_shard_of(outbox_write_step.run_id) THEN
        PERFORM outbox_refuse('OB001', 'shard', outbox_write_step.shard::text,
            format('is not the shard of run_id %s (outbox_shard_of: %s)',
                   outbox_write_step.run_id, outbox_shard_of(outbox_write_step.run_id)));
    END IF;
    PERFORM outbox_confined_to_run(outbox_write_step.shard, outbox_write_step.run_id);
    IF current_setting('outbox.tx_steps', true) <> '' OR spends IS NOT NULL
       OR step_kind IS NULL OR step_kind NOT IN ('transaction', 'call')
       OR outbox_step_id_refused(outbox_write_step.step_id)
       OR (lease_owner IS NULL) <> (lease_attempt IS NULL) THEN
        tx_step := outbox_tx_steps()->outbox_tx_step_slot(outbox_write_step.run_id,
                                                          outbox_write_step.step_id);
        SELECT * INTO debit, ledger, chain
          FROM outbox_check_step(outbox_write_step.run_id, outbox_write_step.step_id, step_kind,
                                 lease_owner, lease_attempt, spends, tx_step);
    END IF;
    IF p_intents @? '$[*].ordering_key' THEN
        PERFORM outbox_lock_ordering_keys(p_intents);
    END IF;
    notify := false;
    IF outbox_distributed() THEN
        SELECT w.step_seq, w.effect_ids, w.paused, w.notify INTO step_seq, effect_ids, paused, notify
          FROM outbox_write_step_apart(outbox_write_step.shard, outbox_write_step.run_id,
            outbox_write_step.step_id, result, state, plan, p_intents, step_kind, lease_owner,
            lease_attempt, wake, tx_step, debit, ledger, chain) AS w;
        RETURN;
    END IF;
    LOOP
        -- one statement: the values and the intents derived, the run checked and
        -- moved on (a compare-and-set on its status, budget and, for a worker, its
        -- lease, with the chain's new head), the step recorded (a racer on the
        -- same step waited on the run's row and finds it recorded), the effects
        -- and the budget ledger written
        WITH v AS (
            SELECT coalesce(outbox_write_step.result, 'null')::text AS result_text,
                   outbox_write_step.state::text AS state_text,
                   outbox_write_step.plan::text AS plan_text
        ), agg AS (
            -- the gates of the step's kinds (outbox_gates_of's lookup), read here once
            -- and planned with the statement: as a call it costs about 80 us a step
            SELECT a.*, (SELECT coalesce(jsonb_agg(outbox_gate_json(g.name, g.kind,
                                   g.conditions, g.timeout_seconds, g.on_timeout, g.escalate_to)
                                   ORDER BY g.name), '[]')
                           FROM outbox_gates AS g WHERE g.kind = ANY (a.kinds)) AS gates
              FROM outbox_runs AS r, v, outbox_step_intents(outbox_write_step.run_id,
                outbox_write_step.step_id, p_intents, r.priority, r.fairness_key, r.dry_run,
                r.namespace, tx_step, firsts, existing, chain,
                stored IS NOT NULL OR outbox_values_screened(v.result_text, v.state_text,
                                                             v.plan_text)) AS a
             WHERE r.id = outbox_write_step.run_id AND r.shard = outbox_write_step.shard
        ), run_upd AS (
            UPDATE outbox_runs AS r
               SET state = coalesce(stored[2], outbox_write_step.state, r.state),
                   plan = coalesce(stored[3], outbox_write_step.plan, r.plan),
                   current_step = outbox_write_step.step_id,
                   step_count = r.step_count + 1,
                   spent = r.spent + debit,
                   reserved = r.reserved + agg.reserve,
                   step_head = outbox_step_link(
                       coalesce(r.step_head, outbox_run_genesis(r.id, r.agent, r.inputs_hash)),
                       r.id, outbox_write_step.step_id, step_kind, v.result_text, NULL,
                       v.state_text, v.plan_text, v_now, agg.chain_text)
                   -- updated_at is left alone: it is indexed, and a step's update must stay HOT
              FROM agg, v
             WHERE r.id = outbox_write_step.run_id AND r.shard = outbox_write_step.shard
               AND (agg.screened OR firsts IS NOT NULL)
               AND r.status = ANY (outbox_active_run_statuses())
               AND (r.budget IS NULL OR r.spent + r.reserved + debit + agg.reserve <= r.budget)
               AND (outbox_write_step.lease_owner IS NULL
                    OR (r.lease_owner = outbox_write_step.lease_owner
                        AND r.attempt = outbox_write_step.lease_attempt))
            RETURNING r.paused_at IS NOT NULL AS paused, r.step_head, r.step_count, r.namespace
        ), step_ins AS (
            -- the step keeps the state and plan it set, so a fork can start from it
            INSERT INTO outbox_steps AS s (run_id, shard, seq, step_id, kind, result, state, plan,
                                           hash)
            SELECT outbox_write_step.run_id, outbox_write_step.shard, u.step_count,
                   outbox_write_step.step_id, step_kind,
                   coalesce(stored[1], outbox_write_step.result, 'null'),
                   coalesce(stored[2], outbox_write_step.state),
                   coalesce(stored[3], outbox_write_step.plan), u.step_head
              FROM run_upd AS u
            ON CONFLICT ON CONSTRAINT outbox_steps_pkey DO NOTHING
            RETURNING s.seq
        ), effect_ins AS (
            INSERT INTO outbox_effects AS e (
                id, run_id, step_id, step_index, kind, payload, payload_hash, schema_version,
                idempotency_key, ordering_key, max_attempts, compensate, cost, priority,
                fairness_key, status, available_at, approval, approval_deadline, trace_parent,
                shard, namespace)
            SELECT h.*
              FROM step_ins, run_upd AS u, agg,
                   outbox_intent_effects(agg.rows, outbox_write_step.run_id,
                                         outbox_write_step.step_id, u.paused, u.namespace,
                                         agg.gates, v_now) AS h
            RETURNING e.status
        ), ledger_ins AS (
            INSERT INTO outbox_budget_ledger (run_id, shard, step_id, effect_id, reason, entry,
                                              amount)
            SELECT outbox_write_step.run_id, outbox_write_step.shard, outbox_write_step.step_id,
                   l.effect_id, l.reason, l.entry, l.amount
              FROM (SELECT * FROM jsonb_to_recordset(ledger)
                           AS l(entry text, reason text, amount numeric, effect_id uuid)
                    UNION ALL
                    SELECT 'reserve', i.kind, i.cost, i.id FROM agg, unnest(agg.rows) AS i
                     WHERE i.cost IS NOT NULL AND i.existing IS NULL AND i.first_n IS NULL) AS l
             CROSS JOIN step_ins
        )
        SELECT s.seq, agg.ids, u.paused, agg.screened, u.paused IS NOT NULL AS run_ok, agg.rows,
               (SELECT bool_or(e.status = 'pending') FROM effect_ins AS e) AS claimable
          INTO step_seq, effect_ids, paused, screened, run_ok, rows, claimable
          FROM v LEFT JOIN agg ON true LEFT JOIN run_upd AS u ON true
               LEFT JOIN step_ins AS s ON true;
        EXIT WHEN screened OR firsts IS NOT NULL;
        -- something the cheap checks did not clear: check it exactly (raising the
        -- refusal, taking the locks of callers' keys; a large value stored by
        -- reference), then write it
        stored := outbox_store_values(outbox_write_step.run_id, ARRAY['result', 'state', 'plan'],
                                      ARRAY[coalesce(result, 'null'), state, plan]);
        SELECT c.firsts, c.intents, c.existing INTO firsts, p_intents, existing
          FROM outbox_runs AS r, outbox_check_intents(outbox_write_step.run_id,
            outbox_write_step.step_id, p_intents, coalesce((tx_step->>'next')::integer, 0),
            coalesce((tx_step->>'count')::integer, 0), coalesce((tx_step->>'bytes')::bigint, 0),
            r.dry_run, true, r.namespace) AS c
         WHERE r.id = outbox_write_step.run_id AND r.shard = outbox_write_step.shard;
        IF NOT FOUND THEN
            -- no run to check the intents against: the statement above says why
            firsts := '{}';
        END IF;
    END LOOP;
    IF step_seq IS NULL OR firsts IS NOT NULL OR tx_step IS NOT NULL
       OR (claimable AND NOT paused AND wake IS DISTINCT FROM false) THEN
        PERFORM outbox_finish_step(outbox_write_step.run_id, outbox_write_step.step_id,
            lease_owner, lease_attempt, run_ok, step_seq, debit, rows, tx_step, paused,
            claimable AND NOT paused, wake);
        IF firsts IS NOT NULL OR tx_step IS NOT NULL THEN
            effect_ids := coalesce(array(SELECT jsonb_array_elements_text(tx_step->'ids')::uuid),
                                   '{}')
                          || CASE WHEN firsts IS NULL THEN effect_ids
                                  ELSE outbox_intent_ids(rows) END;
        END IF;
    END IF;
END
$$;

-- outbox_write_step on the run's own shard: what SQL callers call. (On Citus the
-- planner inlines it, and the call runs on the node holding the shard.)
CREATE OR REPLACE FUNCTION outbox_commit_step(
    run_id uuid,
    step_id text,
    result jsonb DEFAULT NULL,
    state jsonb DEFAULT NULL,
    plan jsonb DEFAULT NULL,
    intents jsonb DEFAULT NULL,
    step_kind text DEFAULT 'transaction',
    spends jsonb DEFAULT NULL,
    lease_owner text DEFAULT NULL,
    lease_attempt integer DEFAULT NULL,
    wake boolean DEFAULT NULL,
    OUT step_seq bigint,
    OUT effect_ids uuid[],
    OUT paused boolean
)
    LANGUAGE sql AS $$
SELECT w.step_seq, w.effect_ids, w.paused
  FROM outbox_write_step(outbox_shard_of(run_id), run_id, step_id, result, state, plan, intents,
                         step_kind, spends, lease_owner, lease_attempt, wake) AS w
$$;

-- outbox_write_step on Citus, where it runs on the node holding the run's shard:
-- the same step in a statement each (Citus plans a statement that writes through
-- common table expressions over several shards' worth of tasks), every value it
-- sets computed first. The deliverers' NOTIFY there would wake only that node's
-- listeners: notify asks the caller to send it from the coordinator instead.
--
-- What the common step computes keeps one generic plan (planning the intents'
-- query costs a worker about 2 ms, once a session). The run's lock and update,
-- the step's insert and its effects' go to the worker's own placements by name
-- (outbox_shard_placements: PostgreSQL plans each, Citus 14.0.1 would deparse and
-- plan it again, about 150 us more a statement), as statements prepared once a
-- session (outbox_prepare_placements); through the distributed tables where the
-- function runs on the coordinator, by dynamic SQL planned per call: a kept plan
-- of a statement on a distributed table grows at each run on Citus 14.0.1
-- (outbox_citus_plans_per_call).
-- Before a branch the common step never takes, every plan is per call for the
-- rest of the call:
-- Citus refuses generic plans of some of what those branches run (an INSERT ...
-- SELECT, a lookup by outbox_shard_of), and keeps growing the others (a key's
-- lookup on its own shard).
CREATE OR REPLACE FUNCTION outbox_write_step_apart(
    p_shard smallint, p_run_id uuid, p_step_id text, p_result jsonb, p_state jsonb,
    p_plan jsonb, p_intents jsonb, p_kind text, p_owner text, p_attempt integer,
    p_wake boolean, p_tx_step jsonb, p_debit numeric, p_ledger jsonb, p_chain jsonb,
    OUT step_seq bigint, OUT effect_ids uuid[], OUT paused boolean, OUT notify boolean
)
    LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    run outbox_runs;
    v_now timestamptz := now();
    result_text text := coalesce(p_result, 'null')::text;
    state_text text := p_state::text;
    plan_text text := p_plan::text;
    stored jsonb[];
    firsts integer[];
    existing uuid[];
    a record;
    head bytea;
    inserted bigint;
    gates jsonb;
    -- the worker's own placements of the run's shard, if it holds them
    placements regclass[] := coalesce(outbox_shard_placements(p_shard,
        ARRAY['outbox_runs', 'outbox_steps', 'outbox_effects']::regclass[]), '{}');
    runs regclass := coalesce(placements[1], 'outbox_runs');
    prepared boolean := outbox_prepare_placements(placements);
    locked record;
BEGIN
    IF prepared THEN
        EXECUTE format('EXECUTE %I(%L, %L)', 'outbox.lock:' || runs, p_run_id, p_shard)
          INTO locked;
    ELSE
        EXECUTE outbox_placement_statement('lock', runs) INTO locked USING p_run_id, p_shard;
    END IF;
    run := locked.run;
    LOOP
        -- kept for the session: it reads no distributed table (a plan Citus accepts)
        -- and planning its inlined query cost a worker about 2.1 ms
        SELECT x.* INTO a FROM outbox_step_intents(p_run_id, p_step_id, p_intents,
            run.priority, run.fairness_key, run.dry_run, run.namespace, p_tx_step, firsts,
            existing, p_chain,
            stored IS NOT NULL OR outbox_values_screened(result_text, state_text, plan_text)) AS x;
        EXIT WHEN a.screened OR firsts IS NOT NULL OR run.id IS NULL;
        PERFORM set_config('plan_cache_mode', 'force_custom_plan', true);
        stored := outbox_store_values(p_run_id, ARRAY['result', 'state', 'plan'],
                                      ARRAY[coalesce(p_result, 'null'), p_state, p_plan]);
        SELECT c.firsts, c.intents, c.existing INTO firsts, p_intents, existing
          FROM outbox_check_intents(p_run_id, p_step_id, p_intents,
            coalesce((p_tx_step->>'next')::integer, 0), coalesce((p_tx_step->>'count')::integer, 0),
            coalesce((p_tx_step->>'bytes')::bigint, 0), run.dry_run, true, run.namespace) AS c;
        PERFORM set_config('plan_cache_mode', 'force_generic_plan', true);
    END LOOP;
    IF run.id IS NULL OR NOT run.status = ANY (outbox_active_run_statuses())
       OR (run.budget IS NOT NULL AND run.spent + run.reserved + p_debit + a.reserve > run.budget)
       OR (p_owner IS NOT NULL AND (run.lease_owner IS DISTINCT FROM p_owner
                                    OR run.attempt <> p_attempt)) THEN
        PERFORM set_config('plan_cache_mode', 'force_custom_plan', true);
        PERFORM outbox_raise_step_refusal(p_run_id, p_owner, p_attempt, p_debit + a.reserve);
    END IF;
    paused := run.paused_at IS NOT NULL;
    head := outbox_step_link(coalesce(run.step_head, outbox_run_genesis(run.id, run.agent,
                                                                        run.inputs_hash)),
        run.id, p_step_id, p_kind, result_text, NULL, state_text, plan_text, v_now, a.chain_text);
    step_seq := run.step_count + 1;
    IF prepared THEN
        EXECUTE format('EXECUTE %I(%L, %L, %L, %L, %L, %L, %L, %L, %L)', 'outbox.move:' || runs,
            p_run_id, p_shard, coalesce(stored[2], p_state, run.state),
            coalesce(stored[3], p_plan, run.plan), p_step_id, step_seq, run.spent + p_debit,
            run.reserved + a.reserve, head);
        EXECUTE format('EXECUTE %I(%L, %L, %L, %L, %L, %L, %L, %L, %L)',
            'outbox.step:' || placements[2], p_run_id, p_shard, step_seq, p_step_id, p_kind,
            coalesce(stored[1], p_result, 'null'), coalesce(stored[2], p_state),
            coalesce(stored[3], p_plan), head) INTO inserted;
    ELSE
        EXECUTE outbox_placement_statement('move', runs)
          USING p_run_id, p_shard, coalesce(stored[2], p_state, run.state),
                coalesce(stored[3], p_plan, run.plan), p_step_id, step_seq,
                run.spent + p_debit, run.reserved + a.reserve, head;
        EXECUTE outbox_placement_statement('step', 'outbox_steps')
          INTO inserted
          USING p_run_id, p_shard, step_seq, p_step_id, p_kind,
                coalesce(stored[1], p_result, 'null'), coalesce(stored[2], p_state),
                coalesce(stored[3], p_plan), head;
    END IF;
    IF inserted IS NULL THEN
        PERFORM set_config('plan_cache_mode', 'force_custom_plan', true);
        PERFORM outbox_raise_step_recorded(p_run_id, p_step_id);
    END IF;
    -- A step without intents reads no gates and inserts nothing: on a worker each is
    -- a statement Citus deparses and plans, 250 of a bare step's 1,350 us.
    IF cardinality(a.rows) > 0 THEN
        gates := outbox_gates_of(a.kinds);  -- once (as an argument it would run once per use)
        PERFORM outbox_write_effects(a.rows, p_run_id, p_step_id, paused, run.namespace, gates,
                                     v_now, CASE WHEN prepared THEN placements[3] END);
    END IF;
    -- (Citus plans an INSERT ... SELECT on every call, rows or none: only when there are)
    IF coalesce(jsonb_array_length(p_ledger), 0) > 0
       OR EXISTS (SELECT 1 FROM unnest(a.rows) AS i
                   WHERE i.cost IS NOT NULL AND i.existing IS NULL AND i.first_n IS NULL) THEN
        PERFORM set_config('plan_cache_mode', 'force_custom_plan', true);
        INSERT INTO outbox_budget_ledger (run_id, shard, step_id, effect_id, reason, entry,
                                          amount)
        SELECT p_run_id, p_shard, p_step_id, l.effect_id, l.reason, l.entry, l.amount
          FROM (SELECT * FROM jsonb_to_recordset(p_ledger)
                       AS l(entry text, reason text, amount numeric, effect_id uuid)
                UNION ALL
                SELECT 'reserve', i.kind, i.cost, i.id FROM unnest(a.rows) AS i
                 WHERE i.cost IS NOT NULL AND i.existing IS NULL AND i.first_n IS NULL) AS l;
    END IF;
    -- (an intent a gate holds makes this true too: a NOTIFY for nothing, never one missed)
    notify := NOT paused AND p_wake IS DISTINCT FROM false
              AND (EXISTS (SELECT 1 FROM unnest(a.rows) AS i
                            WHERE i.existing IS NULL AND i.first_n IS NULL)
                   OR coalesce((p_tx_step->>'claimable')::boolean, false));
    effect_ids := a.ids;
    IF firsts IS NOT NULL OR p_tx_step IS NOT NULL THEN
        PERFORM set_config('plan_cache_mode', 'force_custom_plan', true);
        PERFORM outbox_finish_step(p_run_id, p_step_id, p_owner, p_attempt, true, step_seq,
            p_debit, a.rows, p_tx_step, paused, false, false);
        effect_ids := coalesce(array(SELECT jsonb_array_elements_text(p_tx_step->'ids')::uuid),
                               '{}')
                      || CASE WHEN firsts IS NULL THEN a.ids ELSE outbox_intent_ids(a.rows) END;
    END IF;
END
$$;

-- What a step's intents (p_intents, outbox_intent_rows' argument, for step p_step_id
-- of run p_run_id, in its lane, mode and namespace) come to: their rows; whether
-- they and the step's values (p_values_screened) pass the cheap checks and the
-- step's caps with what the transaction wrote for it before (p_tx_step); the
-- budget they reserve; the intents' part of the step's link (with the parts of
-- p_chain, outbox_intend's); the effect id of each (the one its key named, if
-- any); and their kinds. Both compositions of the step write use it: one
-- statement on one server, a statement each on Citus (outbox_write_step_apart).
CREATE OR REPLACE FUNCTION outbox_step_intents(
    p_run_id uuid, p_step_id text, p_intents jsonb, p_priority integer, p_fairness_key text,
    p_dry_run boolean, p_namespace text, p_tx_step jsonb, p_firsts integer[],
    p_existing uuid[], p_chain jsonb, p_values_screened boolean
) RETURNS TABLE (
    rows outbox_intent[], screened boolean, reserve numeric, chain_text text, ids uuid[],
    kinds text[]
)
    LANGUAGE sql STABLE AS $$
WITH i AS MATERIALIZED (
    SELECT x.* FROM outbox_intent_rows(p_run_id, p_step_id, p_intents,
        coalesce((p_tx_step->>'next')::integer, 0), p_priority, p_fairness_key, p_dry_run,
        p_firsts, p_namespace, p_existing) AS x
)
SELECT coalesce(array_agg(i::outbox_intent ORDER BY i.n) FILTER (WHERE i.id IS NOT NULL), '{}'),
       coalesce(bool_and(i.screened), true) AND p_values_screened
       AND count(i.id) + coalesce((p_tx_step->>'count')::integer, 0)
           <= outbox_limit('max_step_intents')
       AND coalesce(sum(i.payload_size), 0) + coalesce((p_tx_step->>'bytes')::bigint, 0)
           <= outbox_limit('max_step_bytes'),
       coalesce(sum(i.cost) FILTER (WHERE i.existing IS NULL AND i.first_n IS NULL), 0)
           + coalesce((p_tx_step->>'reserve')::numeric, 0),
       CASE WHEN p_chain = '[]' THEN coalesce(string_agg(outbox_intent_link(i.id,
                i.idempotency_key, i.kind, i.payload_hash), '' ORDER BY i.step_index, i.id)
                FILTER (WHERE i.id IS NOT NULL AND i.existing IS NULL AND i.first_n IS NULL), '')
            -- with outbox_intend's intents of this step: all of them in order
            ELSE outbox_intents_chain(p_chain || coalesce(jsonb_agg(jsonb_build_array(
                i.step_index, i.id, outbox_intent_link(i.id, i.idempotency_key, i.kind,
                                                       i.payload_hash)))
                FILTER (WHERE i.id IS NOT NULL AND i.existing IS NULL AND i.first_n IS NULL),
                '[]')) END,
       coalesce(array_agg(coalesce(i.existing, i.id) ORDER BY i.n) FILTER (WHERE i.id IS NOT NULL),
                '{}'),
       coalesce(array_agg(DISTINCT i.kind) FILTER (WHERE i.kind IS NOT NULL), '{}')
  FROM (SELECT 1) AS one LEFT JOIN i ON true
$$;

-- The effects of a small step on a Citus worker (outbox_write_step_apart): an
-- INSERT ... VALUES each, a fast-path insert, cheaper to plan on every call than
-- an INSERT ... SELECT from a function, which Citus plans afresh each time too
-- (about 1.1 ms for a step with one intent). Given the worker's own placement
-- of the effects' shard (outbox_shard_placements, for a run's effects), into it
-- by name, by the statement outbox_prepare_placements prepared for it: PostgreSQL's
-- plan, kept for the session, not Citus's. Otherwise through the table, planned
-- per call on Citus, not kept: a kept plan grows at each run there
-- (outbox_citus_plans_per_call).
CREATE OR REPLACE FUNCTION outbox_insert_effects(
    p_rows outbox_intent[], p_run_id uuid, p_step_id text, p_paused boolean, p_namespace text,
    p_gates jsonb, p_now timestamptz, p_placement regclass
) RETURNS void
    LANGUAGE plpgsql SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    h record;
BEGIN
    FOR h IN SELECT * FROM outbox_intent_effects(p_rows, p_run_id, p_step_id, p_paused,
                                                 p_namespace, p_gates, p_now) LOOP
        IF p_placement IS NOT NULL THEN
            -- (outbox_prepare_placements prepared it; a trigger of the insert before
            -- may have asked for plans per call, which this one need not)
            PERFORM set_config('plan_cache_mode', 'force_generic_plan', true);
            EXECUTE format('EXECUTE %I(%L, %L, %L, %L, %L, %L, %L, %L, %L, %L, %L, %L, %L, %L,
                                       %L, %L, %L, %L, %L, %L, %L, %L)',
                'outbox.effect:' || p_placement, h.id, h.run_id, h.step_id, h.step_index,
                h.kind, h.payload, h.payload_hash, h.schema_version, h.idempotency_key,
                h.ordering_key, h.max_attempts, h.compensate, h.cost, h.priority,
                h.fairness_key, h.status, h.available_at, h.approval, h.approval_deadline,
                h.trace_parent, h.shard, h.namespace);
            CONTINUE;
        END IF;
        -- (after the loop's query is planned, which keeps its plan)
        PERFORM outbox_citus_plans_per_call();
        INSERT INTO outbox_effects (
            id, run_id, step_id, step_index, kind, payload, payload_hash, schema_version,
            idempotency_key, ordering_key, max_attempts, compensate, cost, priority,
            fairness_key, status, available_at, approval, approval_deadline, trace_parent,
            shard, namespace)
        VALUES (h.id, h.run_id, h.step_id, h.step_index, h.kind, h.payload, h.payload_hash,
            h.schema_version, h.idempotency_key, h.ordering_key, h.max_attempts, h.compensate,
            h.cost, h.priority, h.fairness_key, h.status, h.available_at, h.approval,
            h.approval_deadline, h.trace_parent, h.shard, h.namespace);
    END LOOP;
END
$$;

-- The effects of rows (outbox_intent_effects), written apart from the step's one
-- statement (outbox_write_step_apart on Citus, outbox_intend_all): a fast-path
-- INSERT a row (outbox_insert_effects) wins for a few, one INSERT ... SELECT for
-- many (no CTE: Citus would run it as sub-plans of their own). From one writer on
-- a cluster, 20 intents a step 106 -> 133 steps/s with the fast-path inserts, 100
-- intents 51 -> 34; they cross at about 32. (Planned per call: Citus refuses a
-- generic plan of an INSERT ... SELECT from a function of parameters.) A few go
-- into p_placement by name when given (outbox_shard_placements, on a worker).
CREATE OR REPLACE FUNCTION outbox_write_effects(
    p_rows outbox_intent[], p_run_id uuid, p_step_id text, p_paused boolean, p_namespace text,
    p_gates jsonb, p_now timestamptz, p_placement regclass DEFAULT NULL
) RETURNS void
    LANGUAGE plpgsql SET plan_cache_mode = auto AS $$
BEGIN
    IF cardinality(p_rows) <= 32 THEN
        PERFORM outbox_insert_effects(p_rows, p_run_id, p_step_id, p_paused, p_namespace,
                                      p_gates, p_now, p_placement);
    ELSE
        INSERT INTO outbox_effects AS e (
            id, run_id, step_id, step_index, kind, payload, payload_hash, schema_version,
            idempotency_key, ordering_key, max_attempts, compensate, cost, priority,
            fairness_key, status, available_at, approval, approval_deadline, trace_parent,
            shard, namespace)
        SELECT h.* FROM outbox_intent_effects(p_rows, p_run_id, p_step_id, p_paused,
                                              p_namespace, p_gates, p_now) AS h;
    END IF;
END
$$;

-- The rest of a step that is not the common one: its refusal (the run missing,
-- paused, ended, leased to someone else or over budget; the step recorded
-- before), the intents outbox_intend wrote for it held when a pause committed
-- meanwhile, the transaction's note that the step is done, and the wake-up.
CREATE OR REPLACE FUNCTION outbox_finish_step(
    p_run_id uuid, p_step_id text, p_owner text, p_attempt integer, p_run_ok boolean,
    p_seq bigint, p_debit numeric, p_rows outbox_intent[], p_tx_step jsonb, p_paused boolean,
    p_claimable boolean, p_wake boolean
) RETURNS void
    LANGUAGE plpgsql AS $$
BEGIN
    IF NOT p_run_ok THEN
        PERFORM outbox_raise_step_refusal(p_run_id, p_owner, p_attempt,
            p_debit + coalesce((SELECT sum(r.cost) FROM unnest(p_rows) AS r
                                 WHERE r.existing IS NULL AND r.first_n IS NULL), 0)
            + coalesce((p_tx_step->>'reserve')::numeric, 0));
    END IF;
    IF p_seq IS NULL THEN
        PERFORM outbox_raise_step_recorded(p_run_id, p_step_id);
    END IF;
    IF p_tx_step IS NOT NULL THEN
        IF p_paused THEN
            -- a pause committed while outbox_intend's intents waited holds them now
            UPDATE outbox_effects AS e SET status = 'paused'
             WHERE e.run_id = p_run_id AND e.shard = outbox_shard_of(p_run_id)
               AND e.step_id = p_step_id AND e.status = 'pending';
        END IF;
        PERFORM outbox_tx_save_step(p_run_id, p_step_id, p_tx_step || '{"done": true}'::jsonb);
    END IF;
    IF (p_claimable OR (p_tx_step->>'claimable')::boolean AND NOT p_paused)
       AND p_wake IS DISTINCT FROM false THEN
        IF p_wake THEN
            PERFORM pg_notify('outbox_effects', '');
        ELSE
            PERFORM outbox_wake('outbox_effects');
        END IF;
    END IF;
END
$$;

-- Whether a step's values (their text) pass the cheap checks: small enough to be
-- stored in the row, not nested near the depth limit, no run of 17 digits and
-- points (which a number needs to be too long or to miss a double), and not a
-- reference (outbox_check_json and outbox_check_not_reference check exactly).
-- STABLE, as the limits it reads (outbox_limit): declared IMMUTABLE, it could
-- not be inlined, and every step called it as a function of its own (about
-- 3 % of the server's CPU for a step, most of it setting that call up).
CREATE OR REPLACE FUNCTION outbox_values_screened(result text, state text, plan text)
    RETURNS boolean
    LANGUAGE sql STABLE PARALLEL SAFE AS $$
SELECT octet_length(result) + coalesce(octet_length(state), 0) + coalesce(octet_length(plan), 0)
           <= outbox_limit('blob_threshold_bytes')
   AND length(result || coalesce(state, '') || coalesce(plan, ''))
       - length(translate(result || coalesce(state, '') || coalesce(plan, ''), '[{', ''))
       <= (outbox_intent_rules()->>'max_json_depth')::integer
   AND (result || ' ' || coalesce(state, '') || ' ' || coalesce(plan, ''))
       !~ '[0-9.]{17}|"__outbox_blob__"'
$$;

-- Whether a step id is refused (absent, blank, too long, a control character).
CREATE OR REPLACE FUNCTION outbox_step_id_refused(step_id text) RETURNS boolean
    LANGUAGE sql STABLE PARALLEL SAFE AS $$
SELECT step_id IS NULL OR btrim(step_id) = ''
    OR char_length(step_id) > outbox_limit('max_step_id_length')
    OR step_id ~ (outbox_intent_rules()->>'control_characters')
$$;

-- The exact checks of a step's own arguments (outbox_commit_step calls it when its
-- cheap ones do not clear them), and what the transaction wrote for the step
-- before (outbox_intend, outbox_spend: tx_step) with spends added: the debit, the
-- ledger entries and the chain parts so far.
CREATE OR REPLACE FUNCTION outbox_check_step(
    p_run_id uuid, p_step_id text, p_kind text, p_owner text, p_attempt integer,
    p_spends jsonb, p_tx_step jsonb, OUT debit numeric, OUT ledger jsonb, OUT chain jsonb
)
    LANGUAGE plpgsql AS $$
DECLARE
    spend jsonb;
BEGIN
    IF p_kind IS NULL OR p_kind NOT IN ('transaction', 'call') THEN
        PERFORM outbox_refuse('OB001', 'step_kind', p_kind, 'must be transaction or call');
    END IF;
    PERFORM outbox_check_text('step_id', p_step_id, outbox_limit('max_step_id_length')::integer,
                              true, true);
    IF (p_owner IS NULL) <> (p_attempt IS NULL) THEN
        PERFORM outbox_refuse('OB001', 'lease_attempt', p_attempt::text,
            'lease_owner and lease_attempt go together');
    END IF;
    debit := coalesce((p_tx_step->>'debit')::numeric, 0);
    ledger := coalesce(p_tx_step->'ledger', '[]');
    chain := coalesce(p_tx_step->'chain', '[]');
    IF (p_tx_step->>'done')::boolean THEN
        PERFORM outbox_refuse('OB001', 'step_id', p_step_id,
            'outbox_commit_step already recorded this step in this transaction');
    END IF;
    IF p_spends IS NOT NULL AND p_spends <> 'null' THEN
        IF jsonb_typeof(p_spends) <> 'array' THEN
            PERFORM outbox_refuse('OB001', 'spends', left(p_spends::text, 80),
                'must be a JSON array of {"reason": ..., "amount": ...}');
        END IF;
        FOR spend IN SELECT value FROM jsonb_array_elements(p_spends) LOOP
            spend := outbox_spend_entry(ledger, spend);
            ledger := ledger || jsonb_build_array(spend);
            debit := debit + (spend->>'amount')::numeric;
        END LOOP;
    END IF;
END
$$;

-- Values of a run (result, state, plan, ...: names and values in order) checked
-- exactly and returned as a row stores them: a large one as a reference to it,
-- stored once (outbox_store_value), owned by the run.
CREATE OR REPLACE FUNCTION outbox_store_values(p_run_id uuid, p_names text[], p_values jsonb[])
    RETURNS jsonb[]
    LANGUAGE plpgsql AS $$
DECLARE
    stored jsonb[] := '{}';
    rendered text;
BEGIN
    FOR k IN 1 .. cardinality(p_values) LOOP
        IF p_values[k] IS NULL THEN
            stored := stored || NULL::jsonb;
            CONTINUE;
        END IF;
        PERFORM outbox_check_not_reference(p_names[k], p_values[k]);
        rendered := outbox_check_json(p_names[k], p_values[k], outbox_limit('max_payload_bytes'));
        stored := stored || CASE WHEN octet_length(rendered) > outbox_limit('blob_threshold_bytes')
                                 THEN outbox_store_value(p_run_id, p_values[k], rendered)
                                 ELSE p_values[k] END;
    END LOOP;
    RETURN stored;
END
$$;

-- Why a step was refused (it wrote nothing): the run is missing, paused or ended,
-- leased to someone else since (OB011), or over its budget (OB007).
CREATE OR REPLACE FUNCTION outbox_raise_step_refusal(
    p_run_id uuid, p_owner text, p_attempt integer, p_needs numeric
) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    found_run record;
BEGIN
    SELECT r.status, r.budget, r.spent, r.reserved, r.lease_owner, r.attempt
      INTO found_run FROM outbox_runs AS r
     WHERE r.id = p_run_id AND r.shard = outbox_shard_of(p_run_id);
    IF NOT FOUND OR NOT found_run.status = ANY (outbox_active_run_statuses()) THEN
        PERFORM outbox_raise_run_refusal(p_run_id);
    ELSIF p_owner IS NOT NULL AND (found_run.lease_owner IS DISTINCT FROM p_owner
                                   OR found_run.attempt <> p_attempt) THEN
        PERFORM outbox_raise('OB011',
            format('run_id=%L: lease attempt %s of %L was taken over (now attempt %s of %L)',
                   p_run_id, p_attempt, p_owner, found_run.attempt, found_run.lease_owner),
            jsonb_build_object('run_id', p_run_id, 'attempt', p_attempt, 'owner', p_owner,
                               'current_attempt', found_run.attempt,
                               'current_owner', found_run.lease_owner));
    ELSE
        PERFORM outbox_raise('OB007',
            format('run_id=%L: step needs %s but only %s remains', p_run_id, p_needs,
                   found_run.budget - found_run.spent - found_run.reserved),
            jsonb_build_object('run_id', p_run_id, 'requested', p_needs,
                'remaining', found_run.budget - found_run.spent - found_run.reserved));
    END IF;
END
$$;
