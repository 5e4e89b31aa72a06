-- Wake listeners on channel, at most once per window across every SQL API
-- writer: a NOTIFY only when the previous one the SQL API sent on the channel
-- is older than the window (outbox.notify_window_ms, else the rule). Returns
-- whether this transaction notifies. See docs/sql-api.md for what covers the
-- commits that skip it.
CREATE OR REPLACE FUNCTION outbox_wake(channel text) RETURNS boolean
    LANGUAGE plpgsql AS $$
DECLARE
    window_us double precision := 1000 * outbox_setting('notify_window_ms')::double precision;
    now_us bigint := floor(extract(epoch FROM clock_timestamp()) * 1000000)::bigint;
    last_us bigint;
    flag text := 'outbox.notified_' || channel;
BEGIN
    -- PostgreSQL folds a transaction's identical notifications into one.
    IF current_setting(flag, true) = 'on' THEN
        RETURN true;
    END IF;
    IF channel = 'outbox_effects' THEN
        SELECT last_value INTO last_us FROM outbox_wake_clock_effects;
    ELSIF channel = 'outbox_runs' THEN
        SELECT last_value INTO last_us FROM outbox_wake_clock_runs;
    ELSE
        RAISE EXCEPTION 'outbox_wake: unknown channel %', channel;
    END IF;
    IF now_us - last_us < window_us THEN
        RETURN false;
    END IF;
    PERFORM setval(('outbox_wake_clock_' || substring(channel FROM 8))::regclass, now_us);
    PERFORM pg_notify(channel, '');
    PERFORM set_config(flag, 'on', true);
    RETURN true;
END
$$;
