"""The operator console over HTTP (no browser): pages render, actions go through the client.

The browser tests (tests/browser) click through the same pages in Chromium.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import Iterator

import httpx
import pytest

from outbox import Outbox, StepTransaction
from outbox.models import EffectStatus
from outbox.serve.app import OutboxServer
from outbox.serve.settings import Credentials, ServeSettings
from outbox.storage import views
from outbox.storage.async_store import AsyncStore, Completion
from outbox.storage.engine import make_async_engine
from tests.integration.test_reconcile import lose_attempts

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


def unknown_effect(ob: Outbox, key: str = "invoice-7-mail") -> tuple[str, str]:
    run = ob.start_run("billing", "v1", budget=10)

    def step(tx: StepTransaction) -> str:
        tx.set_plan(["mail", "done"])
        tx.spend(1.5, "model")
        return tx.intend(
            "http.request",
            {
                "method": "POST",
                "url": "https://mail.example/send",
                "json": {"to": "cfo@example.com"},
            },
            key=key,
        ).id.hex

    effect_id = run.transaction("send-mail", step)
    # Secrets a row may still hold (written before the intent rules refused them, or
    # by hand): the console must not show them. Then what the reconciler does to an
    # effect of a kind that cannot dedup nor be asked.
    leaky = {
        "method": "POST",
        "url": "https://user:hunter2@mail.example/send?access_token=abc123&x=1",
        "headers": {"Authorization": "Bearer sk-live-123", "X-Trace": "t"},
        "json": {"to": "cfo@example.com"},
    }
    with ob.engine.begin() as conn:
        conn.exec_driver_sql(
            "UPDATE outbox_effects SET status = 'unknown', attempt = 1, payload = %s::jsonb,"
            " last_error = 'deliverer died mid-call' WHERE id = %s",
            (json.dumps(leaky), str(effect_id)),
        )
    return str(run.id), str(uuid.UUID(effect_id))


_clients: list[httpx.Client] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _clients:
        _clients.pop().close()


def browser_like(console: OutboxServer) -> httpx.Client:
    """A client that keeps cookies, as a browser does."""
    client = httpx.Client(base_url=console.url, follow_redirects=False)
    _clients.append(client)
    return client


def signed_in(console: OutboxServer, name: str = "alice") -> httpx.Client:
    client = browser_like(console)
    page = client.get("/console/login")
    csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)[1]  # type: ignore[index]
    answer = client.post(
        "/console/login", data={"csrf": csrf, "name": name, "token": OPERATOR, "next": "/console/"}
    )
    assert answer.status_code == 303, answer.text
    return client


def csrf_of(page: httpx.Response) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', page.text)[1]  # type: ignore[index]


def test_every_page_renders(ob: Outbox, console: OutboxServer) -> None:
    every_page_renders(ob, console)


def every_page_renders(ob: Outbox, console: OutboxServer, key: str = "invoice-7-mail") -> None:
    """Each page answers 200 with its CSP, shows the effect's key and none of its secrets."""
    run_id, effect_id = unknown_effect(ob, key)
    for path in [
        "/console/",
        "/console/runs",
        "/console/runs?status=runnable&agent=billing&newer=1h",
        f"/console/runs/{run_id}",
        "/console/effects",
        "/console/effects?status=unknown&kind=http.request",
        f"/console/effects/{effect_id}",
        "/console/unknown",
        "/console/versions",
        "/console/login",
    ]:
        answer = httpx.get(console.url + path)
        assert answer.status_code == 200, (path, answer.text[:500])
        assert "Content-Security-Policy" in answer.headers
    effect_page = httpx.get(f"{console.url}/console/effects/{effect_id}").text
    assert key in effect_page
    assert "hunter2" not in effect_page and "sk-live-123" not in effect_page
    assert "abc123" not in effect_page and "cfo@example.com" in effect_page
    run_page = httpx.get(f"{console.url}/console/runs/{run_id}").text
    assert "send-mail" in run_page and "1.5" in run_page and "spend" in run_page


def test_search_finds_a_run_by_an_effects_key(ob: Outbox, console: OutboxServer) -> None:
    search_finds_a_run_by_an_effects_key(ob, console)


def search_finds_a_run_by_an_effects_key(
    ob: Outbox, console: OutboxServer, key: str = "invoice-7-mail"
) -> None:
    """The search box: by an effect's key to its run, by an effect's id to the effect."""
    run_id, effect_id = unknown_effect(ob, key)
    found = httpx.get(f"{console.url}/console/runs", params={"q": key})
    assert found.status_code == 303 and found.headers["location"] == f"/console/runs/{run_id}"
    by_id = httpx.get(f"{console.url}/console/runs", params={"q": effect_id})
    assert by_id.headers["location"] == f"/console/effects/{effect_id}"
    missing = httpx.get(f"{console.url}/console/runs", params={"q": "no-such-key"})
    assert missing.status_code == 200 and "Nothing found" in missing.text


def test_resolve_goes_to_the_attempt_log_with_who_and_why(
    ob: Outbox, console: OutboxServer
) -> None:
    resolve_goes_to_the_attempt_log(ob, console)


def resolve_goes_to_the_attempt_log(
    ob: Outbox, console: OutboxServer, key: str = "invoice-7-mail"
) -> None:
    """An operator resolves an unknown effect; the attempt log says who and why."""
    _, effect_id = unknown_effect(ob, key)
    client = signed_in(console, "alice")
    page = client.get(f"/console/effects/{effect_id}")
    done = client.post(
        f"/console/effects/{effect_id}/resolve",
        data={"csrf": csrf_of(page), "outcome": "succeeded", "note": "seen in the mail log"},
    )
    assert done.status_code == 303
    assert ob.effect(effect_id).status == EffectStatus.SUCCEEDED
    last = ob.store.attempts(ob.effect(effect_id).id)[-1]
    assert last.outcome == "resolved" and last.worker == "alice (console)"
    assert last.detail == {
        "as": "succeeded",
        "note": "seen in the mail log",
        "by": "alice (console)",
    }


def test_a_note_is_required(ob: Outbox, console: OutboxServer) -> None:
    _, effect_id = unknown_effect(ob)
    client = signed_in(console)
    page = client.get(f"/console/effects/{effect_id}")
    refused = client.post(
        f"/console/effects/{effect_id}/resolve",
        data={"csrf": csrf_of(page), "outcome": "failed", "note": "  "},
    )
    assert refused.status_code == 400 and "say why" in refused.text
    assert ob.effect(effect_id).status == EffectStatus.UNKNOWN


def test_failed_then_retry_and_cancel(ob: Outbox, console: OutboxServer) -> None:
    run_id, effect_id = unknown_effect(ob)
    client = signed_in(console, "bob")
    csrf = csrf_of(client.get("/console/unknown"))
    client.post(
        f"/console/effects/{effect_id}/resolve",
        data={"csrf": csrf, "outcome": "failed", "note": "the mail bounced"},
    )
    assert ob.effect(effect_id).status == EffectStatus.FAILED
    assert effect_id in client.get("/console/unknown").text  # listed under Failed
    retried = client.post(
        f"/console/effects/{effect_id}/retry", data={"csrf": csrf, "note": "address fixed"}
    )
    assert retried.status_code == 303
    assert ob.effect(effect_id).status == EffectStatus.PENDING
    assert ob.store.attempts(ob.effect(effect_id).id)[-1].detail["note"] == "address fixed"
    ob.run(run_id).transaction(
        "copy",
        lambda tx: tx.intend("http.request", {"url": "https://mail.example/copy"}) and None,
    )
    cancelled = client.post(f"/console/runs/{run_id}/cancel", data={"csrf": csrf, "note": "dup"})
    assert cancelled.status_code == 303
    assert ob.run(run_id).record.cancel_reason == "dup"
    # Who and why are in the attempt log of every effect the cancel stopped, as the CLI writes them.
    stopped = ob.effects(run_id=run_id)
    assert [e.status for e in stopped] == [EffectStatus.CANCELLED] * 2
    for effect in stopped:
        last = ob.store.attempts(effect.id)[-1]
        assert (last.outcome, last.worker) == ("cancelled", "bob (console)")
        assert last.detail == {"note": "dup", "by": "bob (console)", "via": "console"}


def test_actions_need_the_operator_and_a_csrf_token(ob: Outbox, console: OutboxServer) -> None:
    _, effect_id = unknown_effect(ob)
    anonymous = browser_like(console)
    csrf = csrf_of(anonymous.get("/console/login"))
    data = {"csrf": csrf, "outcome": "succeeded", "note": "x"}
    refused = anonymous.post(f"/console/effects/{effect_id}/resolve", data=data)
    assert refused.status_code == 403 and "sign in" in refused.text
    wrong = anonymous.post(
        "/console/login", data={"csrf": csrf, "name": "eve", "token": "not-the-token-000000"}
    )
    assert wrong.status_code == 403
    client = signed_in(console)
    no_token = client.post(f"/console/effects/{effect_id}/resolve", data={**data, "csrf": ""})
    assert no_token.status_code == 403 and "CSRF" in no_token.text
    foreign = client.post(
        f"/console/effects/{effect_id}/resolve",
        data={**data, "csrf": csrf_of(client.get("/console/"))},
        headers={"Origin": "http://evil.example"},
    )
    assert foreign.status_code == 403 and "cross-origin" in foreign.text
    assert ob.effect(effect_id).status == EffectStatus.UNKNOWN


def test_read_only_without_an_operator_credential(ob: Outbox) -> None:
    _, effect_id = unknown_effect(ob)
    running = OutboxServer(ob, ServeSettings(port=0), Credentials()).start()
    try:
        page = httpx.get(f"{running.url}/console/effects/{effect_id}")
        assert page.status_code == 200 and "no operator credential configured" in page.text
        assert 'id="resolve-form"' not in page.text
    finally:
        running.shutdown()


def test_pages_of_runs_follow_the_cursor(ob: Outbox, console: OutboxServer) -> None:
    ids = {str(ob.start_run("pager", "1").id) for _ in range(120)}
    seen: set[str] = set()
    url: str | None = "/console/runs?agent=pager"
    pages = 0
    while url:
        text = httpx.get(console.url + url).text
        seen |= set(re.findall(r'href="/console/runs/([0-9a-f-]{36})"', text))
        found = re.search(r'href="([^"]+)" id="next"', text)
        url = found[1].replace("&amp;", "&") if found else None
        pages += 1
    assert seen == ids and pages == 3


def held_effect(ob: Outbox, amount: int = 12_500) -> tuple[str, str]:
    """A payment held by its own approval policy (timeout an hour, then rejected)."""
    run = ob.start_run("billing", "v1")
    effect_id = run.transaction(
        f"pay-{amount}",
        lambda tx: (
            tx.intend(
                "payments.send", {"to": "acct-7", "amount": amount}, approval={"timeout": 3600}
            ).id.hex
        ),
    )
    assert ob.effect(effect_id).status == EffectStatus.AWAITING_APPROVAL
    return str(run.id), str(uuid.UUID(effect_id))


def test_a_held_effect_is_listed_shown_with_its_digest_and_approved_once(
    ob: Outbox, console: OutboxServer
) -> None:
    _, effect_id = held_effect(ob)
    digest = ob.effect(effect_id).digest
    queue = httpx.get(f"{console.url}/console/unknown").text
    assert 'id="held"' in queue and effect_id[:8] in queue
    listed = httpx.get(f"{console.url}/console/effects?status=awaiting_approval").text
    assert effect_id[:8] in listed
    read_only = httpx.get(f"{console.url}/console/effects/{effect_id}").text
    assert digest in read_only and "approve-form" not in read_only, "signed out: no form"

    client = signed_in(console, "carol")
    page = client.get(f"/console/effects/{effect_id}")
    assert "approve-form" in page.text and f'name="digest" value="{digest}"' in page.text
    # a form naming another payload's digest (the row changed since the page was read,
    # or a forged form) is refused and the refusal logged; nothing is released
    forged = client.post(
        f"/console/effects/{effect_id}/approve",
        data={"csrf": csrf_of(page), "digest": "0" * 64, "note": "looks fine"},
    )
    assert forged.status_code == 409 and "another payload" in forged.text
    assert ob.effect(effect_id).status == EffectStatus.AWAITING_APPROVAL
    no_note = client.post(
        f"/console/effects/{effect_id}/approve",
        data={"csrf": csrf_of(page), "digest": digest, "note": " "},
    )
    assert no_note.status_code == 400 and "say why" in no_note.text
    done = client.post(
        f"/console/effects/{effect_id}/approve",
        data={"csrf": csrf_of(page), "digest": digest, "note": "invoice matches PO 88"},
    )
    assert done.status_code == 303, done.text
    assert ob.effect(effect_id).status == EffectStatus.PENDING
    again = client.post(
        f"/console/effects/{effect_id}/approve",
        data={"csrf": csrf_of(page), "digest": digest, "note": "twice"},
    )
    assert again.status_code == 409 and "taken once" in again.text
    log = [(a.outcome, a.worker) for a in ob.store.attempts(uuid.UUID(effect_id))]
    assert log == [
        ("approval_refused", "carol (console)"),
        ("approved", "carol (console)"),
        ("approval_refused", "carol (console)"),
    ]
    approved = ob.store.attempts(uuid.UUID(effect_id))[1].detail
    assert approved["note"] == "invoice matches PO 88" and approved["via"] == "console"


def test_a_held_effect_is_rejected_from_the_console_and_needs_the_operator(
    ob: Outbox, console: OutboxServer
) -> None:
    _, effect_id = held_effect(ob, 99_000)
    digest = ob.effect(effect_id).digest
    anonymous = browser_like(console)
    page = anonymous.get("/console/login")  # a valid CSRF token, but nobody signed in
    refused = anonymous.post(
        f"/console/effects/{effect_id}/approve",
        data={"csrf": csrf_of(page), "digest": digest, "note": "me"},
    )
    assert refused.status_code == 403
    assert ob.effect(effect_id).status == EffectStatus.AWAITING_APPROVAL

    client = signed_in(console, "dave")
    page = client.get(f"/console/effects/{effect_id}")
    done = client.post(
        f"/console/effects/{effect_id}/reject",
        data={"csrf": csrf_of(page), "digest": digest, "note": "vendor not on the list"},
    )
    assert done.status_code == 303
    rejected = ob.effect(effect_id)
    assert rejected.status == EffectStatus.REJECTED
    assert rejected.last_error == "vendor not on the list"


def test_a_capped_part_says_so_and_the_queue_shows_the_last_attempt(
    ob: Outbox, console: OutboxServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_id, effect_id = unknown_effect(ob)
    run = ob.run(run_id)
    run.call("lookup", lambda: 1)
    with ob.engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO outbox_effect_attempts"
            " (effect_id, attempt, worker, outcome, detail, shard)"
            " VALUES (%s, 1, 'deliverer-a', 'expired', %s::jsonb,"
            " (SELECT shard FROM outbox_effects WHERE id = %s))",
            (effect_id, json.dumps({"note": "lease ran out mid-call"}), effect_id),
        )
    run_page = httpx.get(f"{console.url}/console/runs/{run_id}").text
    assert "Steps (2)" in run_page and "Effects (1)" in run_page
    monkeypatch.setattr(views, "PART_LIMIT", 1)
    run_page = httpx.get(f"{console.url}/console/runs/{run_id}").text
    # A part that stopped at its cap never passes for the whole.
    assert "Steps (the first 1)" in run_page and "Steps (1)" not in run_page
    effect_page = httpx.get(f"{console.url}/console/effects/{effect_id}").text
    assert "Attempt log (the first 1)" in effect_page
    queue = httpx.get(f"{console.url}/console/unknown").text
    assert "lease ran out mid-call" in queue, "what the last attempt recorded"


def test_the_run_page_totals_what_the_budget_got_back(ob: Outbox, console: OutboxServer) -> None:
    run = ob.start_run("billing", "v1", budget=10)
    run.transaction("quote", lambda tx: tx.intend("k.quote", {"n": 1}, cost=3) and None)
    ob.cancel(run.id, "customer left", by="carol")  # the unstarted quote gives its 3 back
    page = httpx.get(f"{console.url}/console/runs/{run.id}").text
    released = re.search(r'<dd id="released">([^<]*)</dd>', page)
    assert released is not None and float(released[1]) == 3.0, page[:2000]


def test_an_effect_held_by_a_stopping_run_says_it_is_never_due(
    ob: Outbox, dsn: str, console: OutboxServer
) -> None:
    # in flight at the cancel, then a "retry" answer: pending, held a century ahead
    run = ob.start_run("travel", "1", {"trip": "OSL"})
    effect_id = run.transaction("book", lambda tx: str(tx.intend("k.book", {}).id))
    lose_attempts(dsn, ["k.book"])
    ob.cancel(run.id, "stop")

    async def retry_answer() -> None:
        store = AsyncStore(make_async_engine(dsn))
        try:
            answer = Completion(uuid.UUID(effect_id), 1, "pending", "retry", error="busy")
            await store.complete("dead-deliverer", [answer])
        finally:
            await store.dispose()

    asyncio.run(retry_answer())
    assert ob.effect(effect_id).status == EffectStatus.PENDING
    page = httpx.get(f"{console.url}/console/effects/{effect_id}").text
    shown = re.search(r'<dd id="next-attempt">([^<]*)</dd>', page)
    assert shown is not None and shown[1].startswith("never: its run is being stopped"), shown
