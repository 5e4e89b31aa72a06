"""Agent handlers run by real ``outbox worker`` processes in the chaos tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from outbox import Run, StepTransaction


def _note(path: str, line: str) -> None:
    with Path(path).open("a") as handle:
        handle.write(line + "\n")


def tool_then_effect(run: Run) -> Any:
    """A tool call, then a step that intends an effect from the tool's result."""
    log = run.inputs["log"]
    _note(log, "handler")

    def lookup_customer() -> dict[str, str]:
        _note(log, "tool")
        return {"email": "ap@example.com"}

    customer = run.call("lookup-customer", lookup_customer)

    def notify(tx: StepTransaction) -> str:
        return tx.intend("k.notify", {"to": customer["email"]}).idempotency_key

    return run.transaction("notify", notify)


def twelve_steps(run: Run) -> Any:
    """Twelve steps; step seven charges through a sink that rate-limits, and waits for it."""
    log = run.inputs["log"]
    _note(log, "handler")
    for n in range(1, 13):
        if n == 7:
            charge = run.transaction(
                "step-07",
                lambda tx: str(
                    tx.intend(
                        "http.request",
                        {
                            "url": run.inputs["sink"] + "/charge",
                            "json": {"operation": f"{run.id}:charge"},
                        },
                        cost=2.0,
                    ).id
                ),
            )
            run.await_effect(charge, step_id="step-07-settled")
            continue

        def step(tx: StepTransaction, n: int = n) -> None:
            tx.set_state({"done": n})

        run.transaction(f"step-{n:02d}", step)
    return run.state
