"""Deciding a held effect in the console, clicked through in real headless Chromium.

A real run intends a payment over a gate's threshold (stored in PostgreSQL
like ``outbox gates apply`` does), so it commits ``awaiting_approval``; the
operator signs in, finds it under Approvals, reads the payload and its digest
and approves it; a real delivery daemon then delivers it once to a real HTTP
sink. Each step writes the screenshot docs/console.md shows.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from deliverers.http import HttpDeliverer
from deliverers.testing import IdempotentHttpSink
from outbox import Outbox
from outbox.governance.gates import Gate
from outbox.models import EffectStatus
from outbox.serve.app import OutboxServer
from outbox.serve.settings import Credentials, ServeSettings
from tests.browser.conftest import screenshot
from tests.support import DaemonThread, wait_for

# One Chromium at a time (and one writer of docs/console): one xdist worker.
pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.xdist_group("browser")]

OPERATOR = "operator-token-0123456789"


@pytest.fixture
def console(ob: Outbox) -> Iterator[OutboxServer]:
    running = OutboxServer(
        ob,
        ServeSettings(port=0, counts_cache_seconds=0),
        Credentials(operator_token=OPERATOR.encode()),
    ).start()
    yield running
    running.shutdown()


def test_an_operator_approves_a_held_payment_in_the_browser_and_it_is_delivered_once(
    ob: Outbox, dsn: str, console: OutboxServer, page: Any
) -> None:
    ob.apply_gates(
        [
            Gate(
                name="large-payments",
                kind="payments.send",
                when=[{"pointer": "/json/amount", "op": "gt", "value": 10_000}],
                timeout=86_400,
                on_timeout="reject",
            )
        ]
    )
    with IdempotentHttpSink() as sink:
        run = ob.start_run("payer", "v1", {"invoice": "2024-0042"})
        effect_id = run.transaction(
            "pay",
            lambda tx: str(
                tx.intend(
                    "payments.send",
                    {
                        "method": "POST",
                        "url": f"{sink.url}/payments",
                        "json": {"operation": "pay-0042", "to": "acct-7", "amount": 12_500},
                    },
                ).id
            ),
        )
        held = ob.effect(effect_id)
        assert held.status == EffectStatus.AWAITING_APPROVAL

        page.goto(f"{console.url}/console/login?next=/console/unknown")
        page.fill("input[name=token]", OPERATOR)
        page.fill("input[name=name]", "carol")
        page.click("form.action button")
        page.click("nav >> text=Approvals")
        assert effect_id[:8] in page.inner_text("#held")
        page.click(f"#held a[href='/console/effects/{effect_id}'] >> text=review")
        assert page.inner_text("#digest") == held.digest
        assert "large-payments" in page.inner_text("#approval")
        assert "12500" in page.inner_text("#payload")
        screenshot(page, "effect-awaiting-approval")

        page.fill("#approve-form input[name=note]", "invoice 2024-0042 matches PO 88")
        page.click("#approve-form button[type=submit]")
        assert page.inner_text("#status") == "pending"
        approved = [a for a in ob.store.attempts(held.id) if a.outcome == "approved"]
        assert approved and approved[0].worker == "carol (console)"
        assert approved[0].detail["digest"] == held.digest

        allow = {"allow_private": ["127.0.0.1"]}
        deliverers = {"payments.send": HttpDeliverer.from_config("payments.send", allow)}
        with DaemonThread(dsn, deliverers):
            wait_for(lambda: ob.effect(effect_id).status == EffectStatus.SUCCEEDED, timeout=60)
        stats = sink.stats()
        assert stats["operations_applied"] == 1 and stats["duplicate_operations"] == []
        page.reload()
        screenshot(page, "effect-approved")
