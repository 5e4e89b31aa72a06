-- The writers of the hash chain's columns (outbox_runs.step_head, outbox_steps.hash)
-- besides outbox_write_step: a wait that ends, a signal a wait takes, a fork's
-- copied history. Each is SECURITY DEFINER (it runs as the tables' owner), so
-- `outbox roles` can leave those columns out of every role's grants: an agent
-- login cannot write a head or a link of its own making, only have one of these
-- compute it from what is recorded. The search path is pinned to the one the
-- schema was loaded with (the outbox schema, pg_catalog, then pg_temp: a
-- caller's temporary table cannot stand in for an outbox table). `outbox roles`
-- grants EXECUTE on them to the agent role only.
--
-- Each takes the shard of the run it writes first, and touches that shard only:
-- on Citus it is delegated to the node holding the shard (outbox/storage/citus.py,
-- DELEGATED), so it runs there, as the owner, in the caller's own session to that
-- node. Run from the coordinator instead, it would reach the shard through a
-- session of the owner's beside the caller's, and Citus refuses a transaction
-- that touches a shard's rows as two users (an agent login's sleep, signal wait
-- and fork failed so).

-- A wait step of run p_run_id (outbox.runs.waits) is over: record its result or
-- error and join it to the run's hash chain (a waiting step is not in it yet).
-- p_shard is the run's (outbox_shard_of). Refused: a step recorded before (OB006),
-- a step that is not a waiting one of this run (OB001), another shard (OB001).
CREATE OR REPLACE FUNCTION outbox_complete_wait(
    p_shard smallint,
    p_run_id uuid,
    p_step_id text,
    p_result jsonb DEFAULT NULL,
    p_error jsonb DEFAULT NULL,
    OUT step_seq bigint,
    OUT completed_at timestamptz
)
    LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    v_now timestamptz := now();
    v_kind text;
    v_status text;
    head bytea;
BEGIN
    IF NOT has_any_column_privilege(session_user, 'outbox_steps', 'INSERT') THEN
        PERFORM outbox_raise_not_step_writer();
    END IF;
    PERFORM outbox_shard_given(p_shard, p_run_id);
    PERFORM outbox_confined_to_run(p_shard, p_run_id);
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
               r.id, p_step_id, v_kind, outbox_value_text(p_result, p_shard),
               outbox_value_text(p_error, p_shard), NULL, NULL, v_now, '')
     WHERE r.id = p_run_id AND r.shard = p_shard
    RETURNING r.step_head INTO head;
    UPDATE outbox_steps AS s
       SET status = 'completed', result = p_result, error = p_error, completed_at = v_now,
           hash = head
     WHERE s.run_id = p_run_id AND s.shard = p_shard AND s.step_id = p_step_id
    RETURNING s.seq, s.completed_at INTO step_seq, completed_at;
    -- a value recorded by reference is one the run uses now, whoever stored it:
    -- `outbox gc` keeps it while the run is kept (the link above read it, so it is here)
    INSERT INTO outbox_blob_refs AS f (owner, sha256, shard)
    SELECT p_run_id, v.sha, p_shard
      FROM (VALUES (outbox_reference_sha(p_result)), (outbox_reference_sha(p_error))) AS v(sha)
     WHERE v.sha IS NOT NULL
    ON CONFLICT ON CONSTRAINT outbox_blob_refs_pkey DO NOTHING;
END
$$;

-- The wait step p_step_id of run p_run_id takes the run's oldest unconsumed signal
-- p_name: the signal is marked consumed by that step and the step completes with
-- its payload (as stored: a large one by reference), in one call. So a signal is
-- consumed only by a wait of the run it was sent to that records it; no login can
-- mark one consumed without the run getting it. taken is false (and nothing
-- changes) when no such signal is there. Refused (OB001): a step that is not
-- this run's wait for p_name, or another shard than the run's; a step recorded
-- before (OB006).
CREATE OR REPLACE FUNCTION outbox_take_signal(
    p_shard smallint,
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
    v_status text;
BEGIN
    IF NOT has_any_column_privilege(session_user, 'outbox_steps', 'INSERT') THEN
        PERFORM outbox_raise_not_step_writer();
    END IF;
    PERFORM outbox_shard_given(p_shard, p_run_id);
    PERFORM outbox_confined_to_run(p_shard, p_run_id);
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
          FROM outbox_complete_wait(p_shard, p_run_id, p_step_id, payload, NULL) AS w;
    END IF;
END
$$;

-- Chain a fork's copied steps from the fork's own genesis and set its step_head
-- (outbox.storage.sql.control.fork_chain; a link covers the run's id, so a copied
-- step's hash cannot be copied). p_chained names the steps its original had
-- chained (the caller reads them: the original may be on another shard, which a
-- delegated call cannot reach), and the fork's blobs are on its own shard by
-- now. Only a fork (forked_from set; another run is refused, OB001) with no
-- chain yet (step_head NULL), and only its unlinked completed steps: called on a
-- fork chained before it changes nothing, so it cannot relink a recorded
-- history. What it links is the fork's rows as they are: the client copies them
-- with the agent's own grants, so an agent login that writes a fork's run and
-- completed steps by hand gets them linked (docs/howto/secure-a-deployment.md).
CREATE OR REPLACE FUNCTION outbox_chain_fork(p_shard smallint, p_fork uuid, p_chained text[])
    RETURNS void
    LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    head bytea;
    chained_already bytea;
    original uuid;
    copied record;
    linked boolean := false;
BEGIN
    IF NOT has_any_column_privilege(session_user, 'outbox_steps', 'INSERT') THEN
        PERFORM outbox_raise_not_step_writer();
    END IF;
    PERFORM outbox_shard_given(p_shard, p_fork);
    PERFORM outbox_confined_to_run(p_shard, p_fork);
    SELECT outbox_run_genesis(r.id, r.agent, r.inputs_hash), r.step_head, r.forked_from
      INTO head, chained_already, original
      FROM outbox_runs AS r WHERE r.id = p_fork AND r.shard = p_shard;
    IF NOT FOUND THEN
        -- the caller has just written it: a fork it cannot see would stay unchained
        RAISE EXCEPTION 'outbox_chain_fork: fork % is not there to chain', p_fork
            USING ERRCODE = 'no_data_found';
    ELSIF original IS NULL THEN
        PERFORM outbox_refuse('OB001', 'fork', p_fork::text, 'is not a fork');
    ELSIF chained_already IS NOT NULL THEN
        RETURN;
    END IF;
    FOR copied IN
        SELECT f.seq, f.step_id, f.kind, f.result, f.error, f.state, f.plan, f.completed_at
          FROM outbox_steps AS f
         WHERE f.run_id = p_fork AND f.shard = p_shard
           AND f.hash IS NULL AND f.status = 'completed' AND f.step_id = ANY (p_chained)
         ORDER BY f.seq
    LOOP
        head := outbox_step_link(head, p_fork, copied.step_id, copied.kind,
                                 outbox_value_text(copied.result, p_shard),
                                 outbox_value_text(copied.error, p_shard),
                                 outbox_value_text(copied.state, p_shard),
                                 outbox_value_text(copied.plan, p_shard),
                                 copied.completed_at, '');
        UPDATE outbox_steps SET hash = head
         WHERE run_id = p_fork AND shard = p_shard AND seq = copied.seq AND hash IS NULL;
        linked := true;
    END LOOP;
    IF linked THEN
        UPDATE outbox_runs SET step_head = head
         WHERE id = p_fork AND shard = p_shard AND step_head IS NULL;
    END IF;
END
$$;

-- p_shard is p_run_id's shard, or OB001 naming it: a writer given another run's
-- shard would find nothing, or, delegated on Citus, reach the wrong node.
CREATE OR REPLACE FUNCTION outbox_shard_given(p_shard smallint, p_run_id uuid) RETURNS void
    LANGUAGE plpgsql AS $$
BEGIN
    IF p_shard IS DISTINCT FROM outbox_shard_of(p_run_id) THEN
        PERFORM outbox_refuse('OB001', 'shard', p_shard::text,
                              format('is not the shard of run %s', p_run_id));
    END IF;
END
$$;
