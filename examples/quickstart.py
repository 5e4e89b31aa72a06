"""The quickstart's agent: one run, a recorded tool call, an atomic step, an effect delivered.

docs/quickstart.md shows this file whole, with the two commands to start first
(a sample HTTP sink and a deliverer). Then::

    python examples/quickstart.py                 # the sink's URL: the first argument

Run it again, or after killing it anywhere: the run has a business key, so the
same run comes back, and every step it recorded returns its stored result
instead of running again (the invoices are not fetched twice, the row is not
inserted twice, the effect is not intended twice).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from sqlalchemy import Column, Integer, MetaData, String, Table

from outbox import Outbox, StepTransaction

SINK = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8081"

# A table of your own, written in the same transaction as the step's checkpoint.
metadata = MetaData()
closings = Table(
    "quickstart_closings",
    metadata,
    Column("month", String, primary_key=True),
    Column("matched", Integer, nullable=False),
)


def fetch_invoices(month: str) -> list[dict[str, Any]]:
    """A read-only tool call (an API, a slow query): its result is recorded."""
    print(f"fetching the invoices of {month} (a replay does not come here)")
    return [{"id": f"INV-{month}-{n}", "amount": 100 * n} for n in range(1, 6)]


def main() -> None:
    ob = Outbox.connect()  # OUTBOX_DSN if set, else the embedded PostgreSQL in ./.outbox
    metadata.create_all(ob.engine)  # your table, beside outbox's own (once)
    run = ob.start_run(
        agent="invoice-reconciler",
        version="2.3.1",
        inputs={"month": "2026-10"},
        budget=25.0,
        key="close-month-2026-10",  # one run per month: starting it again returns it
    )

    # A recorded tool call: runs outside any transaction; a replay returns the stored result.
    invoices = run.call("fetch-invoices", fetch_invoices, "2026-10")

    # An atomic step: your row, the checkpoint and the intent commit together or not at all.
    def send_summary(tx: StepTransaction) -> dict[str, Any]:
        total = sum(invoice["amount"] for invoice in invoices)
        tx.connection.execute(closings.insert().values(month="2026-10", matched=len(invoices)))
        tx.set_state({"cursor": len(invoices), "total": total})
        tx.set_plan(["close-month"])
        summary = tx.intend(
            "http.request",
            {"url": f"{SINK}/summaries", "json": {"month": "2026-10", "total": total}},
        )
        return {"summary_key": summary.idempotency_key}

    result = run.transaction("send-summary", send_summary)
    if run.status.value != "completed":
        run.complete(result)

    # The intent is a row until a deliverer performs it: wait a little to show its end.
    (effect,) = run.effects()
    for _ in range(50):
        if effect.status.value not in ("pending", "in_flight"):
            break
        time.sleep(0.2)
        effect = ob.effect(effect.id)
    print(f"run {run.id}: {ob.run(run.id).status.value}; steps {run.completed_steps}")
    print(f"effect {effect.id} ({effect.kind}): {effect.status.value}, key {effect.idempotency_key}")
    if effect.status.value == "pending":
        print("still pending: is `outbox deliver --config deliverers.toml` running?")
    ob.close()


if __name__ == "__main__":
    main()
