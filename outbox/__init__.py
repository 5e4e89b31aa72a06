"""agent-outbox: transactional-outbox side-effect delivery for long-running agents.

Agents write their step checkpoint and their intended effects in one PostgreSQL
transaction; deliverers perform each effect with a stable idempotency key and
record the outcome, fenced against stale workers.

Every name below is imported when first used: ``import outbox`` (and so
``outbox --help``) does not load SQLAlchemy, the client or the workers.
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
        DeliveryError,
        EffectFailed,
        EffectNotFound,
        EffectRejected,
        EffectTimeout,
        EmbeddedServerError,
        ForkRefused,
        IdempotencyConflict,
        LeaseLost,
        MigrationError,
        MissingExtra,
        NotFound,
        OutboxError,
        PayloadError,
        PermanentError,
        ReplayRefused,
        RetryableError,
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
    from outbox.gates import ApprovalPolicy, Condition, Gate, OnTimeout
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
    from outbox.runs.intents import OutboxTransaction, StepTransaction
    from outbox.runs.run import Run, Suspended
    from outbox.runs.run_base import Paused
    from outbox.runs.signals import SignalReceipt
    from outbox.runs.worker import Worker, WorkerSettings
    from outbox.settings import Settings
    from outbox.storage.embedded import EmbeddedServer
    from outbox.storage.migrate import migrate

#: Where each exported name lives (imported on first use, see ``__getattr__``).
_WHERE: dict[str, str] = {
    "ApprovalPolicy": "outbox.gates",
    "ApprovalRefused": "outbox.errors",
    "AsyncOutbox": "outbox.async_client",
    "AsyncOutboxTransaction": "outbox.runs.async_run",
    "AsyncRun": "outbox.runs.async_run",
    "AsyncStepTransaction": "outbox.runs.async_run",
    "AsyncWorker": "outbox.runs.async_worker",
    "AttemptOutcome": "outbox.models",
    "BudgetExceeded": "outbox.errors",
    "Compensation": "outbox.models",
    "Condition": "outbox.gates",
    "ConfigurationError": "outbox.errors",
    "DatabaseError": "outbox.errors",
    "DeliveryError": "outbox.errors",
    "Effect": "outbox.models",
    "EffectAttempt": "outbox.models",
    "EffectFailed": "outbox.errors",
    "EffectIntent": "outbox.models",
    "EffectNotFound": "outbox.errors",
    "EffectRejected": "outbox.errors",
    "EffectStatus": "outbox.models",
    "EffectTimeout": "outbox.errors",
    "EmbeddedServer": "outbox.storage.embedded",
    "EmbeddedServerError": "outbox.errors",
    "ForkRefused": "outbox.errors",
    "Gate": "outbox.gates",
    "IdempotencyConflict": "outbox.errors",
    "LeaseLost": "outbox.errors",
    "MigrationError": "outbox.errors",
    "MissingExtra": "outbox.errors",
    "NotFound": "outbox.errors",
    "OnConflict": "outbox.models",
    "OnTimeout": "outbox.gates",
    "Outbox": "outbox.client",
    "OutboxError": "outbox.errors",
    "OutboxTransaction": "outbox.runs.intents",
    "Paused": "outbox.runs.run_base",
    "PayloadError": "outbox.errors",
    "PermanentError": "outbox.errors",
    "ReplayRefused": "outbox.errors",
    "RetryableError": "outbox.errors",
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
    "StepTransaction": "outbox.runs.intents",
    "StoredValueAltered": "outbox.errors",
    "Suspended": "outbox.runs.run",
    "ValidationError": "outbox.errors",
    "WaitTimeout": "outbox.errors",
    "Worker": "outbox.runs.worker",
    "WorkerSettings": "outbox.runs.worker",
    "compensation_key": "outbox.keys",
    "derive_key": "outbox.keys",
    "migrate": "outbox.storage.migrate",
}


def __getattr__(name: str) -> typing.Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'outbox' has no attribute {name!r}")
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
    "Condition",
    "ConfigurationError",
    "DatabaseError",
    "DeliveryError",
    "Effect",
    "EffectAttempt",
    "EffectFailed",
    "EffectIntent",
    "EffectNotFound",
    "EffectRejected",
    "EffectStatus",
    "EffectTimeout",
    "EmbeddedServer",
    "EmbeddedServerError",
    "ForkRefused",
    "Gate",
    "IdempotencyConflict",
    "LeaseLost",
    "MigrationError",
    "MissingExtra",
    "NotFound",
    "OnConflict",
    "OnTimeout",
    "Outbox",
    "OutboxError",
    "OutboxTransaction",
    "Paused",
    "PayloadError",
    "PermanentError",
    "ReplayRefused",
    "RetryableError",
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
    "Suspended",
    "ValidationError",
    "WaitTimeout",
    "Worker",
    "WorkerSettings",
    "__version__",
    "compensation_key",
    "derive_key",
    "migrate",
]
