-- Where a row lives: its logical shard, one of 32, fixed for good (outbox.shards).
-- A run's is read from its id; the rows of a run (steps, effects, attempts,
-- signals, ledger, values) live on its shard; an effect of no run on its id's;
-- a caller's key (of a run or an effect) is registered on the key's own shard.
-- On one server the shard is a column and a check; on Citus it is what the
-- tables are distributed by (docs/howto/citus.md).

-- Text as UTF-8 bytes: convert_to(value, 'UTF8'), for a database whose encoding
-- is UTF-8 (outbox migrate refuses any other). decode(..., 'escape') copies every
-- byte of its text but a backslash's escape, so backslashes (chr(92): a literal
-- would depend on standard_conforming_strings) are doubled first. Unlike
-- convert_to (STABLE: a conversion can be redefined), both are IMMUTABLE, so a
-- hashing helper that calls this one is inlined into its caller's statement
-- (chain.sql says what that saves); STRICT, as a STRICT caller's body must be.
--
-- The tables' checks spell outbox_shard_of and outbox_key_shard out rather than
-- call them (outbox.storage.schema_base.shard_check says why; migration 0045):
-- a change to either body is a change to those checks too. The bodies here name
-- every built-in as pg_catalog's and call no function of ours: statements and
-- policies run them inlined, read in the session's search path, where a login
-- that may create objects in some schema could put a get_byte of its own before
-- pg_catalog's. Named so, they are still inlined (a pinned search path would
-- stop that).
CREATE OR REPLACE FUNCTION outbox_utf8(value text) RETURNS bytea
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
SELECT pg_catalog.decode(pg_catalog.replace(value, pg_catalog.chr(92),
                                             pg_catalog.chr(92) OPERATOR(pg_catalog.||)
                                             pg_catalog.chr(92)), 'escape')
$$;

CREATE OR REPLACE FUNCTION outbox_shard_of(id uuid) RETURNS smallint
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
SELECT (pg_catalog.get_byte(pg_catalog.uuid_send(id), 15) OPERATOR(pg_catalog.&) 31)::smallint
$$;

-- The shard of a caller's key in its namespace: sha256 of namespace, 0x1f, key
-- (outbox_utf8's body written out).
CREATE OR REPLACE FUNCTION outbox_key_shard(namespace text, key text) RETURNS smallint
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
SELECT (pg_catalog.get_byte(pg_catalog.sha256(pg_catalog.decode(pg_catalog.replace(
            namespace OPERATOR(pg_catalog.||) pg_catalog.chr(31) OPERATOR(pg_catalog.||) key,
            pg_catalog.chr(92), pg_catalog.chr(92) OPERATOR(pg_catalog.||) pg_catalog.chr(92)),
          'escape')), 31) OPERATOR(pg_catalog.&) 31)::smallint
$$;

-- id with its shard bits set to shard (a new id that must live on that shard).
CREATE OR REPLACE FUNCTION outbox_on_shard(id uuid, shard smallint) RETURNS uuid
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
SELECT pg_catalog.encode(pg_catalog.set_byte(pg_catalog.uuid_send(id), 15,
    (pg_catalog.get_byte(pg_catalog.uuid_send(id), 15) OPERATOR(pg_catalog.&) 224)
    OPERATOR(pg_catalog.|) shard), 'hex')::pg_catalog.uuid
$$;

-- Whether the tables are distributed (Citus): outbox migrate --distribute sets it
-- for the database. A session that unsets it only makes a delegated write refuse.
CREATE OR REPLACE FUNCTION outbox_distributed() RETURNS boolean
    LANGUAGE sql STABLE PARALLEL SAFE AS $$
SELECT coalesce(current_setting('outbox.distributed', true), '') = 'on'
$$;

-- On Citus, plan the rest of the transaction's statements per call (until the
-- calling function returns, if it sets plan_cache_mode itself). Citus 14.0.1 adds
-- a copy of the shard's plan to a kept (generic) plan each time one runs on the
-- node holding its shard, and never finds it again (citusdata/citus pull request
-- 8824): a worker's session grew by about 100 kB a step, 28 kB a statement, until
-- the server ran out of memory. Planning per call costs a worker about 7 % more
-- CPU a step (4 % of a writer's steps/s), and two statements' planning for each
-- costed effect a deliverer settles. Called first by what runs on a worker and
-- reads or writes its shards from PL/pgSQL (triggers, the step's writes); on one
-- server it does nothing.
CREATE OR REPLACE FUNCTION outbox_citus_plans_per_call() RETURNS void
    LANGUAGE plpgsql AS $$
BEGIN
    IF outbox_distributed() THEN
        PERFORM set_config('plan_cache_mode', 'force_custom_plan', true);
    END IF;
END
$$;

-- This node's own copies (placements) of the shards of tables (co-located, the
-- first one's owner theirs) for the distribution value shard, where PL/pgSQL may
-- write them by name: on a Citus worker holding the shards' only placement. NULL
-- anywhere else (one server; the coordinator, where a transaction may have
-- reached a placement through other connections; a worker without the shards;
-- shards kept twice; a caller who does not own the tables): write through the
-- distributed tables there.
--
-- Why by name: Citus 14.0.1 deparses, parses and plans a statement on a
-- distributed table again on every call from PL/pgSQL (its kept plans leak,
-- outbox_citus_plans_per_call), about 150 us a statement on a worker; the same
-- statement on the placement, by dynamic SQL, costs PostgreSQL's parse and plan
-- of it alone. A function delegated to the worker (force_delegation) may touch
-- only the shards of its distribution argument, all on that worker, so no other
-- connection of the transaction can hold rows it writes there. What Citus's own
-- writers hold is held here too, for the whole transaction: a share lock on the
-- shards' metadata, which a shard move or split takes exclusively (on every
-- node) before it switches placements; the placement is read after it.
CREATE OR REPLACE FUNCTION outbox_shard_placements(shard smallint, tables regclass[])
    RETURNS regclass[]
    LANGUAGE plpgsql AS $$
DECLARE
    first bigint;
    tbl regclass;
    placements regclass[] := '{}';
BEGIN
    IF NOT outbox_distributed() THEN
        RETURN NULL;  -- (apart: on one server the next line would not parse)
    ELSIF citus_is_coordinator() THEN
        RETURN NULL;
    END IF;
    first := get_shard_id_for_distribution_column(tables[1], shard);
    IF NOT pg_has_role((SELECT c.relowner FROM pg_class AS c WHERE c.oid = tables[1]), 'USAGE')
    THEN
        RETURN NULL;  -- (lock_shard_metadata is the tables' owner's)
    END IF;
    PERFORM lock_shard_metadata(5, ARRAY[first]);  -- ShareLock, as Citus's writers
    IF (SELECT count(*) <> 1 OR bool_or(p.groupid <> g.groupid)
          FROM pg_dist_placement AS p, pg_dist_local_group AS g
         WHERE p.shardid = first) THEN
        RETURN NULL;
    END IF;
    -- (simple expressions, a loop: cheaper here than a query over the arrays)
    FOREACH tbl IN ARRAY tables LOOP
        placements := placements
            || to_regclass(tbl::text || '_' || get_shard_id_for_distribution_column(tbl, shard));
    END LOOP;
    RETURN placements;
END
$$;

-- The statement a step writes with: "lock" the run's lock and "move" its update on
-- target (the runs, or a worker's placement of them), "step" the step's insert,
-- "effect" an effect's insert, with their values as $n. Prepared on a worker's
-- placements (outbox_prepare_placements), run by dynamic SQL through the tables
-- elsewhere (outbox_write_step_apart): one text, so the two cannot drift.
CREATE OR REPLACE FUNCTION outbox_placement_statement(what text, target regclass) RETURNS text
    LANGUAGE sql STABLE PARALLEL SAFE AS $$
SELECT CASE what
    -- (the row as one value of the table's type: a prepared statement must keep
    -- its result's columns, which r.* would change when a migration adds one,
    -- and the step reads the value into a variable whose type must not change
    -- from one shard's placement to the next)
    WHEN 'lock' THEN format('SELECT ROW(r.*)::outbox_runs AS run FROM %s AS r
                WHERE r.id = $1 AND r.shard = $2 FOR NO KEY UPDATE', target)
    WHEN 'move' THEN format('UPDATE %s AS r SET state = $3, plan = $4, current_step = $5,
                       step_count = $6, spent = $7, reserved = $8, step_head = $9
                 WHERE r.id = $1 AND r.shard = $2', target)
    WHEN 'step' THEN format('INSERT INTO %s AS s (run_id, shard, seq, step_id, kind, result,
                       state, plan, hash)
                VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
                ON CONFLICT (run_id, step_id, shard) DO NOTHING RETURNING s.seq', target)
    -- (a placement has no default for seq: the table's identity is drawn here,
    -- from the node's own range, as Citus would)
    WHEN 'effect' THEN format('INSERT INTO %s (id, run_id, step_id, step_index, kind, payload,
                       payload_hash, schema_version, idempotency_key, ordering_key,
                       max_attempts, compensate, cost, priority, fairness_key, status,
                       available_at, approval, approval_deadline, trace_parent, shard,
                       namespace, seq)
                VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16,
                        $17, $18, $19, $20, $21, $22,
                        nextval(pg_get_serial_sequence(''outbox_effects'', ''seq'')))', target)
END
$$;

-- Whether the statements a step writes a worker's placements with (placements:
-- outbox_shard_placements' of the runs, the steps and the effects) are prepared in
-- this session, preparing the missing ones; false without placements. Named for
-- their placement: "outbox.lock:" the run's lock, "outbox.move:" its update,
-- "outbox.step:" the step's insert, "outbox.effect:" an effect's insert. By dynamic
-- SQL each was parsed, analysed and planned again on every call, about 150 us of a
-- worker's 1,000 a step (a run's lock 42-66 us against 13 prepared, its update 82
-- against 53); PostgreSQL keeps these plans (they read no distributed table), so
-- Citus's growing plans (outbox_citus_plans_per_call) do not apply. A prepared
-- statement takes no parameters from PL/pgSQL: callers EXECUTE it with literals
-- (format's %L).
--
-- Asked of pg_prepared_statements on every call (about 20 us), not remembered: a
-- DEALLOCATE ALL (psycopg sends one after a rollback) or a DISCARD ALL would leave
-- a remembered name pointing at nothing. And asked by name and text: a login may
-- prepare a statement of one of these names in its own session on a worker, then
-- call the step there, which runs as the tables' owner; a statement whose text is
-- not exactly ours is replaced, never run. (The same text prepared under another
-- search_path is analysed again under the step's when it runs: PostgreSQL's plan
-- cache does that whenever the search path differs.)
CREATE OR REPLACE FUNCTION outbox_prepare_placements(placements regclass[]) RETURNS boolean
    LANGUAGE plpgsql AS $$
DECLARE
    names text[];
    texts text[];
    ready text[];
BEGIN
    IF cardinality(placements) IS DISTINCT FROM 3 OR array_position(placements, NULL) IS NOT NULL
    THEN
        RETURN false;
    END IF;
    names := ARRAY['outbox.lock:' || placements[1], 'outbox.move:' || placements[1],
                   'outbox.step:' || placements[2], 'outbox.effect:' || placements[3]];
    texts := ARRAY[
        format('PREPARE %I AS %s', names[1], outbox_placement_statement('lock', placements[1])),
        format('PREPARE %I AS %s', names[2], outbox_placement_statement('move', placements[1])),
        format('PREPARE %I AS %s', names[3], outbox_placement_statement('step', placements[2])),
        format('PREPARE %I AS %s', names[4],
               outbox_placement_statement('effect', placements[3]))];
    ready := ARRAY(SELECT p.name FROM pg_prepared_statements AS p
                     JOIN unnest(names, texts) AS w(name, text)
                       ON p.name = w.name AND p.statement = w.text);
    IF cardinality(ready) = 4 THEN
        RETURN true;
    END IF;
    FOR i IN 1..4 LOOP
        CONTINUE WHEN names[i] = ANY (ready);
        IF EXISTS (SELECT 1 FROM pg_prepared_statements AS p WHERE p.name = names[i]) THEN
            EXECUTE format('DEALLOCATE %I', names[i]);
        END IF;
        EXECUTE texts[i];
    END LOOP;
    RETURN true;
END
$$;
