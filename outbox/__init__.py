"""agent-outbox: transactional-outbox side-effect delivery for long-running agents.

Agents write their step checkpoint and their intended effects in one PostgreSQL
transaction; deliverers perform each effect with a stable idempotency key and
record the outcome, fenced against stale workers.
"""

from __future__ import annotations

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
