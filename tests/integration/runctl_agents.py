"""Agent handlers run by real ``outbox worker`` processes in the run-control tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from outbox import Run, StepTransaction


def _note(path: str, line: str) -> None:
    with Path(path).open("a") as handle:
        handle.write(line + "\n")


def _post(tx: StepTransaction, run: Run, step: str, **options: Any) -> str:
    payload = {"url": run.inputs["sink"] + "/" + step, "json": {"operation": f"{run.id}:{step}"}}
    return tx.intend("http.request", payload, **options).idempotency_key


def held_then_go(run: Run) -> Any:
    """An effect due in a few seconds, a wait for "go", then another effect.

    (The delay leaves an operator's ``outbox runs pause`` time to start, even on
    a loaded machine, before the effect is due.)
    """
    first = run.transaction("first", lambda tx: _post(tx, run, "first", delay_seconds=8.0))
    run.wait_signal("go", name="go")
    second = run.transaction("second", lambda tx: _post(tx, run, "second"))
    return [first, second]


def three_steps(run: Run) -> Any:
    """A tool call and two steps that each post to the sink; every function call is logged."""
    log = run.inputs["log"]

    def fetch() -> dict[str, str]:
        _note(log, f"fetch {run.id}")
        return {"customer": "ap@example.com"}

    customer = run.call("fetch", fetch)

    def step(name: str) -> Any:
        def body(tx: StepTransaction) -> str:
            _note(log, f"{name} {run.id}")
            return _post(tx, run, name)

        return body

    charge = run.transaction("charge", step("charge"))
    notify = run.transaction("notify", step("notify"))
    return {"customer": customer, "keys": [charge, notify]}
