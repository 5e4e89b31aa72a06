"""The demo's agent: reconcile a month of invoices in twelve checkpointed steps.

Run as ``python -m outbox.demo.agent RUN_ID SINK_URL`` (the demo starts it,
kills it with SIGKILL mid-run, and starts it again: recorded steps replay, the
rest continue), or by a worker: ``outbox worker outbox.demo.agent:reconcile_month
--agent invoice-reconciler --version 1.0.0`` (the sink's URL then comes from
the run's inputs, default ``http://127.0.0.1:8080``, where ``outbox sink``
listens). Every effect carries an ``operation`` id, so the sink can tell a
duplicate *intent* apart from a redelivery of the same one.

Check it survives a kill -9 anywhere::

    outbox check outbox.demo.agent:reconcile_month --agent invoice-reconciler \
        --version 1.0.0 --inputs '{"month": "2026-10"}'
"""

from __future__ import annotations

import random
import sys
import time
from typing import Any

from outbox import Outbox, Run, StepTransaction

__all__ = [
    "AGENT",
    "DEFAULT_SINK",
    "STEPS",
    "VERSION",
    "book_trip",
    "pay_vendor",
    "reconcile_month",
]

AGENT = "invoice-reconciler"
VERSION = "1.0.0"
#: Where effects go when the run's inputs name no sink (``outbox sink``'s default address).
DEFAULT_SINK = "http://127.0.0.1:8080"
CHUNKS = 9
STEPS = 3 + CHUNKS  # fetch invoices, fetch payments, 9 match steps, summary


def fetch_invoices(month: str) -> list[dict[str, Any]]:
    """A slow, read-only tool call (deterministic for the demo)."""
    rng = random.Random(month)
    time.sleep(0.05)
    return [{"id": f"INV-{month}-{i:03d}", "amount": rng.randint(50, 5000)} for i in range(36)]


def fetch_payments(month: str) -> dict[str, int]:
    """Payments received, keyed by invoice id: most match, a few are short."""
    rng = random.Random(month + "/payments")
    time.sleep(0.05)
    paid: dict[str, int] = {}
    for invoice in fetch_invoices(month):
        if rng.random() < 0.85:
            paid[invoice["id"]] = invoice["amount"] - (0 if rng.random() < 0.9 else 10)
    return paid


def reconcile_month(
    run: Run, sink_url: str | None = None, *, step_pause: float | None = None
) -> dict[str, Any]:
    """The agent. Safe to call again on the same run after any crash.

    A worker calls it as ``reconcile_month(run)``: the sink's URL and the pause
    between steps then come from the inputs (``sink``, ``step_pause``; default
    :data:`DEFAULT_SINK` and no pause).
    """
    if sink_url is None:
        sink_url = str(run.inputs.get("sink") or DEFAULT_SINK)
    if step_pause is None:
        step_pause = float(run.inputs.get("step_pause") or 0.0)
    if run.status.value == "completed":
        return dict(run.record.result or {})
    month = run.inputs["month"]
    invoices = run.call("fetch-invoices", fetch_invoices, month)
    payments = run.call("fetch-payments", fetch_payments, month)
    per_chunk = len(invoices) // CHUNKS
    for chunk in range(CHUNKS):
        batch = invoices[chunk * per_chunk : (chunk + 1) * per_chunk]

        def match(
            tx: StepTransaction, batch: list[dict[str, Any]] = batch, chunk: int = chunk
        ) -> dict[str, int]:
            state = dict(run.state or {})
            matched = mismatched = 0
            for invoice in batch:
                paid = payments.get(invoice["id"])
                if paid == invoice["amount"]:
                    matched += 1
                    tx.intend(
                        "http.request",
                        {
                            "url": f"{sink_url}/ledger",
                            "json": {
                                "operation": f"{run.id}:post:{invoice['id']}",
                                "invoice": invoice["id"],
                                "amount": invoice["amount"],
                            },
                        },
                    )
                else:
                    mismatched += 1
                    tx.intend(
                        "http.request",
                        {
                            "url": f"{sink_url}/tickets",
                            "json": {
                                "operation": f"{run.id}:ticket:{invoice['id']}",
                                "invoice": invoice["id"],
                                "expected": invoice["amount"],
                                "paid": paid,
                            },
                        },
                    )
            state["matched"] = state.get("matched", 0) + matched
            state["mismatched"] = state.get("mismatched", 0) + mismatched
            state["cursor"] = chunk + 1
            tx.set_state(state)
            tx.set_plan([f"match-{c + 1:02d}" for c in range(chunk + 1, CHUNKS)] + ["summary"])
            return {"matched": matched, "mismatched": mismatched}

        run.transaction(f"match-{chunk + 1:02d}", match)
        time.sleep(step_pause)

    def summary(tx: StepTransaction) -> dict[str, Any]:
        state = run.state
        tx.intend(
            "http.request",
            {
                "url": f"{sink_url}/summary",
                "json": {
                    "operation": f"{run.id}:summary",
                    "month": month,
                    "matched": state["matched"],
                    "mismatched": state["mismatched"],
                },
            },
        )
        return dict(state)

    result: dict[str, Any] = run.transaction("send-summary", summary)
    run.complete(result)
    return result


def pay_vendor(run: Run) -> dict[str, Any]:
    """Prepare a payment batch, wait (days, if need be) for the CFO's approval, then pay.

    Run by an ``outbox worker``: while it waits, the run is parked and holds nothing.
    """
    sink_url = run.inputs.get("sink") or DEFAULT_SINK
    batch = run.call("prepare-batch", lambda: {"vendor": "ACME", "amount": 12_500})
    approval = run.wait_signal("cfo-approval", name="approval", timeout=3600)

    def pay(tx: StepTransaction) -> str:
        return tx.intend(
            "http.request",
            {
                "url": f"{sink_url}/payments",
                "json": {"operation": f"{run.id}:pay", **batch, "approved_by": approval["by"]},
            },
        ).idempotency_key

    run.transaction("pay", pay)
    return {"paid": batch["amount"], "approved_by": approval["by"]}


def book_trip(run: Run, sink_url: str) -> None:
    """Book flight, hotel and car; each booking declares how to undo it."""
    for item in ("flight", "hotel", "car"):

        def book(tx: StepTransaction, item: str = item) -> None:
            refund = {
                "url": f"{sink_url}/refunds",
                "json": {"operation": f"{run.id}:refund:{item}", "item": item},
            }
            tx.intend(
                "http.request",
                {"url": f"{sink_url}/bookings", "json": {"operation": f"{run.id}:book:{item}"}},
                compensate=("http.request", refund),
            )

        run.transaction(f"book-{item}", book)


def main(argv: list[str]) -> None:
    """Entry point of an agent process: ``python -m outbox.demo.agent RUN_ID SINK_URL``."""
    run_id, sink_url = argv[1], argv[2]
    with Outbox.connect() as ob:
        reconcile_month(ob.run(run_id), sink_url, step_pause=0.15)


if __name__ == "__main__":
    main(sys.argv)
