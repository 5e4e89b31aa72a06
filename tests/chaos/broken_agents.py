"""Agents for ``outbox check``'s own tests: classic mistakes, and a correct agent, sync and async.

They post to the check's recording sink (``OUTBOX_CHECK_SINK``, set in the
worker processes of a check), so what they send outside the outbox is seen.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
import uuid
from typing import Any

import httpx

from outbox import AsyncRun, AsyncStepTransaction, Outbox, Run, StepTransaction


def _sink() -> str:
    return os.environ["OUTBOX_CHECK_SINK"]


def _customer() -> dict[str, str]:
    return {"id": "C-42", "email": "new@example.com"}


def emails_from_plain_python(run: Run) -> Any:
    """BROKEN: the welcome email is sent by plain Python between steps, not intended.

    Every resume runs that code again: a crash anywhere after it sends a second email.
    """
    customer = run.call("load-customer", _customer)
    httpx.post(
        f"{_sink()}/emails",
        json={"operation": f"{run.id}:welcome-email", "to": customer["email"]},
    ).raise_for_status()
    run.transaction("mark-welcomed", lambda tx: tx.set_state({"welcomed": customer["id"]}))
    return run.transaction("open-account", lambda tx: _open_account(tx, run, customer))


def charges_inside_a_call(run: Run) -> Any:
    """BROKEN: a non-idempotent charge is made inside a recorded call, not intended.

    A recorded call runs again when its process dies before the result is recorded.
    """

    def charge() -> Any:
        response = httpx.post(
            f"{_sink()}/charges", json={"operation": f"{run.id}:charge", "amount": 120}
        )
        response.raise_for_status()
        return {"charged": True}

    receipt = run.call("charge-card", charge)
    return run.transaction("record-receipt", lambda tx: tx.set_state({"receipt": receipt}))


def onboards_correctly(run: Run) -> Any:
    """CORRECT: the email and the account are intended in steps; a deliverer sends them."""
    customer = run.call("load-customer", _customer)

    def welcome(tx: StepTransaction) -> None:
        tx.set_state({"welcomed": customer["id"]})
        tx.intend("email.send", {"to": customer["email"], "template": "welcome"})

    run.transaction("send-welcome", welcome)
    approval = run.wait_signal("approval", name="approved", timeout=600)
    return run.transaction("open-account", lambda tx: _open_account(tx, run, customer, approval))


def _open_account(
    tx: StepTransaction, run: Run, customer: dict[str, str], approval: Any = None
) -> dict[str, Any]:
    tx.intend("accounts.open", {"operation": f"{run.id}:open", "customer": customer["id"]})
    return {"customer": customer["id"], "approved_by": approval}


def charges_without_a_stable_key(run: Run) -> Any:
    """BROKEN: a charge is intended outside any step, with no key of its own.

    A run-less intent without a key gets a fresh random one each time: every
    resume that passes here intends a second charge, under a second key that no
    sink could dedup.
    """
    order = run.call("load-order", lambda: {"id": "O-7", "amount": 120})
    with Outbox.connect() as ob, ob.transaction() as tx:
        tx.intend("payments.charge", {"operation": f"{run.id}:charge", "amount": order["amount"]})
    return run.transaction("mark-charged", lambda tx: tx.set_state({"charged": order["id"]}))


def charges_with_a_key_of_its_own(run: Run) -> Any:
    """CORRECT: the same run-less charge, with a key derived from the run.

    A resume that passes here again finds the intent already made under that key.
    """
    order = run.call("load-order", lambda: {"id": "O-7", "amount": 120})
    with Outbox.connect() as ob, ob.transaction() as tx:
        tx.intend(
            "payments.charge",
            {"operation": f"{run.id}:charge", "amount": order["amount"]},
            key=f"{run.id}:charge",
        )
    return run.transaction("mark-charged", lambda tx: tx.set_state({"charged": order["id"]}))


def stamps_its_receipt_outside_a_step(run: Run) -> Any:
    """BROKEN: the result is computed from the clock and randomness outside any recorded step.

    A resumed run computes it again, differently: the same run reports a
    second receipt number. Two uninterrupted runs already disagree, which is
    how ``outbox check`` sees it.
    """
    order = run.call("load-order", lambda: {"id": "O-7", "amount": 120})
    receipt = {"order": order["id"], "issued_at": time.time(), "number": random.randrange(10**9)}
    run.transaction("mark-paid", lambda tx: tx.set_state({"paid": order["id"]}))
    return receipt


def charges_a_non_idempotent_sink(run: Run) -> Any:
    """CORRECT: a charge intended in a step, for a kind a config declares not idempotent."""
    order = run.call("load-order", lambda: {"id": "O-9", "amount": 80})

    def charge(tx: StepTransaction) -> dict[str, Any]:
        tx.intend("payments.charge", {"operation": f"{run.id}:charge", "amount": order["amount"]})
        return {"charged": order["id"]}

    return run.transaction("charge", charge)


def raises_on_every_run(run: Run) -> Any:
    """BROKEN: fails every time (a misconfiguration): there is nothing to compare a crash with."""
    run.call("load-order", lambda: {"id": "O-7", "amount": 120})
    raise RuntimeError("the payment provider is not configured")


def charges_under_a_fresh_step_id(run: Run) -> Any:
    """BROKEN: the step id has a random part, so it changes on every attempt.

    A resumed run records the step again under a new id, and intends the charge
    again under a new key: no sink can tell the second charge from the first.
    """
    order = run.call("load-order", lambda: {"id": "O-7", "amount": 120})

    def charge(tx: StepTransaction) -> dict[str, Any]:
        tx.intend("payments.charge", {"operation": f"{run.id}:charge", "amount": order["amount"]})
        return {"charged": order["id"]}

    return run.transaction(f"charge-{uuid.uuid4()}", charge)


def charges_under_a_step_id_of_its_process(run: Run) -> Any:
    """BROKEN: the step id is a UUID made from the worker's process id.

    Two runs side by side in one worker agree; a run resumed by another worker
    after a crash does not, and so never reaches the crash points planned there
    (and, a UUID being masked when results are compared, ends "alike").
    """
    order = run.call("load-order", lambda: {"id": "O-7", "amount": 120})

    def charge(tx: StepTransaction) -> dict[str, Any]:
        tx.intend("payments.charge", {"operation": f"{run.id}:charge", "amount": order["amount"]})
        return {"charged": order["id"]}

    return run.transaction(f"charge-{uuid.uuid5(uuid.NAMESPACE_OID, str(os.getpid()))}", charge)


#: A helper that ignores SIGTERM and would outlive its worker.
_STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"


def starts_a_stubborn_helper(run: Run) -> Any:
    """CORRECT for the outbox, but it forks a helper that ignores SIGTERM.

    Each helper's pid is appended to ``$CHECK_HELPER_PIDS``, so a test can see
    that the check left none of them running.
    """

    def start() -> int:
        helper = subprocess.Popen([sys.executable, "-c", _STUBBORN])
        with open(os.environ["CHECK_HELPER_PIDS"], "a") as pids:
            pids.write(f"{helper.pid}\n")
        return helper.pid

    run.call("start-helper", start)
    # Time for a test to interrupt the check while this worker and its helper live.
    linger = float(os.environ.get("CHECK_HELPER_LINGER", "0"))
    run.call("linger", lambda: time.sleep(linger))

    def done(tx: StepTransaction) -> dict[str, bool]:
        tx.set_state({"helper": "started"})
        return {"ok": True}

    return run.transaction("done", done)


# -- the same agents, async (an ``async def`` handler gets an AsyncRun) ------------------


async def emails_from_plain_python_async(run: AsyncRun) -> Any:
    """BROKEN, async: the welcome email is sent by plain Python between steps."""
    customer = await run.call("load-customer", _customer)
    async with httpx.AsyncClient() as client:
        response = await client.post(
            f"{_sink()}/emails",
            json={"operation": f"{run.id}:welcome-email", "to": customer["email"]},
        )
        response.raise_for_status()
    await run.transaction("mark-welcomed", lambda tx: tx.set_state({"welcomed": customer["id"]}))

    async def open_account(tx: AsyncStepTransaction) -> dict[str, Any]:
        account = {"operation": f"{run.id}:open", "customer": customer["id"]}
        await tx.intend("accounts.open", account)
        return {"customer": customer["id"]}

    return await run.transaction("open-account", open_account)


async def onboards_correctly_async(run: AsyncRun) -> Any:
    """CORRECT, async: the email and the account are intended in steps; a deliverer sends them."""
    customer = await run.call("load-customer", _customer)

    async def welcome(tx: AsyncStepTransaction) -> None:
        tx.set_state({"welcomed": customer["id"]})
        await tx.intend("email.send", {"to": customer["email"], "template": "welcome"})

    await run.transaction("send-welcome", welcome)
    approval = await run.wait_signal("approval", name="approved", timeout=600)

    async def open_account(tx: AsyncStepTransaction) -> dict[str, Any]:
        account = {"operation": f"{run.id}:open", "customer": customer["id"]}
        await tx.intend("accounts.open", account)
        return {"customer": customer["id"], "approved_by": approval}

    return await run.transaction("open-account", open_account)


def publishes_a_ledger(run: Run) -> Any:
    """CORRECT: three ledger entries intended in one step, published by ``kafka.publish``."""
    topic = run.inputs["topic"]
    entries = run.call("load-entries", lambda: [{"entry": n, "run": str(run.id)} for n in range(3)])

    def publish(tx: StepTransaction) -> int:
        for entry in entries:
            tx.intend("kafka.publish", {"topic": topic, "value": entry})
        return len(entries)

    return {"published": run.transaction("publish", publish)}
