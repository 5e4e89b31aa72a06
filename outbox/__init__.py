"""agent-outbox: transactional-outbox side-effect delivery for long-running agents.

Agents write their step checkpoint and their intended effects in one PostgreSQL
transaction; deliverers perform each effect with a stable idempotency key and
record the outcome, fenced against stale workers.
"""

from __future__ import annotations

from outbox.client import Outbox
from outbox.errors import (
    BudgetExceeded,
    ConfigurationError,
    DatabaseError,
    EffectFailed,
    EffectNotFound,
    EffectTimeout,
    EmbeddedServerError,
    IdempotencyConflict,
    LeaseLost,
    NotFound,
    OutboxError,
    PayloadError,
    RunNotFound,
    RunStateError,
    RunTerminal,
    SchemaError,
    SchemaOutdated,
    SchemaTooNew,
    SignalTimeout,
    UnknownEffectKind,
    ValidationError,
    VersionMismatch,
    WaitTimeout,
)
from outbox.keys import compensation_key, derive_key
from outbox.models import (
    Compensation,
    Effect,
    EffectAttempt,
    EffectIntent,
    EffectStatus,
    RunRecord,
    RunStart,
    RunStatus,
    StepRecord,
)
from outbox.runs.intents import OutboxTransaction, StepTransaction
from outbox.runs.run import Run
from outbox.settings import Settings
from outbox.storage.embedded import EmbeddedServer
from outbox.storage.migrate import migrate

__version__ = "0.1.0"

__all__ = [
    "BudgetExceeded",
    "Compensation",
    "ConfigurationError",
    "DatabaseError",
    "Effect",
    "EffectAttempt",
    "EffectFailed",
    "EffectIntent",
    "EffectNotFound",
    "EffectStatus",
    "EffectTimeout",
    "EmbeddedServer",
    "EmbeddedServerError",
    "IdempotencyConflict",
    "LeaseLost",
    "NotFound",
    "Outbox",
    "OutboxError",
    "OutboxTransaction",
    "PayloadError",
    "Run",
    "RunNotFound",
    "RunRecord",
    "RunStart",
    "RunStateError",
    "RunStatus",
    "RunTerminal",
    "SchemaError",
    "SchemaOutdated",
    "SchemaTooNew",
    "Settings",
    "SignalTimeout",
    "StepRecord",
    "StepTransaction",
    "UnknownEffectKind",
    "ValidationError",
    "VersionMismatch",
    "WaitTimeout",
    "__version__",
    "compensation_key",
    "derive_key",
    "migrate",
]
