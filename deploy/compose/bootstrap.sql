-- What only the PostgreSQL superuser can make, for compose.yaml's services.
--
-- Run by the one-shot `bootstrap` service on every `docker compose up`, as the
-- superuser; running it again changes nothing but the passwords (set to the
-- ones given). Every other service connects as one of these roles, never as the
-- superuser:
--
--   outbox_owner    owns the database and the outbox tables: `outbox migrate`
--                   and `outbox roles` run as it. Not a superuser; it creates
--                   no role and no database.
--   outbox_agent, outbox_deliverer, outbox_operator, outbox_reader
--                   the group roles (NOLOGIN) whose grants `outbox roles` sets
--                   (docs/howto/secure-a-deployment.md lists them).
--   outbox_relay    the relay's login, a member of outbox_deliverer.
--   outbox_deliver  the deliverers' login, a member of outbox_deliverer.
--
-- Passwords come as psql variables: owner_password, relay_password,
-- deliver_password (psql -v name=value).
\set ON_ERROR_STOP on

SELECT format('CREATE ROLE %I NOLOGIN', name)
  FROM unnest(ARRAY['outbox_agent', 'outbox_deliverer', 'outbox_operator', 'outbox_reader']) AS name
 WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = name)
\gexec

SELECT format('CREATE ROLE %I LOGIN', name)
  FROM unnest(ARRAY['outbox_owner', 'outbox_relay', 'outbox_deliver']) AS name
 WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = name)
\gexec

ALTER ROLE outbox_owner LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOBYPASSRLS PASSWORD :'owner_password';
ALTER ROLE outbox_relay LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOBYPASSRLS PASSWORD :'relay_password';
ALTER ROLE outbox_deliver LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOBYPASSRLS PASSWORD :'deliver_password';
GRANT outbox_deliverer TO outbox_relay, outbox_deliver;

-- The owner owns the database (and so, from PostgreSQL 15, its public schema).
SELECT format('ALTER DATABASE %I OWNER TO outbox_owner', current_database())
\gexec
-- (Before PostgreSQL 15 the public schema belongs to the superuser.)
GRANT USAGE, CREATE ON SCHEMA public TO outbox_owner;
