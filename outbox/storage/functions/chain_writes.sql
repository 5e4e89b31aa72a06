-- The writers of the hash chain's columns (outbox_runs.step_head, outbox_steps.hash)
-- besides outbox_write_step: a wait that ends, a signal a wait takes, a fork's
-- copied history. Each is SECURITY DEFINER (it runs as the tables' owner), so
-- `outbox roles` can leave those columns out of every role's grants: an agent
-- login cannot write a head or a link of its own making, only have one of these
-- compute it from what is recorded. The search path is pinned to the one the
-- schema was loaded with (the outbox schema, pg_catalog, then pg_temp: a
-- caller's temporary table cannot stand in for an outbox table). `outbox roles`
-- grants EXECUTE on them to the agent role only.

-- A wait step of run p_run_id (outbox.runs.waits) is over: record its result or
-- error and join it to the run's hash chain (a waiting step is not in it yet).
-- Refused: a step recorded before (OB006), a step that is not a waiting one of
-- this run (OB001).
CREATE OR REPLACE FUNCTION outbox_complete_wait(
    p_run_id uuid,
    p_step_id text,
    p_result jsonb DEFAULT NULL,
    p_error jsonb DEFAULT NULL,
    OUT step_seq bigint,
    OUT completed_at timestamptz
)
    LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    p_shard smallint := outbox_shard_of(p_run_id);
    v_now timestamptz := now();
    v_kind text;
    v_status text;
    head bytea;
BEGIN
    IF NOT has_any_column_privilege(session_user, 'outbox_steps', 'INSERT') THEN
        PERFORM outbox_raise_not_step_writer();
    END IF;
    SELECT s.kind, s.status INTO v_kind, v_status FROM outbox_steps AS s
     WHERE s.run_id = p_run_id AND s.shard = p_shard AND s.step_id = p_step_id FOR UPDATE;
    IF v_status = 'completed' THEN
        PERFORM outbox_raise_step_recorded(p_run_id, p_step_id);
    ELSIF v_status IS DISTINCT FROM 'waiting' THEN
        PERFORM outbox_refuse('OB001', 'step_id', p_step_id,
                              format('is not a waiting step of run %s', p_run_id));
    END IF;
    UPDATE outbox_runs AS r
       SET current_step = p_step_id,
           step_head = outbox_step_link(
               coalesce(r.step_head, outbox_run_genesis(r.id, r.agent, r.inputs_hash)),
               r.id, p_step_id, v_kind, outbox_resolve(p_result)::text,
               outbox_resolve(p_error)::text, NULL, NULL, v_now, '')
     WHERE r.id = p_run_id AND r.shard = p_shard
    RETURNING r.step_head INTO head;
    UPDATE outbox_steps AS s
       SET status = 'completed', result = p_result, error = p_error, completed_at = v_now,
           hash = head
     WHERE s.run_id = p_run_id AND s.shard = p_shard AND s.step_id = p_step_id
    RETURNING s.seq, s.completed_at INTO step_seq, completed_at;
END
$$;

-- The wait step p_step_id of run p_run_id takes the run's oldest unconsumed signal
-- p_name: the signal is marked consumed by that step and the step completes with
-- its payload (as stored: a large one by reference), in one call. So a signal is
-- consumed only by a wait of the run it was sent to that records it; no login can
-- mark one consumed without the run getting it. taken is false (and nothing
-- changes) when no such signal is there. Refused (OB001): a step that is not
-- this run's wait for p_name; a step recorded before (OB006).
CREATE OR REPLACE FUNCTION outbox_take_signal(
    p_run_id uuid,
    p_step_id text,
    p_name text,
    OUT taken boolean,
    OUT payload jsonb,
    OUT step_seq bigint,
    OUT completed_at timestamptz
)
    LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    p_shard smallint := outbox_shard_of(p_run_id);
    v_status text;
BEGIN
    IF NOT has_any_column_privilege(session_user, 'outbox_steps', 'INSERT') THEN
        PERFORM outbox_raise_not_step_writer();
    END IF;
    SELECT s.status INTO v_status FROM outbox_steps AS s
     WHERE s.run_id = p_run_id AND s.shard = p_shard AND s.step_id = p_step_id
       AND s.kind = 'signal' AND s.result->>'signal' = p_name FOR UPDATE;
    IF v_status = 'completed' THEN
        PERFORM outbox_raise_step_recorded(p_run_id, p_step_id);
    ELSIF v_status IS DISTINCT FROM 'waiting' THEN
        PERFORM outbox_refuse('OB001', 'step_id', p_step_id,
                              format('is not a wait of run %s for signal %L', p_run_id, p_name));
    END IF;
    UPDATE outbox_signals AS g
       SET consumed_by = p_step_id, consumed_at = now()
     WHERE g.shard = p_shard
       AND g.id = (SELECT o.id FROM outbox_signals AS o
                    WHERE o.run_id = p_run_id AND o.shard = p_shard AND o.name = p_name
                      AND o.consumed_at IS NULL
                    ORDER BY o.created_at, o.id LIMIT 1 FOR UPDATE)
    RETURNING g.payload INTO payload;
    -- (not named found: PL/pgSQL's FOUND is the same name, whatever the case)
    taken := FOUND;
    IF taken THEN
        SELECT w.step_seq, w.completed_at INTO step_seq, completed_at
          FROM outbox_complete_wait(p_run_id, p_step_id, payload, NULL) AS w;
    END IF;
END
$$;

-- Chain a fork's copied steps from the fork's own genesis and set its step_head
-- (outbox.storage.sql.control.fork_chain; a link covers the run's id, so a copied
-- step's hash cannot be copied). Only a run with no chain yet (step_head NULL)
-- and only its unlinked steps: called on any other run it changes nothing, so it
-- cannot relink a recorded history. A loop of statements, each filtered by its
-- run's shard: Citus refuses a recursive query without a distribution column
-- filter (and a fork given its own id may be on another shard than its original).
CREATE OR REPLACE FUNCTION outbox_chain_fork(p_original uuid, p_fork uuid) RETURNS void
    LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    head bytea;
    chained_already bytea;
    chained text[];
    copied record;
    linked boolean := false;
BEGIN
    IF NOT has_any_column_privilege(session_user, 'outbox_steps', 'INSERT') THEN
        PERFORM outbox_raise_not_step_writer();
    END IF;
    SELECT outbox_run_genesis(r.id, r.agent, r.inputs_hash), r.step_head
      INTO head, chained_already
      FROM outbox_runs AS r WHERE r.id = p_fork AND r.shard = outbox_shard_of(p_fork);
    IF NOT FOUND THEN
        -- the caller has just written it: a fork it cannot see would stay unchained
        RAISE EXCEPTION 'outbox_chain_fork: run % is not there to chain', p_fork
            USING ERRCODE = 'no_data_found';
    ELSIF chained_already IS NOT NULL THEN
        RETURN;
    END IF;
    SELECT array_agg(o.step_id) INTO chained
      FROM outbox_steps AS o
     WHERE o.run_id = p_original AND o.shard = outbox_shard_of(p_original)
       AND o.hash IS NOT NULL;
    FOR copied IN
        SELECT f.seq, f.step_id, f.kind, f.result, f.error, f.state, f.plan, f.completed_at
          FROM outbox_steps AS f
         WHERE f.run_id = p_fork AND f.shard = outbox_shard_of(p_fork)
           AND f.hash IS NULL AND f.status = 'completed' AND f.step_id = ANY (chained)
         ORDER BY f.seq
    LOOP
        head := outbox_step_link(head, p_fork, copied.step_id, copied.kind,
                                 outbox_resolve(copied.result)::text,
                                 outbox_resolve(copied.error)::text,
                                 outbox_resolve(copied.state)::text,
                                 outbox_resolve(copied.plan)::text, copied.completed_at, '');
        UPDATE outbox_steps SET hash = head
         WHERE run_id = p_fork AND shard = outbox_shard_of(p_fork) AND seq = copied.seq
           AND hash IS NULL;
        linked := true;
    END LOOP;
    IF linked THEN
        UPDATE outbox_runs SET step_head = head
         WHERE id = p_fork AND shard = outbox_shard_of(p_fork) AND step_head IS NULL;
    END IF;
END
$$;
