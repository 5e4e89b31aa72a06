-- agent-outbox 0012: deliverers that hold a session lock, so their death is seen at once.
-- Must stay equal to outbox/storage/schema.py (tests/integration/test_migrations.py checks it).
--
-- A delivery daemon holds a session-level advisory lock named after its lease
-- owner on a connection of its own, and registers the owner here. PostgreSQL
-- drops the lock with the connection, so a reconciler sees a registered owner
-- whose lock is free as gone (`kill -9`, a crashed host whose socket closed) and
-- puts that owner's idempotent attempts back without waiting for their leases.
-- Owners that never registered (relays, older deliverers, anything else that
-- claims) are left to their leases, as before.
CREATE TABLE IF NOT EXISTS outbox_owners (
    owner text PRIMARY KEY,
    registered_at timestamptz NOT NULL DEFAULT now()
);
