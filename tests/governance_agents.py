"""Agents the governance tests run in real ``outbox worker`` processes."""

from __future__ import annotations

from typing import Any

from outbox import Run


def pay(run: Run) -> dict[str, Any]:
    """Pay ``inputs.amount`` through the sink, wait for the payment (and its approval), finish."""
    sink, amount, kind = run.inputs["sink"], run.inputs["amount"], run.inputs["kind"]

    def intend(tx: Any) -> str:
        payload = {
            "url": f"{sink}/payments",
            "json": {"operation": f"{run.id}:pay", "amount": amount},
        }
        return str(tx.intend(kind, payload).id)

    effect_id = run.transaction("pay", intend)
    result = run.await_effect(effect_id, step_id="paid")
    return {"paid": amount, "status": result["status"]}
