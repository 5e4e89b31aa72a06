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
