-- Debit the run's budget by amount for reason when step_id commits (keyed by
-- run, step and reason, so a replay cannot spend twice).
CREATE OR REPLACE FUNCTION outbox_spend(run_id uuid, step_id text, amount numeric, reason text) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    entry jsonb := outbox_tx_step(outbox_spend.run_id, outbox_spend.step_id);
BEGIN
    IF outbox_spend.amount IS NULL THEN
        PERFORM outbox_refuse('OB001', 'amount', NULL, 'is required');
    END IF;
    PERFORM outbox_check_amount('amount', outbox_spend.amount, true);
    PERFORM outbox_check_text('reason', outbox_spend.reason,
        (outbox_intent_rules()->>'max_name_length')::integer, true, true);
    IF jsonb_path_exists(entry->'ledger', '$[*] ? (@.entry == "spend" && @.reason == $r)',
                         jsonb_build_object('r', outbox_spend.reason)) THEN
        PERFORM outbox_refuse('OB001', 'reason', outbox_spend.reason, 'already spent for in this step');
    END IF;
    entry := entry || jsonb_build_object(
        'debit', (entry->>'debit')::numeric + outbox_spend.amount,
        'ledger', (entry->'ledger') || jsonb_build_array(jsonb_build_object(
            'entry', 'spend', 'reason', outbox_spend.reason, 'amount', outbox_spend.amount,
            'effect_id', NULL)));
    PERFORM outbox_tx_save_step(outbox_spend.run_id, outbox_spend.step_id, entry);
END
$$;
