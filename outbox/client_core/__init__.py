"""What both clients do, written once.

Every operation of :class:`~outbox.Outbox` that is not about waiting (reading
runs and effects, operators' actions, approvals, signals, cancellation, the
audit record) is a sync method here. ``Outbox`` inherits them.
:class:`~outbox.AsyncOutbox` awaits the very same methods through a greenlet on
its async driver (SQLAlchemy's ``AsyncSession`` drives ``Session`` the same
way), so the two clients cannot drift: only connecting, closing, transactions
handed to the caller and workers are written per client.
"""

from __future__ import annotations

from .base import LoadedRun, connect_settings, exposed
from .effects import EffectOperations, effect_filters
from .runs import NewRun, RunOperations, new_run, run_filters, started_run

__all__ = [
    "ClientCore",
    "LoadedRun",
    "NewRun",
    "connect_settings",
    "effect_filters",
    "exposed",
    "new_run",
    "run_filters",
    "started_run",
]


class ClientCore(RunOperations, EffectOperations):
    """Every operation both clients share, over one :class:`~outbox.runs.context.RunContext`."""
