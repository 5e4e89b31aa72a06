-- End run_id as completed (with an optional JSON result) or failed (with a JSON
-- error): the one implementation, for every client. Only an active run ends
-- (OB004, OB005, OB009 otherwise); with lease_owner and lease_attempt (a worker's
-- fence, G4) only while the run is still leased to it (OB011).
CREATE OR REPLACE FUNCTION outbox_finish_run(
    run_id uuid,
    status text,
    result jsonb DEFAULT NULL,
    error jsonb DEFAULT NULL,
    lease_owner text DEFAULT NULL,
    lease_attempt integer DEFAULT NULL
) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    p_run_id uuid := outbox_finish_run.run_id;
    max_bytes bigint := outbox_limit('max_payload_bytes');
    threshold bigint := outbox_limit('blob_threshold_bytes');
    rendered text;
    stored_result jsonb;
    stored_error jsonb;
BEGIN
    IF status IS NULL OR status NOT IN ('completed', 'failed') THEN
        PERFORM outbox_refuse('OB001', 'status', status, 'must be completed or failed');
    END IF;
    IF (lease_owner IS NULL) <> (lease_attempt IS NULL) THEN
        PERFORM outbox_refuse('OB001', 'lease_attempt', lease_attempt::text,
            'lease_owner and lease_attempt go together');
    END IF;
    IF result IS NOT NULL THEN
        PERFORM outbox_check_not_reference('result', result);
        rendered := outbox_check_json('result', result, max_bytes);
        stored_result := CASE WHEN octet_length(rendered) > threshold
                              THEN outbox_store_value(p_run_id, result, rendered) ELSE result END;
    END IF;
    IF error IS NOT NULL THEN
        PERFORM outbox_check_not_reference('error', error);
        rendered := outbox_check_json('error', error, max_bytes);
        stored_error := CASE WHEN octet_length(rendered) > threshold
                             THEN outbox_store_value(p_run_id, error, rendered) ELSE error END;
    END IF;
    UPDATE outbox_runs AS r
       SET status = outbox_finish_run.status, result = stored_result,
           error = stored_error, lease_owner = NULL, lease_expires_at = NULL,
           updated_at = now()
     WHERE r.id = p_run_id AND r.shard = outbox_shard_of(p_run_id)
       AND r.status = ANY (outbox_active_run_statuses())
       AND (outbox_finish_run.lease_owner IS NULL
            OR (r.lease_owner = outbox_finish_run.lease_owner AND r.attempt = outbox_finish_run.lease_attempt));
    IF NOT FOUND THEN
        PERFORM outbox_raise_step_refusal(p_run_id, lease_owner, lease_attempt, 0);
    END IF;
END
$$;
