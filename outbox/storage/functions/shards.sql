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
