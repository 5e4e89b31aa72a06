"""Settings of the delivering processes: one base for poll and stream mode, and the relay's.

Every option ``outbox deliver`` takes is a field here, with its default written
once; the CLI shows these defaults and passes only what the user set.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from outbox.ids import RELAY_OWNER_PREFIX, default_owner
from outbox.retry import RetryPolicy

__all__ = ["DeliverySettings", "RelaySettings", "StreamSettings"]


class DeliverySettings(BaseModel):
    """How one delivery daemon behaves, whatever its source of effects (poll or Kafka)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: Calls in flight at once. Twice the batch size: the next claim can start
    #: while the previous batch's completion commits (measured in bench/).
    concurrency: int = Field(default=200, ge=1, le=10_000)
    #: Effects claimed per statement (poll), or records read per poll (stream).
    batch_size: int = Field(default=100, ge=1, le=10_000)
    #: Seconds an attempt is leased; heartbeats extend it three times per lease.
    lease_seconds: float = Field(default=10.0, gt=0, le=86_400)
    #: Longest wait between claims when idle (poll: NOTIFY usually wakes sooner;
    #: stream: the Kafka consumer's poll timeout).
    poll_seconds: float = Field(default=1.0, gt=0, le=3600)
    #: How often expired attempts are reconciled and stopping runs moved on.
    reconcile_seconds: float = Field(default=1.0, gt=0, le=3600)
    #: How often the session locks of other deliverers are checked: a registered
    #: deliverer whose lock is free is gone (outbox.delivery.liveness).
    gone_check_seconds: float = Field(default=0.5, gt=0, le=3600)
    #: A deliverer found gone must still be gone this long later before its
    #: idempotent attempts are put back (a lock session that reconnects is not a death).
    gone_grace_seconds: float = Field(default=0.4, ge=0, le=3600)
    #: After a PostgreSQL (re)start every session lock is free: for this long no
    #: deliverer counts as gone, while the live ones take their locks again (they
    #: retry at least every 2 s). Leases cover whatever is really lost meanwhile.
    restart_grace_seconds: float = Field(default=5.0, ge=0, le=86_400)
    #: Put a gone deliverer's idempotent attempts back without waiting for their
    #: leases (False: leases only, as before 0012).
    early_recovery: bool = True
    #: On stop, how long in-flight calls may take to finish.
    grace_seconds: float = Field(default=30.0, ge=0, le=86_400)
    #: A pending effect of a kind no deliverer here knows gets a note after this long.
    unknown_kind_grace_seconds: float = Field(default=60.0, ge=0)
    #: A pending effect held back this long by an earlier one of its ordering key
    #: gets a note naming that effect and its state.
    blocked_note_grace_seconds: float = Field(default=30.0, ge=0)
    #: An effect whose payload schema version this deliverer does not know waits this long.
    schema_retry_seconds: float = Field(default=300.0, ge=0)
    #: How often the effect gauges are counted again (and within a second of a
    #: claim or an outcome recorded by this daemon).
    stats_seconds: float = Field(default=15.0, gt=0)
    #: This daemon's name in leases, the attempt log and logs (default: host, process
    #: id and a random part; may not start with the relay's prefix).
    owner: str = Field(default_factory=default_owner, min_length=1, max_length=200)
    #: Backoff of a retried attempt: doubling from this (with jitter)...
    retry_base_seconds: float = Field(default=0.5, ge=0)
    #: ... up to this; a sink's ``Retry-After`` wins.
    retry_cap_seconds: float = Field(default=300.0, ge=0)
    #: Attempts an effect gets when neither its intent nor its kind's config says.
    max_attempts: int = Field(default=10, ge=1, le=1000)

    @property
    def heartbeat_seconds(self) -> float:
        """How often leases are pushed out: three times per lease."""
        return self.lease_seconds / 3

    @property
    def retry_policy(self) -> RetryPolicy:
        """The backoff shape."""
        return RetryPolicy(self.retry_base_seconds, self.retry_cap_seconds, self.max_attempts)

    @field_validator("owner")
    @classmethod
    def _not_a_relay(cls, owner: str) -> str:
        # Stream deliverers take effects from relay-named owners; a deliverer so
        # named would have its calls taken from it mid-flight.
        if owner.startswith(RELAY_OWNER_PREFIX):
            raise ValueError(f"a deliverer's owner may not start with {RELAY_OWNER_PREFIX!r}")
        return owner


#: Consumer settings a stream deliverer makes itself: each is not a ``--kafka-option``.
STREAM_CONSUMER_SET: dict[str, str] = {
    "bootstrap_servers": "give it as --from-kafka",
    "group_id": "give it as --group",
    "enable_auto_commit": "a stream deliverer commits an offset only past outcomes recorded",
    "auto_offset_reset": "a new group reads each partition from its earliest record",
}


class StreamSettings(DeliverySettings):
    """A stream deliverer: a delivery daemon whose effects come from a Kafka consumer group."""

    #: Kafka bootstrap servers, ``host:port[,host:port...]``.
    bootstrap_servers: str = Field(min_length=1)
    #: The consumer group the stream deliverers share.
    group: str = Field(default="outbox-deliverers", min_length=1)
    #: Effects of kind K are read from topic PREFIX+K.
    topic_prefix: str = "outbox."
    #: Extra kafka-python ``KafkaConsumer`` settings (``--kafka-option KEY=VALUE``), such as
    #: ``session_timeout_ms`` and ``heartbeat_interval_ms``.
    consumer: dict[str, Any] = Field(default_factory=dict)

    @field_validator("consumer")
    @classmethod
    def _leaves_what_the_deliverer_sets(cls, consumer: dict[str, Any]) -> dict[str, Any]:
        for key, why in STREAM_CONSUMER_SET.items():
            if key in consumer:
                raise ValueError(f"{key}: {why}")
        return consumer

    #: How long outcomes wait for the rest of the attempts under way before they are
    #: written. A stream's claims do not ride its writes (its records come from the
    #: broker), so without a wait each write records the few attempts that ended
    #: while the last was in PostgreSQL: a write per three effects at 1,700 /s.
    write_linger_seconds: float = Field(default=0.005, ge=0, le=1)


#: Producer settings a relay's promises rest on: a record is published once every
#: in-sync replica has it, and a send the producer retries is not written twice.
RELAY_PRODUCER_REQUIRED: dict[str, Any] = {"acks": "all", "enable_idempotence": True}
#: Producer defaults ``--kafka-option`` may change. A round's envelopes (500 of a
#: few hundred bytes) fit one produce batch per partition: kafka-python's 16 KiB
#: cut a round into about ten per partition, each waking its sender thread (59-61
#: against 52-56 µs of relay CPU per effect, measured with ``bench/stream.py``'s shapes).
RELAY_PRODUCER_DEFAULTS: dict[str, Any] = {"linger_ms": 5, "batch_size": 512 * 1024}
#: Spellings kafka-python takes as the same setting (``acks=-1`` is ``acks='all'``).
_SAME_AS: dict[Any, tuple[Any, ...]] = {"all": ("all", -1)}


def _relay_owner() -> str:
    return RELAY_OWNER_PREFIX + default_owner()


class RelaySettings(BaseModel):
    """How a relay behaves: claim pending effects into ``dispatched``, publish them to Kafka."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: Kafka bootstrap servers, ``host:port[,host:port...]``.
    bootstrap_servers: str = Field(min_length=1)
    #: Effects of kind K go to topic PREFIX+K.
    topic_prefix: str = "outbox."
    #: Effects claimed and published per round.
    batch_size: int = Field(default=500, ge=1, le=100_000)
    #: A dispatched effect not delivered within this long is dispatched again (and
    #: so is a batch whose relay died between its claim and its publish).
    dispatch_ttl_seconds: float = Field(default=300.0, gt=0)
    #: Longest wait between claims when idle (a NOTIFY usually wakes the relay sooner).
    poll_seconds: float = Field(default=1.0, gt=0, le=3600)
    #: How often a relay re-dispatches expired dispatches and rescues dead relays' claims.
    reconcile_seconds: float = Field(default=1.0, gt=0, le=3600)
    #: What a relay that is gone dispatched waits at most this long more (deliverers
    #: take those whose records reached Kafka meanwhile), not the whole TTL; then it
    #: is dispatched again.
    orphan_ttl_seconds: float = Field(default=30.0, ge=0, le=86_400)
    #: A relay whose session lock is free is gone when found so twice this far apart.
    gone_grace_seconds: float = Field(default=0.4, ge=0, le=3600)
    #: No relay counts as gone this long after PostgreSQL started (a restart frees
    #: every lock at once).
    restart_grace_seconds: float = Field(default=5.0, ge=0, le=86_400)
    #: This relay's name in leases and logs (must start with the relay prefix).
    owner: str = Field(default_factory=_relay_owner, min_length=1, max_length=200)
    #: Extra kafka-python ``KafkaProducer`` settings (``--kafka-option KEY=VALUE``): they
    #: override the relay's ``linger_ms=5`` and ``batch_size=524288``; ``acks='all'``,
    #: ``enable_idempotence=True``, ``retries`` above 0 and at most 5 requests in flight
    #: cannot be changed.
    producer: dict[str, Any] = Field(default_factory=dict)

    @field_validator("producer")
    @classmethod
    def _keeps_what_the_relay_needs(cls, producer: dict[str, Any]) -> dict[str, Any]:
        if "bootstrap_servers" in producer:
            raise ValueError("bootstrap_servers: give it as --kafka")
        for key, needed in RELAY_PRODUCER_REQUIRED.items():
            if key in producer and producer[key] not in _SAME_AS.get(needed, (needed,)):
                raise ValueError(
                    f"{key}={producer[key]!r}: a relay publishes with {key}={needed!r}"
                    " (a record it counts as published must not be lost or written twice)"
                )
        # what an idempotent producer also needs, said here in the option's own words
        if producer.get("retries") == 0:
            raise ValueError("retries=0: a relay's idempotent producer needs retries > 0")
        in_flight = producer.get("max_in_flight_requests_per_connection")
        if isinstance(in_flight, int) and in_flight > 5:
            raise ValueError(
                f"max_in_flight_requests_per_connection={in_flight}: a relay's idempotent"
                " producer allows at most 5"
            )
        return producer

    @property
    def producer_settings(self) -> dict[str, Any]:
        """What the relay's ``KafkaProducer`` is made with: defaults, then ``producer``."""
        return {**RELAY_PRODUCER_DEFAULTS, **self.producer, **RELAY_PRODUCER_REQUIRED}

    @field_validator("owner")
    @classmethod
    def _is_a_relay(cls, owner: str) -> str:
        # A stream deliverer takes an effect a relay holds once it read its record;
        # that is only safe for an owner that never calls the sink itself.
        if not owner.startswith(RELAY_OWNER_PREFIX):
            raise ValueError(f"a relay's owner must start with {RELAY_OWNER_PREFIX!r}")
        return owner
