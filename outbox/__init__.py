"""agent-outbox: transactional-outbox side-effect delivery for long-running agents.

Agents write their step checkpoint and their intended effects in one PostgreSQL
transaction; deliverers perform each effect with a stable idempotency key and
record the outcome, fenced against stale workers.

Every name below is imported when first used: ``import outbox`` (and so
``outbox --help``) does not load SQLAlchemy, the client or the workers.

The names are what an agent's code uses: the clients, the run and step handles,
the workers, the models and settings, the key helpers, and the errors that reach
an agent. Deliverer authors import from ``outbox.delivery``; administration and
control flow stay in their own modules (``_MOVED`` below names them).
"""

from __future__ import annotations

import importlib
import typing

if typing.TYPE_CHECKING:
    from outbox.async_client import AsyncOutbox
    from outbox.client import Outbox
    from outbox.errors import (
        ApprovalRefused,
        BudgetExceeded,
        ConfigurationError,
        DatabaseError,
        EffectFailed,
        EffectNotFound,
        EffectRejected,
        EffectTimeout,
        ForkRefused,
        IdempotencyConflict,
        LeaseLost,
        MissingExtra,
        NotFound,
        OutboxError,
        PayloadError,
        ReplayRefused,
        RunExists,
        RunNotFound,
        RunPaused,
        RunStateError,
        RunTerminal,
        SchemaError,
        SchemaOutdated,
        SchemaTooNew,
        SignalTimeout,
        StepAlreadyRecorded,
        StoredValueAltered,
        ValidationError,
        WaitTimeout,
    )
    from outbox.governance.gates import ApprovalPolicy, OnTimeout
    from outbox.keys import compensation_key, derive_key
    from outbox.models import (
        AttemptOutcome,
        Compensation,
        Effect,
        EffectAttempt,
        EffectIntent,
        EffectStatus,
        OnConflict,
        RunMode,
        RunRecord,
        RunStart,
        RunStatus,
        StepRecord,
        StepStatus,
    )
    from outbox.runs.async_run import AsyncOutboxTransaction, AsyncRun, AsyncStepTransaction
    from outbox.runs.async_worker import AsyncWorker
    from outbox.runs.intents import OutboxTransaction
    from outbox.runs.run import Run
    from outbox.runs.signals import SignalReceipt
    from outbox.runs.steps import StepTransaction
    from outbox.runs.worker import Worker, WorkerSettings
    from outbox.settings import Settings

#: Where each exported name lives (imported on first use, see ``__getattr__``).
_WHERE: dict[str, str] = {
    "ApprovalPolicy": "outbox.governance.gates",
    "ApprovalRefused": "outbox.errors",
    "AsyncOutbox": "outbox.async_client",
    "AsyncOutboxTransaction": "outbox.runs.async_run",
    "AsyncRun": "outbox.runs.async_run",
    "AsyncStepTransaction": "outbox.runs.async_run",
    "AsyncWorker": "outbox.runs.async_worker",
    "AttemptOutcome": "outbox.models",
    "BudgetExceeded": "outbox.errors",
    "Compensation": "outbox.models",
    "ConfigurationError": "outbox.errors",
    "DatabaseError": "outbox.errors",
    "Effect": "outbox.models",
    "EffectAttempt": "outbox.models",
    "EffectFailed": "outbox.errors",
    "EffectIntent": "outbox.models",
    "EffectNotFound": "outbox.errors",
    "EffectRejected": "outbox.errors",
    "EffectStatus": "outbox.models",
    "EffectTimeout": "outbox.errors",
    "ForkRefused": "outbox.errors",
    "IdempotencyConflict": "outbox.errors",
    "LeaseLost": "outbox.errors",
    "MissingExtra": "outbox.errors",
    "NotFound": "outbox.errors",
    "OnConflict": "outbox.models",
    "OnTimeout": "outbox.governance.gates",
    "Outbox": "outbox.client",
    "OutboxError": "outbox.errors",
    "OutboxTransaction": "outbox.runs.intents",
    "PayloadError": "outbox.errors",
    "ReplayRefused": "outbox.errors",
    "Run": "outbox.runs.run",
    "RunExists": "outbox.errors",
    "RunMode": "outbox.models",
    "RunNotFound": "outbox.errors",
    "RunPaused": "outbox.errors",
    "RunRecord": "outbox.models",
    "RunStart": "outbox.models",
    "RunStateError": "outbox.errors",
    "RunStatus": "outbox.models",
    "RunTerminal": "outbox.errors",
    "SchemaError": "outbox.errors",
    "SchemaOutdated": "outbox.errors",
    "SchemaTooNew": "outbox.errors",
    "Settings": "outbox.settings",
    "SignalReceipt": "outbox.runs.signals",
    "SignalTimeout": "outbox.errors",
    "StepAlreadyRecorded": "outbox.errors",
    "StepRecord": "outbox.models",
    "StepStatus": "outbox.models",
    "StepTransaction": "outbox.runs.steps",
    "StoredValueAltered": "outbox.errors",
    "ValidationError": "outbox.errors",
    "WaitTimeout": "outbox.errors",
    "Worker": "outbox.runs.worker",
    "WorkerSettings": "outbox.runs.worker",
    "compensation_key": "outbox.keys",
    "derive_key": "outbox.keys",
}


#: Names ``outbox`` exported before its surface was narrowed, and where they live.
#: Only the error message reads this: they are not re-exported, so the top level
#: stays what an agent author needs (docs/reference/client.md lists both).
_MOVED: dict[str, str] = {
    "Condition": "outbox.governance.gates",
    "DeliveryError": "outbox.delivery",
    "EmbeddedServer": "outbox.storage.admin.embedded",
    "EmbeddedServerError": "outbox.errors",
    "Gate": "outbox.governance.gates",
    "MigrationError": "outbox.errors",
    "Paused": "outbox.runs.run_base",
    "PermanentError": "outbox.delivery",
    "RetryableError": "outbox.delivery",
    "Suspended": "outbox.runs.run_base",
    "migrate": "outbox.storage.migrate",
}


def __getattr__(name: str) -> typing.Any:
    module = _WHERE.get(name)
    if module is None:
        moved = _MOVED.get(name)
        hint = f"; import it from {moved}" if moved else ""
        raise AttributeError(f"module 'outbox' has no attribute {name!r}{hint}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup does not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})


__version__ = "0.1.0"

__all__ = [
    "ApprovalPolicy",
    "ApprovalRefused",
    "AsyncOutbox",
    "AsyncOutboxTransaction",
    "AsyncRun",
    "AsyncStepTransaction",
    "AsyncWorker",
    "AttemptOutcome",
    "BudgetExceeded",
    "Compensation",
    "ConfigurationError",
    "DatabaseError",
    "Effect",
    "EffectAttempt",
    "EffectFailed",
    "EffectIntent",
    "EffectNotFound",
    "EffectRejected",
    "EffectStatus",
    "EffectTimeout",
    "ForkRefused",
    "IdempotencyConflict",
    "LeaseLost",
    "MissingExtra",
    "NotFound",
    "OnConflict",
    "OnTimeout",
    "Outbox",
    "OutboxError",
    "OutboxTransaction",
    "PayloadError",
    "ReplayRefused",
    "Run",
    "RunExists",
    "RunMode",
    "RunNotFound",
    "RunPaused",
    "RunRecord",
    "RunStart",
    "RunStateError",
    "RunStatus",
    "RunTerminal",
    "SchemaError",
    "SchemaOutdated",
    "SchemaTooNew",
    "Settings",
    "SignalReceipt",
    "SignalTimeout",
    "StepAlreadyRecorded",
    "StepRecord",
    "StepStatus",
    "StepTransaction",
    "StoredValueAltered",
    "ValidationError",
    "WaitTimeout",
    "Worker",
    "WorkerSettings",
    "__version__",
    "compensation_key",
    "derive_key",
]
