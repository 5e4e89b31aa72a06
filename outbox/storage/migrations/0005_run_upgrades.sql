-- "migration" means schema migrations (outbox_migrations, this file); a run's
-- move to a newer agent version is an upgrade.
ALTER TABLE outbox_runs RENAME COLUMN migrations TO upgrades;
