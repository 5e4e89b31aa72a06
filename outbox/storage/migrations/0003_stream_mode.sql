-- agent-outbox 0003: stream mode through Kafka. An effect the relay published
-- is "dispatched" until a stream deliverer claims it; keys consumers have seen.
-- Must stay equal to outbox/schema.py (tests/integration/test_migrations.py checks it).

ALTER TABLE outbox_effects DROP CONSTRAINT outbox_effects_status_check;
ALTER TABLE outbox_effects ADD CONSTRAINT outbox_effects_status_check CHECK (status IN (
    'pending', 'in_flight', 'dispatched', 'succeeded', 'failed', 'unknown', 'cancelled',
    'compensated'));

-- A dispatched effect still holds back later effects of its ordering key.
DROP INDEX outbox_effects_ordering;
CREATE INDEX outbox_effects_ordering ON outbox_effects (ordering_key, seq)
    WHERE ordering_key IS NOT NULL
      AND status IN ('pending', 'in_flight', 'dispatched', 'unknown');

-- Dispatched but not delivered within the TTL: the reconciler re-dispatches.
CREATE INDEX outbox_effects_dispatched ON outbox_effects (lease_expires_at)
    WHERE status = 'dispatched';

-- Idempotency keys a Kafka consumer group has processed (deliverers.kafka.DedupConsumer).
CREATE TABLE outbox_consumed_keys (
    consumer_group  TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    consumed_at     TIMESTAMP WITH TIME ZONE NOT NULL DEFAULT now(),
    CONSTRAINT outbox_consumed_keys_pkey PRIMARY KEY (consumer_group, idempotency_key)
);
