"""The deliverer side: the contract deliverer authors implement, and the daemons that call them.

``from outbox.delivery import Deliverer, Delivery, Succeeded, Retry, Failed`` is
the import path for third-party deliverers; everything it names lives in
:mod:`outbox.delivery.contract`.
"""

from __future__ import annotations

from outbox.delivery.contract import (
    AttemptNotes,
    Deliverer,
    DelivererConfig,
    Delivery,
    DeliveryError,
    Failed,
    NotApplied,
    Outcome,
    PermanentError,
    Retry,
    RetryableError,
    Succeeded,
    Unknown,
    is_async,
)

__all__ = [
    "AttemptNotes",
    "Deliverer",
    "DelivererConfig",
    "Delivery",
    "DeliveryError",
    "Failed",
    "NotApplied",
    "Outcome",
    "PermanentError",
    "Retry",
    "RetryableError",
    "Succeeded",
    "Unknown",
    "is_async",
]
