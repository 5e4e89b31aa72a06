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
    p_shard smallint := outbox_shard_of(outbox_signal.run_id);
    v_now timestamptz := now();
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
    SELECT r.status INTO run_status FROM outbox_runs AS r
     WHERE r.id = outbox_signal.run_id AND r.shard = p_shard FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM outbox_raise_run_not_found(outbox_signal.run_id);
    END IF;
    IF NOT run_status = ANY (outbox_live_run_statuses()) THEN
        PERFORM outbox_raise_run_ended(outbox_signal.run_id, run_status);
    END IF;
    INSERT INTO outbox_signals AS s (id, run_id, shard, name, payload, dedup_key)
    VALUES (outbox_uuid7(), outbox_signal.run_id, p_shard, outbox_signal.name,
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
       SET status = 'runnable', available_at = v_now, wake_at = NULL, wait_signal = NULL,
           updated_at = v_now
     WHERE r.id = outbox_signal.run_id AND r.shard = p_shard AND r.status = 'waiting'
       AND r.wait_signal = outbox_signal.name
    RETURNING r.id INTO woke;
    woke_run := woke IS NOT NULL;
    IF woke_run THEN
        PERFORM pg_notify('outbox_runs', '');
    END IF;
    -- plain scripts blocked in wait_signal listen here
    PERFORM pg_notify('outbox_signals', outbox_signal.run_id::text);
END
$$;
