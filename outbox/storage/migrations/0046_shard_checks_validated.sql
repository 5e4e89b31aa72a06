-- outbox:no-transaction
-- agent-outbox 0046: shard checks validated.
-- Must stay equal to outbox/storage/schema.py (tests/integration/test_migrations.py checks it).
--
-- The checks 0045 wrote out, proven for the rows already there. Outside a
-- transaction, one table at a time, each under a lock that lets rows be written
-- meanwhile (SHARE UPDATE EXCLUSIVE); a check already valid is left as it is, so
-- running it again after a failure part-way is safe.

ALTER TABLE outbox_runs VALIDATE CONSTRAINT outbox_runs_shard_check;
ALTER TABLE outbox_steps VALIDATE CONSTRAINT outbox_steps_shard_check;
ALTER TABLE outbox_effects VALIDATE CONSTRAINT outbox_effects_shard_check;
ALTER TABLE outbox_signals VALIDATE CONSTRAINT outbox_signals_shard_check;
ALTER TABLE outbox_budget_ledger VALIDATE CONSTRAINT outbox_budget_ledger_shard_check;
ALTER TABLE outbox_blob_refs VALIDATE CONSTRAINT outbox_blob_refs_shard_check;
ALTER TABLE outbox_run_keys VALIDATE CONSTRAINT outbox_run_keys_shard_check;
ALTER TABLE outbox_effect_keys VALIDATE CONSTRAINT outbox_effect_keys_shard_check;
