-- Where a row lives: its logical shard, one of 32, fixed for good (outbox.shards).
-- A run's is read from its id; the rows of a run (steps, effects, attempts,
-- signals, ledger, values) live on its shard; an effect of no run on its id's;
-- a caller's key (of a run or an effect) is registered on the key's own shard.
-- On one server the shard is a column and a check; on Citus it is what the
-- tables are distributed by (docs/howto/citus.md).

CREATE OR REPLACE FUNCTION outbox_shard_of(id uuid) RETURNS smallint
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
SELECT (get_byte(uuid_send(id), 15) & 31)::smallint
$$;

-- The shard of a caller's key in its namespace: sha256 of namespace, 0x1f, key.
CREATE OR REPLACE FUNCTION outbox_key_shard(namespace text, key text) RETURNS smallint
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
SELECT (get_byte(sha256(convert_to(namespace || chr(31) || key, 'UTF8')), 31) & 31)::smallint
$$;

-- id with its shard bits set to shard (a new id that must live on that shard).
CREATE OR REPLACE FUNCTION outbox_on_shard(id uuid, shard smallint) RETURNS uuid
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
SELECT encode(set_byte(uuid_send(id), 15, (get_byte(uuid_send(id), 15) & 224) | shard), 'hex')::uuid
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
