-- What a row holds for a value whose canonical JSON is canonical: the value, or
-- (over outbox.blob_threshold_bytes) a reference to it, stored once by its
-- sha256 in outbox_blobs and recorded as used by owner (a run, or an effect of
-- no run), on the owner's shard, as outbox.blobs and outbox.storage.blob_store
-- do. A blob already there is left as it is (it may be another namespace's,
-- which a confined login could not update) and held until commit, so `outbox gc`
-- cannot take it meanwhile (the insert's trigger, outbox_blobs_written).
CREATE OR REPLACE FUNCTION outbox_store_value(owner uuid, value jsonb, canonical text) RETURNS jsonb
    LANGUAGE plpgsql AS $$
DECLARE
    size bigint := octet_length(canonical);
    p_shard smallint := outbox_shard_of(owner);
    sha text;
BEGIN
    IF size <= outbox_setting('blob_threshold_bytes')::bigint THEN
        RETURN value;
    END IF;
    sha := encode(sha256(convert_to(canonical, 'UTF8')), 'hex');
    INSERT INTO outbox_blobs AS b (sha256, bytes, data, shard) VALUES (sha, size, canonical, p_shard)
    ON CONFLICT ON CONSTRAINT outbox_blobs_pkey DO NOTHING;
    INSERT INTO outbox_blob_refs AS f (owner, sha256, shard)
    VALUES (outbox_store_value.owner, sha, p_shard)
    ON CONFLICT ON CONSTRAINT outbox_blob_refs_pkey DO NOTHING;
    RETURN jsonb_build_object('__outbox_blob__', jsonb_build_object('bytes', size, 'sha256', sha));
END
$$;

-- The mark of the transaction that is writing (a uuid from a digest of its id and
-- its start, to the microsecond): what outbox_blobs and outbox_blob_refs record
-- of the transaction that wrote a row (written_in, set by their triggers), so that
-- a login confined to a namespace is shown what its own transaction wrote before
-- any run of its namespace uses it (a run's inputs are stored before the run is).
-- Nothing a session can set or choose: a login that reads another transaction's
-- mark off a value both namespaces use cannot make its own transaction have it,
-- and a transaction that comes to reuse an id (after a restore, on a logical
-- replica, after a Citus shard move) does not share its start. On Citus, the
-- node's own transaction (the triggers and the policies run on the node holding
-- the row).
CREATE OR REPLACE FUNCTION outbox_write_mark() RETURNS uuid
    LANGUAGE sql STABLE SET search_path FROM CURRENT AS $$
SELECT md5(pg_current_xact_id()::text || '/' || outbox_us(transaction_timestamp()))::uuid
$$;

-- Whether mark is this transaction's (outbox_write_mark), without giving it an id.
-- Its search path pinned (as every function here that a policy or a trigger runs
-- in the caller's session): inlined into a policy, its `=` and `md5` would be
-- looked up in the caller's search path, where a login that may create objects
-- in a schema could put an `=` that always holds.
CREATE OR REPLACE FUNCTION outbox_written_here(mark uuid) RETURNS boolean
    LANGUAGE sql STABLE SET search_path FROM CURRENT AS $$
SELECT mark = md5(pg_current_xact_id_if_assigned()::text || '/'
                  || outbox_us(transaction_timestamp()))::uuid
$$;

-- A stored value's row as written: its text must hash to its sha256 (a login that
-- stored a text of its own under another value's sha256 first would have made
-- that value unreadable to everyone who stored it later: readers refuse a text
-- that is not its sha256's); it records the transaction writing it, whatever the
-- writer said (outbox_write_mark); and it holds the value already stored under
-- that name, if any, until the writer commits (a key-share lock, as the
-- reference's foreign key takes later), so `outbox gc`, which skips locked rows,
-- does not take it before the writer's reference is there: the insert that
-- follows finds it and does nothing (the writer's policies may hide it, and an
-- upsert could not touch it). As the tables' owner, so the lock reaches a row the
-- writer cannot see, once the text is checked (only a writer that has the text
-- can hold a value), on this node's placement.
CREATE OR REPLACE FUNCTION outbox_blobs_written() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
    IF NEW.sha256 IS DISTINCT FROM encode(sha256(outbox_utf8(NEW.data)), 'hex') THEN
        RAISE EXCEPTION 'outbox_blobs: sha256=% is not the sha256 of the text stored with it',
            NEW.sha256 USING ERRCODE = 'check_violation';
    END IF;
    EXECUTE format('SELECT FROM %s AS b WHERE b.sha256 = $1 AND b.shard = $2 FOR KEY SHARE',
                   outbox_placement_of('outbox_blobs', NEW.shard))
      USING NEW.sha256, NEW.shard;
    NEW.written_in := outbox_write_mark();
    RETURN NEW;
END
$$;

DROP TRIGGER IF EXISTS outbox_blobs_written ON outbox_blobs;
CREATE TRIGGER outbox_blobs_written BEFORE INSERT ON outbox_blobs
    FOR EACH ROW EXECUTE FUNCTION outbox_blobs_written();

-- A stored value's use as written: the transaction writing it (outbox_write_mark).
CREATE OR REPLACE FUNCTION outbox_blob_refs_written() RETURNS trigger
    LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    NEW.written_in := outbox_write_mark();
    RETURN NEW;
END
$$;

DROP TRIGGER IF EXISTS outbox_blob_refs_written ON outbox_blob_refs;
CREATE TRIGGER outbox_blob_refs_written BEFORE INSERT ON outbox_blob_refs
    FOR EACH ROW EXECUTE FUNCTION outbox_blob_refs_written();

-- The sha256 a value names when it is a reference to a stored value (an object
-- whose one key is __outbox_blob__, naming a sha256 string), else NULL. One
-- expression (the planner inlines it), each test in its own branch.
CREATE OR REPLACE FUNCTION outbox_reference_sha(value jsonb) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
SELECT CASE WHEN jsonb_typeof(value) IS DISTINCT FROM 'object' THEN NULL
            WHEN NOT value ? '__outbox_blob__' THEN NULL
            WHEN value - '__outbox_blob__' <> '{}'::jsonb THEN NULL
            WHEN jsonb_typeof(value->'__outbox_blob__'->'sha256') IS DISTINCT FROM 'string'
                THEN NULL
            ELSE value->'__outbox_blob__'->>'sha256' END
$$;

-- A value as read from a row of shard (its owner's), with a reference replaced by
-- the value it names (outbox_stored_text). (Without a shard: any shard's copy, on
-- one server.)
CREATE OR REPLACE FUNCTION outbox_resolve(value jsonb, shard smallint DEFAULT NULL) RETURNS jsonb
    LANGUAGE plpgsql STABLE AS $$
DECLARE
    sha text := outbox_reference_sha(value);
BEGIN
    IF sha IS NULL THEN
        RETURN value;
    END IF;
    RETURN outbox_stored_text(sha, shard)::jsonb;
END
$$;

-- The text a chain link hashes for a value: the value's own (value::text), or for
-- a reference the stored value's text as outbox_blobs holds it, whose sha256 the
-- reference names. (Not its jsonb rendering: a value the client stored holds its
-- canonical JSON, and `outbox audit verify`, the exported record's script too,
-- checks that the text a link hashed is the one the reference names.)
CREATE OR REPLACE FUNCTION outbox_value_text(value jsonb, shard smallint) RETURNS text
    LANGUAGE plpgsql STABLE AS $$
DECLARE
    sha text := outbox_reference_sha(value);
BEGIN
    IF sha IS NULL THEN
        RETURN value::text;
    END IF;
    RETURN outbox_stored_text(sha, shard);
END
$$;

-- The text of the value stored as sha on shard (NULL: any shard's copy). The text
-- read is hashed first, as outbox.storage.blob_store.fetch does: one that is not
-- its sha256's (edited after it was written) is refused with OB012 naming it,
-- never returned as a step's result, a run's state or a payload.
CREATE OR REPLACE FUNCTION outbox_stored_text(sha text, shard smallint) RETURNS text
    LANGUAGE plpgsql STABLE AS $$
DECLARE
    stored text;
BEGIN
    IF outbox_stored_text.shard IS NULL THEN
        SELECT b.data INTO stored FROM outbox_blobs AS b WHERE b.sha256 = sha LIMIT 1;
    ELSE
        SELECT b.data INTO stored FROM outbox_blobs AS b
         WHERE b.sha256 = sha AND b.shard = outbox_stored_text.shard;
    END IF;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'stored value sha256=% is missing from outbox_blobs', sha;
    END IF;
    IF encode(sha256(convert_to(stored, 'UTF8')), 'hex') IS DISTINCT FROM sha THEN
        PERFORM outbox_raise('OB012',
            format('stored value sha256=%s does not match its text in outbox_blobs '
                   '(altered after it was written): refused', sha),
            jsonb_build_object('sha256', sha));
    END IF;
    RETURN stored;
END
$$;
