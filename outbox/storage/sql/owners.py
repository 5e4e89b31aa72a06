"""Owner locks: how a deliverer's death is seen without waiting for its leases.

A delivery daemon holds the session-level advisory lock ``(OWNER_LOCK_CLASS,
hashtext(owner))`` on a connection of its own and registers its owner in
``outbox_owners``. PostgreSQL releases the lock when that connection's backend
ends, which it does at once when the process is killed (its socket closes).
A registered owner whose lock nobody holds is *gone*.

Two things guard against a lock seen free while its owner lives:

- a PostgreSQL restart drops every lock at once: for ``restart_grace`` seconds
  after the server started, no owner counts as gone (live daemons take their
  locks again meanwhile; leases cover the rest, as before);
- the reconciler acts only on an owner it found gone twice, a grace period
  apart (:mod:`outbox.delivery.liveness`), so a lock connection that dropped
  and came back is not taken for a death.

Only attempts of idempotent kinds are put back early (same key, fenced by the
attempt number): a non-idempotent attempt keeps waiting for its lease.
"""

from __future__ import annotations

from functools import cache

from sqlalchemy import text
from sqlalchemy.sql.expression import TextClause

__all__ = [
    "FORGET_OWNER",
    "GONE_CONDITION",
    "OWNER_LOCK_CLASS",
    "REGISTER_OWNER",
    "TAKE_OWNER_LOCK",
    "end_relay_dispatches",
    "expire_gone_owner",
    "forget_gone_owners",
    "gone_owner_names",
    "gone_owners",
    "holding_kinds",
    "in_flight_by_owner",
    "live_owners",
    "owner_shards",
    "owners_holding",
]

#: The first key of every owner lock (``pg_advisory_lock(int, int)``), so owner
#: locks never meet the migration lock (one bigint key) or a transaction lock.
OWNER_LOCK_CLASS = 0x6F62

# psycopg statements of the lock session (outbox.storage.owner_lock).
TAKE_OWNER_LOCK = f"SELECT pg_try_advisory_lock({OWNER_LOCK_CLASS}, hashtext(%s))"
REGISTER_OWNER = (
    "INSERT INTO outbox_owners (owner) VALUES (%s) "
    "ON CONFLICT (owner) DO UPDATE SET registered_at = now()"
)
FORGET_OWNER = "DELETE FROM outbox_owners WHERE owner = %s"

# A session of this database holds o.owner's lock.
_HELD = f"""EXISTS (
        SELECT 1 FROM pg_locks l
        WHERE l.locktype = 'advisory' AND l.granted
          AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
          AND l.classid = {OWNER_LOCK_CLASS}::oid
          AND l.objid = hashtext(o.owner)::oid
          AND l.objsubid = 2)"""
# No session holds it, and the server has been up longer than :restart_grace
# seconds (a restart frees every lock at once).
_GONE = f"""
    pg_postmaster_start_time() < now() - :restart_grace * interval '1 second'
    AND NOT {_HELD}"""
#: The same test for SQL written elsewhere (the duty probe of :mod:`outbox.storage.sql.duties`).
GONE_CONDITION = _GONE


@cache
def gone_owners() -> TextClause:
    """Registered owners whose lock is free, and whether they hold attempts of ``:kinds``.

    Parameters: ``restart_grace`` (seconds), ``kinds`` (text[]). Returns
    ``(owner, holds)``; ``holds`` is true when the owner has an in-flight
    attempt of one of ``kinds``. Read-only; scans only in-flight rows.
    """
    return text(
        f"""SELECT o.owner, EXISTS (
                SELECT 1 FROM outbox_effects e
                WHERE e.status = 'in_flight' AND e.lease_owner = o.owner
                  AND e.kind = ANY(CAST(:kinds AS text[]))) AS holds
            FROM outbox_owners o
            WHERE {_GONE}"""
    )


@cache
def gone_owner_names() -> TextClause:
    """Registered owners whose lock is free (parameter ``restart_grace``, seconds), by name."""
    return text(f"SELECT o.owner FROM outbox_owners o WHERE {_GONE} ORDER BY o.owner")


@cache
def in_flight_by_owner() -> TextClause:
    """What ``:owners`` (text[]) hold: ``(owner, in flight, dispatched, first lease end)`` each.

    With :func:`gone_owner_names`, what ``outbox reconcile`` shows beside the
    expired leases: work a dead deliverer holds until its leases end (or a
    running daemon's liveness check puts the idempotent part back), and what a
    dead Kafka relay dispatched that no deliverer has taken (a running relay
    cuts it to the orphan TTL). Two reads, not a join: on Citus the owners stay
    on the coordinator and the effects are distributed, which one statement
    may not join.
    """
    return text(
        """SELECT e.lease_owner,
                  count(*) FILTER (WHERE e.status = 'in_flight') AS in_flight,
                  count(*) FILTER (WHERE e.status = 'dispatched') AS dispatched,
                  min(e.lease_expires_at) AS lease_ends
             FROM outbox_effects e
            WHERE e.status IN ('in_flight', 'dispatched')
              AND e.lease_owner = ANY(CAST(:owners AS text[]))
            GROUP BY e.lease_owner
            ORDER BY e.lease_owner"""
    )


@cache
def live_owners() -> TextClause:
    """Registered owners whose lock is held: the delivery daemons alive on this database."""
    return text(f"SELECT o.owner FROM outbox_owners o WHERE {_HELD} ORDER BY o.registered_at")


@cache
def holding_kinds() -> TextClause:
    """Which of ``:owners`` (text[]) hold an in-flight attempt of ``:kinds`` (text[]), by name.

    :func:`gone_owners`' ``holds`` for Citus, where the registry and the effects
    are read in statements of their own.
    """
    return text(
        """SELECT DISTINCT e.lease_owner FROM outbox_effects e
            WHERE e.status = 'in_flight' AND e.lease_owner = ANY(CAST(:owners AS text[]))
              AND e.kind = ANY(CAST(:kinds AS text[]))"""
    )


@cache
def owner_shards() -> TextClause:
    """The shards on which ``:owner`` holds an in-flight attempt (Citus)."""
    return text(
        """SELECT DISTINCT e.shard FROM outbox_effects e
            WHERE e.status = 'in_flight' AND e.lease_owner = :owner ORDER BY e.shard"""
    )


@cache
def expire_gone_owner(sharded: bool = False) -> TextClause:
    """Put a gone owner's in-flight attempts of idempotent kinds back to ``pending``, logged.

    Parameters: ``owner``, ``restart_grace``, ``limits`` (JSON ``[{kind,
    max_attempts}]``: the idempotent kinds and each one's default attempt cap),
    ``note``, ``worker``. The owner's lock is checked again in this statement,
    so an owner that came back keeps its attempts. An attempt at its cap is
    left to the lease path (which fails it). Returns the ids put back.
    ``sharded`` (Citus): on the shard ``on_shard`` only, and the lock is not
    checked here (no statement may join the coordinator's owners with the
    distributed effects): the caller checks it just before.
    """
    gone = (
        "SELECT CAST(:owner AS text) AS owner"
        if sharded
        else f"SELECT o.owner FROM outbox_owners o WHERE o.owner = :owner AND {_GONE}"
    )
    on_shard = "AND e.shard = :on_shard" if sharded else ""
    return text(
        f"""WITH gone AS (
                {gone}
            ), limits AS (
                SELECT * FROM jsonb_to_recordset(CAST(:limits AS jsonb))
                    AS k(kind text, max_attempts integer)
            ), changed AS (
                UPDATE outbox_effects e
                SET status = 'pending', lease_owner = NULL, lease_expires_at = NULL,
                    available_at = now(), last_error = :note, completed_at = NULL,
                    updated_at = now()
                FROM gone, limits
                WHERE e.status = 'in_flight' AND e.lease_owner = gone.owner
                  AND e.kind = limits.kind
                  AND e.attempt < coalesce(e.max_attempts, limits.max_attempts)
                  {on_shard}
                RETURNING e.id, e.attempt, e.attempt_started_at, e.shard
            )
            INSERT INTO outbox_effect_attempts
                (effect_id, attempt, worker, started_at, outcome, detail, shard)
            SELECT id, attempt, :worker, attempt_started_at, 'expired',
                   jsonb_build_object('resolution', 'redeliver', 'note', CAST(:note AS text)),
                   shard
            FROM changed
            RETURNING effect_id"""
    )


@cache
def end_relay_dispatches(sharded: bool = False) -> TextClause:
    """Cut the dispatch leases of relay ``:owner`` to ``:ttl`` seconds from now.

    A relay's claim takes effects straight into ``dispatched`` for the dispatch
    TTL; one killed before it published leaves them there with no record for a
    deliverer to claim them from, and it cannot say which ones. Those whose
    records did reach Kafka are taken by deliverers meanwhile; the rest are
    dispatched again by the next re-dispatch after ``ttl`` (same key, a new
    attempt: a late record only finds its effect taken). What a deliverer has
    not claimed yet has had no call made, so this holds for any kind.

    Parameters: ``owner``, ``ttl`` (seconds); ``gone_only`` (boolean): only
    while the owner's lock is free, checked in this statement (a relay found
    gone), else always (a relay starting under the name of one that died);
    ``restart_grace`` (seconds). Returns the ids. ``sharded`` (Citus): on the
    shard ``on_shard`` only, and the lock is not checked here (the owners live
    on the coordinator, which no statement may join with the distributed
    effects): the caller checks it just before.
    """
    gone = (
        "AND e.shard = :on_shard"
        if sharded
        else f"""AND (NOT CAST(:gone_only AS boolean) OR EXISTS (
                  SELECT 1 FROM outbox_owners o WHERE o.owner = :owner AND {_GONE}))"""
    )
    return text(
        f"""UPDATE outbox_effects e
            SET lease_expires_at = now() + :ttl * interval '1 second', updated_at = now()
            WHERE e.status = 'dispatched' AND e.lease_owner = :owner
              AND e.lease_expires_at > now() + :ttl * interval '1 second'
              {gone}
            RETURNING e.id"""
    )


@cache
def owners_holding() -> TextClause:
    """Which of ``:owners`` (text[]) hold an attempt in flight or a dispatch, any namespace.

    One value, a text[] (``outbox_owners_holding``, as the tables' owner: a
    deliverer confined to a namespace sees only that namespace's effects).
    """
    return text("SELECT outbox_owners_holding(CAST(:owners AS text[]))")


@cache
def forget_gone_owners() -> TextClause:
    """Unregister gone owners, registered over a minute ago, that :func:`owners_holding` cleared.

    Parameters: ``owners`` (text[]: candidates a read found gone, less those
    that hold anything), ``restart_grace``. The lock is checked again here, so
    an owner that came back (and may claim again) stays. Returns the owners
    removed.
    """
    return text(
        f"""DELETE FROM outbox_owners o
            WHERE o.owner = ANY(CAST(:owners AS text[]))
              AND o.registered_at < now() - interval '1 minute'
              AND {_GONE}
            RETURNING o.owner"""
    )
