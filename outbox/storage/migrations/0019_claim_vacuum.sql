-- agent-outbox 0019: vacuum the two queue tables by their churn, not their history.
-- Must stay equal to outbox/storage/schema.py (tests/integration/test_migrations.py checks it).
--
-- A claim reads its partial index (outbox_effects_lanes, outbox_runs_lanes) from
-- the oldest entry on. Every claimed row leaves a dead entry at that end, and
-- nothing but VACUUM removes it (inserts land at the other end, so btree's own
-- clean-up never reaches those pages). By default a big table is vacuumed only
-- after 20% of its rows changed, and then VACUUM skips the indexes while fewer
-- than 2% of its pages hold dead rows: with 10M finished effects the claim
-- walked ~700 pages of dead entries, 10 ms, with none behind it. So: vacuum
-- after a fixed number of dead rows, and always clean the indexes. A vacuum of
-- a big table then reads its big indexes each time (~3 s at 10M rows), at most
-- once per autovacuum_naptime; `outbox gc` keeps that small.
-- Storage parameters change under SHARE UPDATE EXCLUSIVE: reads and writes go on.
ALTER TABLE outbox_effects SET (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 10000,
    vacuum_index_cleanup = on
);
ALTER TABLE outbox_runs SET (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 10000,
    vacuum_index_cleanup = on
);
