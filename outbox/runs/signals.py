"""Signals: an approval, a webhook or an event sent to a run, kept until a wait consumes it."""

from __future__ import annotations

import uuid

from pydantic import BaseModel, ConfigDict

from outbox.blobs import Blob
from outbox.errors import RunTerminal
from outbox.ids import uuid7
from outbox.models import LIVE_RUN_STATUSES
from outbox.storage.run_tx import RunTx

__all__ = ["SignalReceipt", "send_signal"]


class SignalReceipt(BaseModel):
    """What happened to a signal: stored (or a duplicate of one stored), and did it wake the run.

    ``outbox signal --json`` prints it, and ``outbox serve`` answers a signal with
    it (202); its JSON Schema is ``schemas/report.signal.json``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: The stored signal (None when it duplicates one stored before).
    signal_id: uuid.UUID | None
    #: The same ``dedup_key`` was accepted before: nothing was stored.
    duplicate: bool
    #: The run was waiting for this signal and is runnable again.
    woke_run: bool


def send_signal(
    tx: RunTx,
    run_id: uuid.UUID,
    name: str,
    payload_json: str,
    dedup_key: str,
    blob: Blob | None = None,
) -> SignalReceipt:
    """Store a signal for a live run and wake it if it waits for this name.

    A paused run keeps the signal; it is consumed when the resumed run reaches its wait.
    """
    status = tx.lock(run_id).status
    if status not in LIVE_RUN_STATUSES:
        raise RunTerminal(run_id, status.value)
    signal_id = uuid7()
    if not tx.insert_signal(signal_id, run_id, name, payload_json, dedup_key):
        return SignalReceipt(signal_id=None, duplicate=True, woke_run=False)
    tx.put_blobs(run_id, [blob])
    woke = tx.wake_signalled(run_id, name)
    return SignalReceipt(signal_id=signal_id, duplicate=False, woke_run=woke)
