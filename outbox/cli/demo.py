"""``outbox demo``: a real agent run on the embedded default."""

from __future__ import annotations

import click

from outbox.cli._common import CliContext, console, emit, json_option, pass_cli, table

__all__ = ["COMMANDS"]


@click.command("demo")
@json_option
@pass_cli
def demo(cli: CliContext, as_json: bool) -> None:
    """Reconcile a month of invoices: steps checkpointed, effects intended, then listed."""
    ob = cli.outbox
    run = ob.start_run("invoice-reconciler", "1.0.0", {"month": "2026-10"}, budget=25.0)
    invoices = run.call(
        "fetch-invoices", lambda: [{"id": f"INV-{i}", "amount": 100 + i} for i in range(1, 6)]
    )

    def notify(tx):  # type: ignore[no-untyped-def]
        for invoice in invoices:
            tx.intend(
                "http.request",
                {"method": "POST", "url": "http://127.0.0.1/ledger", "json": invoice},
            )
        tx.set_state({"matched": len(invoices)})
        return len(invoices)

    run.transaction("post-ledger", notify)
    run.complete({"posted": len(invoices)})
    effects = run.effects()
    emit(
        {"run": run.record, "effects": effects},
        as_json,
        lambda: table(
            f"run {run.id}: {len(effects)} effects intended",
            ["kind", "status", "idempotency key"],
            [(e.kind, e.status.value, e.idempotency_key) for e in effects],
        ),
    )
    if not as_json:
        console.print("see them with: outbox effects list")


COMMANDS = [demo]
