-- Debit run_id's budget by amount for reason when step_id commits (call it before
-- outbox_commit_step, in the same transaction). Keyed by (run, step, reason): a
-- step records each reason once, so a replay or a retry cannot spend twice (G7).
CREATE OR REPLACE FUNCTION outbox_spend(run_id uuid, step_id text, amount numeric, reason text) RETURNS void
    LANGUAGE plpgsql AS $$
DECLARE
    entry jsonb := outbox_tx_step(outbox_spend.run_id, outbox_spend.step_id);
    spent jsonb := outbox_spend_entry(entry->'ledger',
        jsonb_build_object('reason', outbox_spend.reason, 'amount', outbox_spend.amount));
BEGIN
    PERFORM outbox_tx_save_step(outbox_spend.run_id, outbox_spend.step_id, entry || jsonb_build_object(
        'debit', (entry->>'debit')::numeric + outbox_spend.amount,
        'ledger', (entry->'ledger') || jsonb_build_array(spent)));
END
$$;

-- One spend of a step ({"reason": ..., "amount": ...}) as its ledger entry, checked:
-- a positive, finite amount within the rules, a reason named once in the step
-- (ledger: the step's entries so far).
CREATE OR REPLACE FUNCTION outbox_spend_entry(ledger jsonb, spend jsonb) RETURNS jsonb
    LANGUAGE plpgsql AS $$
DECLARE
    amount numeric;
    reason text;
BEGIN
    IF jsonb_typeof(spend) IS DISTINCT FROM 'object' THEN
        PERFORM outbox_refuse('OB001', 'spends', left(spend::text, 80),
            'each spend must be {"reason": ..., "amount": ...}');
    END IF;
    amount := outbox_json_field_number(spend, 'amount', '');
    IF amount IS NULL THEN
        PERFORM outbox_refuse('OB001', 'amount', NULL, 'is required');
    END IF;
    PERFORM outbox_check_amount('amount', amount, true);
    reason := outbox_json_field_text(spend, 'reason', '');
    PERFORM outbox_check_text('reason', reason,
        (outbox_intent_rules()->>'max_name_length')::integer, true, true);
    IF jsonb_path_exists(ledger, '$[*] ? (@.entry == "spend" && @.reason == $r)',
                         jsonb_build_object('r', reason)) THEN
        PERFORM outbox_refuse('OB001', 'reason', reason, 'already spent for in this step');
    END IF;
    RETURN jsonb_build_object('entry', 'spend', 'reason', reason, 'amount', amount, 'effect_id', NULL);
END
$$;
