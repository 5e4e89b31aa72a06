"""Issue 13's "done when", clicked through in real headless Chromium.

Real parts throughout: a real PostgreSQL, real runs and steps, effects
delivered by a real delivery daemon to a real HTTP sink (one of whose kinds
cannot dedup, so a 500 leaves its effects ``unknown``), and ``outbox serve`` on
uvicorn. Each step writes the screenshot docs/console.md shows.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from deliverers.http import HttpDeliverer
from deliverers.testing import Fault, IdempotentHttpSink
from outbox import Outbox
from outbox.models import EffectStatus
from outbox.serve.app import OutboxServer
from outbox.serve.settings import Credentials, ServeSettings
from tests.browser.conftest import screenshot
from tests.support import DaemonThread, wait_for

# One Chromium at a time (and one writer of docs/console): one xdist worker.
pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.xdist_group("browser")]

OPERATOR = "operator-token-0123456789"
KEY = "invoice-2024-0042-reminder"


@pytest.fixture
def sink() -> Iterator[IdempotentHttpSink]:
    with IdempotentHttpSink() as running:
        yield running


def deliverers() -> dict[str, Any]:
    allow = {"allow_private": ["127.0.0.1"]}
    return {
        "http.request": HttpDeliverer.from_config("http.request", allow),
        # A mail gateway that cannot dedup: an error after sending leaves it unknown.
        "mail.send": HttpDeliverer.from_config(
            "mail.send", {**allow, "type": "http", "idempotent": False, "max_attempts": 3}
        ),
    }


def settle(ob: Outbox, dsn: str) -> None:
    """Run a real delivery daemon until every effect is delivered, failed or unknown."""
    with DaemonThread(dsn, deliverers(), retry_base_seconds=0.01, retry_cap_seconds=0.05):
        wait_for(
            lambda: all(
                e.terminal or e.status == EffectStatus.UNKNOWN for e in ob.effects(limit=1000)
            ),
            timeout=60,
            message="every effect delivered or settled",
        )


def populate(ob: Outbox, dsn: str, sink: IdempotentHttpSink) -> dict[str, Any]:
    """Runs of three agents, delivered effects, two unknown effects and a failed one."""
    found: dict[str, Any] = {}
    for agent, version in [("triage", "v3"), ("migrate", "v1"), ("billing", "v1")]:
        for i in range(3):
            run = ob.start_run(agent, version, {"ticket": i}, budget=5)
            run.call("classify", lambda: {"label": "invoice", "confidence": 0.93})

            def post(tx: Any, agent: str = agent, i: int = i) -> str:
                tx.set_state({"stage": "notified", "item": i})
                tx.set_plan(["classify", "notify", "wait for approval", "close"])
                tx.spend(0.25, "model-call")
                return str(
                    tx.intend(
                        "http.request",
                        {
                            "method": "POST",
                            "url": f"{sink.url}/tickets?ticket=k-{i}",
                            "headers": {"X-Source": agent},
                            "json": {"operation": f"{agent}-{i}"},
                        },
                        cost=0.5,
                    ).id
                )

            run.transaction("notify", post)
    settle(ob, dsn)
    billing = ob.start_run("billing", "v2", {"invoice": "2024-0042"}, budget=10)
    found["run"] = str(billing.id)
    billing.call("load-invoice", lambda: {"invoice": "2024-0042", "amount": 1200})
    ob.signal(billing.id, "approval", {"by": "cfo"})
    billing.wait_signal("approval", name="approval", timeout=5)

    def remind(tx: Any) -> list[str]:
        tx.set_state({"stage": "reminded"})
        tx.set_plan(["load-invoice", "approval", "remind", "close"])
        tx.spend(1.2, "draft-reminder")
        mail = {
            "method": "POST",
            "url": f"{sink.url}/mail",
            "json": {"to": "ap@example.com", "template": "reminder", "smtp_password": "pa55"},
        }
        first = tx.intend("mail.send", mail, key=KEY)
        second = tx.intend("mail.send", mail, key=KEY + "-cc")
        # A private address the deliverer is not allowed to reach: refused, failed.
        audit = {"method": "POST", "url": "http://10.255.0.1/audit", "json": {"invoice": 42}}
        bad = tx.intend("http.request", audit, key=KEY + "-audit")
        return [str(first.id), str(second.id), str(bad.id)]

    found["unknown"], found["unknown2"], found["failed"] = billing.transaction("remind", remind)
    sink.inject(Fault("500_after", times=2))  # the two mails: sent, then an error
    settle(ob, dsn)
    assert ob.effect(found["unknown"]).status == EffectStatus.UNKNOWN
    assert ob.effect(found["unknown2"]).status == EffectStatus.UNKNOWN
    assert ob.effect(found["failed"]).status == EffectStatus.FAILED
    return found


@pytest.fixture
def console(ob: Outbox) -> Iterator[OutboxServer]:
    running = OutboxServer(
        ob,
        ServeSettings(port=0, counts_cache_seconds=0),
        Credentials(operator_token=OPERATOR.encode()),
    ).start()
    yield running
    running.shutdown()


class _Forger:
    """A page on another origin whose form posts to the console (a CSRF attempt)."""

    def __init__(self, target: str) -> None:
        html = (
            "<!doctype html><title>You won a prize</title><h1>Claim your prize</h1>"
            f'<form method="post" action="{target}" id="forged">'
            '<input type="hidden" name="outcome" value="succeeded">'
            '<input type="hidden" name="note" value="forged">'
            '<input type="hidden" name="csrf" value="guessed">'
            '<button type="submit">Claim</button></form>'
        ).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(html)))
                self.end_headers()
                self.wfile.write(html)

            def log_message(self, *args: Any) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_console_done_when(
    ob: Outbox, dsn: str, sink: IdempotentHttpSink, console: OutboxServer, page: Any
) -> None:
    data = populate(ob, dsn, sink)
    base = console.url

    # The live overview: backlog, oldest pending, delivery over the last hour.
    page.goto(f"{base}/console/")
    assert page.locator("svg.chart rect").count() >= 1
    screenshot(page, "overview")

    page.goto(f"{base}/console/runs")
    assert page.locator("#runs tr").count() == 1 + 10
    screenshot(page, "runs")

    # Find a run by an effect's key, open it, see its steps and effects.
    page.fill("input[name=q]", KEY)
    page.click("form.search button")
    page.wait_for_url(f"{base}/console/runs/{data['run']}")
    steps = page.locator("#steps").inner_text()
    for step in ("load-invoice", "approval", "remind"):
        assert step in steps
    assert "draft-reminder" in page.locator("#ledger").inner_text()
    assert page.locator("#effects tr").count() == 1 + 3
    screenshot(page, "run")

    # The effect page: payload with secrets redacted, key, attempt log.
    page.click(f"#effects a[href='/console/effects/{data['unknown']}']")
    assert page.locator("#key").inner_text() == KEY
    assert "pa55" not in page.content() and "[redacted]" in page.locator("#payload").inner_text()
    assert "HTTP 500" in page.locator("#attempts").inner_text()
    screenshot(page, "effect-unknown")

    # The unknown queue; an action without the operator credential is refused.
    page.click("nav >> text=Unknown queue")
    assert page.locator(f"#unknown a[href='/console/effects/{data['unknown']}']").count() >= 1
    assert page.locator("#unknown form").count() == 0  # read-only: no resolve forms
    screenshot(page, "unknown-queue-read-only")
    page.goto(f"{base}/console/login")
    csrf = page.locator("input[name=csrf]").first.get_attribute("value")
    page.evaluate(
        """([action, csrf]) => {
            const form = document.createElement('form');
            form.method = 'post'; form.action = action;
            for (const [k, v] of [['csrf', csrf], ['outcome', 'succeeded'], ['note', 'x']]) {
                const input = document.createElement('input');
                input.type = 'hidden'; input.name = k; input.value = v; form.appendChild(input);
            }
            document.body.appendChild(form); form.submit();
        }""",
        [f"/console/effects/{data['unknown']}/resolve", csrf],
    )
    page.wait_for_selector("#problem")
    assert "sign in with the operator credential" in page.locator("#problem").inner_text()
    assert ob.effect(data["unknown"]).status == EffectStatus.UNKNOWN
    screenshot(page, "refused-without-credential")

    # Sign in with the operator credential and a name.
    page.goto(f"{base}/console/login?next=/console/unknown")
    page.fill("input[name=name]", "alice")
    page.fill("input[name=token]", OPERATOR)
    screenshot(page, "login")
    page.click("form.action button")
    page.wait_for_url(f"{base}/console/unknown")
    assert page.locator("#operator").inner_text() == "alice"
    screenshot(page, "unknown-queue")

    # Resolve one with a note: it leaves the queue, the note is in its attempt log.
    row = page.locator(
        "#unknown tr", has=page.locator(f"a[href='/console/effects/{data['unknown']}']")
    )
    row.locator("select[name=outcome]").select_option("succeeded")
    row.locator("input[name=note]").fill("delivered: seen in the mail gateway's log, msg 8812")
    row.locator("button").click()
    page.wait_for_url(f"{base}/console/unknown?flash=resolved")
    assert page.locator(f"#unknown a[href='/console/effects/{data['unknown']}']").count() == 0
    page.goto(f"{base}/console/effects/{data['unknown']}")
    log = page.locator("#attempts").inner_text()
    assert "delivered: seen in the mail gateway's log, msg 8812" in log and "alice (console)" in log
    assert ob.effect(data["unknown"]).status == EffectStatus.SUCCEEDED
    screenshot(page, "effect-resolved")

    # A failed effect can be retried (with a note), from its page.
    page.goto(f"{base}/console/effects/{data['failed']}")
    screenshot(page, "effect-failed")

    # A forged cross-site POST, sent by the signed-in browser, is refused.
    forger = _Forger(f"{base}/console/effects/{data['unknown2']}/resolve")
    try:
        page.goto(forger.url)
        page.click("#forged button")
        page.wait_for_selector("#problem")
        assert "refused" in page.locator("#problem").inner_text()
        screenshot(page, "forged-post-refused")
    finally:
        forger.close()
    assert ob.effect(data["unknown2"]).status == EffectStatus.UNKNOWN

    # Versions (when can one retire?) and the effects list.
    page.goto(f"{base}/console/versions")
    assert "billing" in page.locator("#versions").inner_text()
    screenshot(page, "versions")
    page.goto(f"{base}/console/effects?status=succeeded")
    screenshot(page, "effects")
