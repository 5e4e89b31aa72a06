"""Issue 27, items 8 and 13: what the console shows is redacted, and its small edges hold.

Item 8: every text the console shows (``last_error``, ``cancel_reason``, values)
goes through one redactor built on the intent rules' credential table, with an
authorization scheme and its secret caught anywhere in a string. Item 13: a NUL in
a query is a 400, signing out revokes the session, a sign-in name cannot forge a
log line, ``nosniff`` is sent, a session with a huge expiry is no session, and
the queue shows whole keys.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import uuid
from collections.abc import Iterator

import httpx
import pytest

from outbox import Outbox
from outbox.serve.app import OutboxServer
from outbox.serve.console.auth import SESSION_COOKIE, ConsoleAuth
from outbox.serve.settings import Credentials, ServeSettings
from tests.integration.test_console import (
    OPERATOR,
    _close_clients,  # noqa: F401 (an autouse fixture)
    browser_like,
    csrf_of,
    signed_in,
    unknown_effect,
)

LIVE_KEY = "sk_live_51HxQ2eLkdjf8s7dfLKJ"
API_KEY = "AbCdEf0123456789xyzQ"
SSWS = "00aBcDeFgHiJkLmNoPqRsTuVwXyZ"
GITHUB = "ghp_16C7e42F292c6912E7710c838347Ae178B4a"


@pytest.fixture
def console(ob: Outbox) -> Iterator[OutboxServer]:
    running = OutboxServer(
        ob,
        ServeSettings(port=0, counts_cache_seconds=0),
        Credentials(operator_token=OPERATOR.encode()),
    ).start()
    yield running
    running.shutdown()


def _set(ob: Outbox, effect_id: str, **columns: object) -> None:
    sets = ", ".join(f"{name} = %s" for name in columns)
    with ob.engine.begin() as conn:
        conn.exec_driver_sql(
            f"UPDATE outbox_effects SET {sets} WHERE id = %s", (*columns.values(), effect_id)
        )


# -- item 8: one redactor for everything shown ------------------------------------------


def test_last_error_is_redacted_on_every_page_that_shows_it(
    ob: Outbox, console: OutboxServer
) -> None:
    run_id, effect_id = unknown_effect(ob)
    error = (
        f"HTTPStatusError: 401 from https://api.example/v1 (sent Authorization: Bearer {LIVE_KEY});"
        f" retried with ApiKey {API_KEY} and SSWS {SSWS}, token={GITHUB}"
    )
    _set(ob, effect_id, last_error=error)
    for path in (
        f"/console/effects/{effect_id}",
        "/console/effects",
        "/console/unknown",
        f"/console/runs/{run_id}",
    ):
        page = httpx.get(console.url + path).text
        for secret in (LIVE_KEY, API_KEY, SSWS, GITHUB, LIVE_KEY[:12]):
            assert secret not in page, (path, secret)
        assert "HTTPStatusError: 401" in page, path  # the rest is still there


def test_cancel_reason_is_redacted(ob: Outbox, console: OutboxServer) -> None:
    run = ob.start_run("billing", "v1")
    ob.cancel(run.id, f"leaked key rotated, old one was Token {GITHUB}", by="carol")
    page = httpx.get(f"{console.url}/console/runs/{run.id}").text
    assert "leaked key rotated" in page and GITHUB not in page


def test_values_with_a_scheme_anywhere_are_redacted_and_a_field_named_key_is_not(
    ob: Outbox, console: OutboxServer
) -> None:
    _, effect_id = unknown_effect(ob)
    result = {
        "key": "order-7",
        "note": f"called with ApiKey {API_KEY}",
        "log": [f"GET /x -> 200 (Authorization: Bearer {LIVE_KEY})"],
    }
    _set(ob, effect_id, result=json.dumps(result), status="succeeded")
    page = httpx.get(f"{console.url}/console/effects/{effect_id}").text
    assert API_KEY not in page and LIVE_KEY not in page
    assert "order-7" in page  # a result field named "key" is a lookup key, shown


# -- item 13: console Low items ------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/console/runs?q=a%00b",
        "/console/runs?agent=%00",
        "/console/runs?version=1%00",
        "/console/effects?kind=x%00y",
        "/console/runs?cursor=%00",
        "/console/unknown?unknown_after=%00",
    ],
)
def test_a_nul_in_a_query_is_a_400(console: OutboxServer, path: str) -> None:
    answer = httpx.get(console.url + path)
    assert answer.status_code == 400, (path, answer.status_code)
    assert "control character" in answer.text


def test_signing_out_revokes_the_session_for_a_copied_cookie(
    ob: Outbox, console: OutboxServer
) -> None:
    _, effect_id = unknown_effect(ob)
    alice = signed_in(console, "alice")
    copied = alice.cookies.get(SESSION_COOKIE, path="/console")
    assert copied
    page = alice.get("/console/")
    assert alice.post("/console/logout", data={"csrf": csrf_of(page)}).status_code == 303
    thief = browser_like(console)
    thief.cookies.set(SESSION_COOKIE, copied, path="/console")
    shown = thief.get("/console/unknown")
    assert 'id="operator"' not in shown.text  # not signed in any more
    refused = thief.post(
        f"/console/effects/{effect_id}/resolve",
        data={"csrf": csrf_of(thief.get("/console/login")), "outcome": "succeeded", "note": "x"},
    )
    assert refused.status_code == 403 and "sign in" in refused.text
    assert ob.effect(effect_id).status.value == "unknown"


def test_a_sign_in_name_with_a_line_break_is_refused_and_logs_nothing_forged(
    console: OutboxServer, caplog: pytest.LogCaptureFixture
) -> None:
    client = browser_like(console)
    csrf = csrf_of(client.get("/console/login"))
    with caplog.at_level(logging.INFO):
        for token in (OPERATOR, "wrong-token-000000000"):
            answer = client.post(
                "/console/login",
                data={
                    "csrf": csrf,
                    "name": "alice\r\nINFO console: resolved effect by root",
                    "token": token,
                },
            )
            assert answer.status_code in (400, 403)
            assert SESSION_COOKIE not in answer.headers.get("set-cookie", "")
    for record in caplog.records:
        assert "\n" not in record.getMessage() and "\r" not in record.getMessage()


def test_every_answer_says_nosniff(ob: Outbox, console: OutboxServer) -> None:
    for path in ("/console/", "/console/runs?q=nothing-here", "/", "/console/no-such", "/healthz"):
        answer = httpx.get(console.url + path)
        assert answer.headers.get("x-content-type-options") == "nosniff", path


def test_a_session_with_a_huge_expiry_is_no_session(ob: Outbox, console: OutboxServer) -> None:
    auth = ConsoleAuth(Credentials(operator_token=OPERATOR.encode()), console.hosts)
    for fields in ('{"n": "x", "e": 1e400}', '{"n": "x", "e": "9"}', '{"n": ["x"], "e": 1}'):
        data = base64.urlsafe_b64encode(fields.encode()).decode()
        cookie = f"{data}.{auth._mac(b'session', data.encode())}"
        client = browser_like(console)
        client.cookies.set(SESSION_COOKIE, cookie, path="/console")
        for path in ("/console/", "/console/unknown"):
            answer = client.get(path)
            assert answer.status_code == 200, (fields, path)
            assert 'id="operator"' not in answer.text


def test_the_unknown_queue_shows_whole_keys(ob: Outbox, console: OutboxServer) -> None:
    a = "tenant-00042-invoice-2024-11-000017"
    b = "tenant-00042-invoice-2024-11-000018"
    unknown_effect(ob, key=a)
    unknown_effect(ob, key=b)
    queue = httpx.get(f"{console.url}/console/unknown").text
    for key in (a, b):
        assert re.search(rf'title="{key}"', queue), key


def test_a_flash_message_is_one_of_the_consoles_own(console: OutboxServer) -> None:
    page = httpx.get(f"{console.url}/console/?flash=Your+session+expired,+sign+in+at+evil.example")
    assert "evil.example" not in page.text
    assert "resolved" in httpx.get(f"{console.url}/console/?flash=resolved").text


def test_ids_in_paths_stay_404(console: OutboxServer) -> None:
    assert httpx.get(f"{console.url}/console/effects/{uuid.uuid4()}").status_code == 404
