"""The duty probe: one read that tells a delivery daemon which background duty has work.

A daemon's reconciler, approval-deadline, stopping-run and gone-owner rounds
used to run their statements every round, each in a transaction of its own,
busy or not. The probe asks all of their questions in one statement, cheap
on an idle queue (each ``EXISTS`` stops at its first row, by the same index
its round's statement uses). A busy daemon runs it inside the transaction
that records a batch's outcomes and claims the next batch
(:meth:`outbox.storage.async_store.AsyncStore.complete_and_claim`), so a
steady stream of batches costs one commit each; an idle one runs it alone.
Only a duty the probe found work for runs its own statements then.
"""

from __future__ import annotations

from functools import cache

from sqlalchemy import text
from sqlalchemy.sql.expression import TextClause

from outbox.models import STOPPING_RUN_STATUSES
from outbox.storage.sql.common import sql_in
from outbox.storage.sql.owners import GONE_CONDITION

__all__ = ["duty_probe"]


@cache
def duty_probe(sharded: bool = False) -> TextClause:
    """One row: which duties have work now.

    ``sharded`` (Citus): a read of every shard at once (read-only, no lock), and
    no gone owners: the owners live on the coordinator, and Citus refuses a
    statement that joins them with the distributed effects (the caller reads
    them apart: :meth:`~outbox.storage.delivery_duties.DutyStatements.gone_owners`).

    Parameters: ``askable`` (text[]: kinds whose ``unknown`` effects the
    reconciler settles by asking the sink), ``kinds`` (text[]: the idempotent
    kinds early recovery puts back), ``gone`` (boolean: look for gone owners at
    all), ``restart_grace`` (seconds). Columns: ``expired`` (an in-flight lease
    ran out, or a dispatched effect outlived its TTL, or an askable effect is
    ``unknown``: the reconciler has work), ``approvals`` (an approval deadline
    passed), ``stopping`` (a run is being cancelled or compensated), ``gone``
    (JSON ``[[owner, holds], ...]`` as :func:`outbox.storage.sql.owners.gone_owners`
    returns them; ``[]`` when ``gone`` is false).
    """
    gone = "              '[]'::jsonb AS gone" if sharded else _GONE_OWNERS
    return text(
        f"""SELECT
              EXISTS (SELECT 1 FROM outbox_effects
                      WHERE status = 'in_flight' AND lease_expires_at < now())
              OR EXISTS (SELECT 1 FROM outbox_effects
                         WHERE status = 'dispatched' AND lease_expires_at < now())
              OR EXISTS (SELECT 1 FROM outbox_effects
                         WHERE status = 'unknown'
                           AND kind = ANY(CAST(:askable AS text[]))) AS expired,
              EXISTS (SELECT 1 FROM outbox_effects
                      WHERE status = 'awaiting_approval'
                        AND approval_deadline <= now()) AS approvals,
              EXISTS (SELECT 1 FROM outbox_runs
                      WHERE {sql_in("status", STOPPING_RUN_STATUSES)}) AS stopping,
{gone}"""
    )


# Gone owners and whether each holds an attempt of :kinds (outbox.storage.sql.owners).
_GONE_OWNERS = f"""              CASE WHEN CAST(:gone AS boolean) THEN (
                  SELECT coalesce(jsonb_agg(jsonb_build_array(o.owner, EXISTS (
                      SELECT 1 FROM outbox_effects e
                      WHERE e.status = 'in_flight' AND e.lease_owner = o.owner
                        AND e.kind = ANY(CAST(:kinds AS text[]))))), '[]'::jsonb)
                  FROM outbox_owners o
                  WHERE {GONE_CONDITION})
              ELSE '[]'::jsonb END AS gone"""
