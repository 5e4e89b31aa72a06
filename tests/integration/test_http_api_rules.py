"""The HTTP API refuses what the Python client and the SQL API refuse, with the same codes.

The HTTP API records steps and intents through the Python client, so it has no
rules of its own: these tests send the shared rule cases (``tests/intent_rule_cases.py``,
which ``tests/integration/test_sql_api_validation.py`` holds the SQL API to) over
HTTP and expect each refusal's ``rule`` and ``field`` (prefixed by where it sits
in the request), and that a refused request writes nothing. Retries of every
write are answered with what the first call recorded.
"""

from __future__ import annotations

import json
import re
import socket
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import psycopg
import pytest
from psycopg import sql

from outbox import Outbox
from outbox.governance.gates import Gate
from outbox.serve.app import OutboxServer
from outbox.serve.settings import Credentials, ServeSettings
from tests.api_client import TOKEN, ApiClient
from tests.intent_rule_cases import IDENTIFIER_CASES, PAYLOAD_CASES
from tests.support import wait_for


@pytest.fixture
def server(ob: Outbox) -> Iterator[OutboxServer]:
    running = OutboxServer(
        ob, ServeSettings(port=0, console=False), Credentials(api_token=TOKEN.encode())
    ).start()
    yield running
    running.shutdown()


@pytest.fixture
def api(server: OutboxServer) -> Iterator[ApiClient]:
    with ApiClient(server.url, timeout=30) as client:
        yield client


def post(api: ApiClient, path: str, body: Any) -> httpx.Response:
    # json.dumps escapes lone surrogates and control characters, as any JSON encoder may.
    return api.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


def start(api: ApiClient) -> str:
    answer = api.post("/runs", json={"agent": "billing", "version": "1"})
    assert answer.status_code == 201, answer.text
    return str(answer.json()["run"]["id"])


def refusal(answer: httpx.Response) -> tuple[int, str, str | None, str | None]:
    body = answer.json()
    return answer.status_code, body["code"], body.get("rule"), body.get("field")


def test_payload_rules_over_http_are_the_shared_cases(ob: Outbox, api: ApiClient) -> None:
    run_id = start(api)
    accepted = 0
    for i, (payload, expected) in enumerate(PAYLOAD_CASES):
        step = {"step_id": f"s{i}", "intents": [{"kind": "http.request", "payload": payload}]}
        answer = post(api, f"/runs/{run_id}/steps", step)
        if expected is None:
            assert answer.status_code == 201, (payload, answer.text)
            accepted += 1
            continue
        rule, field = expected
        assert refusal(answer) == (422, "invalid", rule, f"intents[0].{field}"), (
            payload,
            answer.text,
        )
    # A refused step wrote nothing: no step, no intent.
    assert len(ob.run(run_id).completed_steps) == accepted
    assert len(ob.effects(run_id=run_id)) == accepted


def test_a_gate_is_not_passed_over_http_by_quoting_or_wrapping_the_number(
    ob: Outbox, api: ApiClient
) -> None:
    gate = {"pointer": "/json/amount", "op": "gt", "value": 10_000}
    ob.apply_gates([Gate(name="large-payments", kind="payments.send", when=[gate])])
    run_id = start(api)
    amounts = [50_000, "50000", [50_000], "5000"]
    intents = [{"kind": "payments.send", "payload": {"json": {"amount": a}}} for a in amounts]
    answer = post(api, f"/runs/{run_id}/steps", {"step_id": "pay", "intents": intents})
    assert answer.status_code == 201, answer.text
    effects = [ob.effect(e["id"]) for e in answer.json()["effects"]]
    assert [e.status for e in effects] == ["awaiting_approval"] * 3 + ["pending"]
    assert effects[2].approval["reason"] == "/json/amount is an array, not a number (gt 10000)"


def test_identifier_rules_over_http_are_the_shared_cases(ob: Outbox, api: ApiClient) -> None:
    run_id = start(api)
    for n, (value, code) in enumerate(IDENTIFIER_CASES):
        # Each name a caller gives, where it sits in which request.
        sends: list[tuple[str, dict[str, Any], str]] = [
            ("/runs", {"agent": value, "version": "1"}, "agent"),
            ("/runs", {"agent": "a", "version": value}, "version"),
            (f"/runs/{run_id}/steps", {"step_id": value}, "step_id"),
            (
                f"/runs/{run_id}/steps",
                {"step_id": f"k{n}", "intents": [{"kind": "k", "payload": {}, "key": value}]},
                "intents[0].key",
            ),
            (
                f"/runs/{run_id}/steps",
                {
                    "step_id": f"o{n}",
                    "intents": [{"kind": "k", "payload": {}, "ordering_key": value}],
                },
                "intents[0].ordering_key",
            ),
            (
                f"/runs/{run_id}/steps",
                {"step_id": f"r{n}", "spend": [{"amount": 1, "reason": value}]},
                "spend[0].reason",
            ),
            (f"/runs/{run_id}/signals", {"name": value}, "name"),
            (f"/runs/{run_id}/signals", {"name": "n", "dedup_key": value}, "dedup_key"),
        ]
        for path, body, field in sends:
            answer = post(api, path, body)
            if code is None:
                assert answer.status_code in (200, 201, 202), (value, field, answer.text)
            else:
                assert refusal(answer) == (422, "invalid", code, field), (value, answer.text)
    refused = sum(code is not None for _, code in IDENTIFIER_CASES)
    assert len(ob.run(run_id).completed_steps) == 4 * (len(IDENTIFIER_CASES) - refused)


def test_limits_are_the_clients_settings_not_the_apis(dsn: str) -> None:
    # A server whose client allows 300-character step ids takes them over HTTP too,
    # once the database allows them: above the default only the database raises a cap.
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("ALTER DATABASE {} SET outbox.max_step_id_length = '300'").format(
                sql.Identifier(conn.info.dbname)
            )
        )
    with Outbox.connect(dsn, max_step_id_length=300) as ob:
        running = OutboxServer(
            ob, ServeSettings(port=0, console=False), Credentials(api_token=TOKEN.encode())
        ).start()
        try:
            with ApiClient(running.url, timeout=30) as api:
                run_id = start(api)
                ok = post(api, f"/runs/{run_id}/steps", {"step_id": "s" * 300})
                assert ok.status_code == 201, ok.text
                over = post(api, f"/runs/{run_id}/steps", {"step_id": "s" * 301})
                assert refusal(over) == (422, "invalid", None, "step_id")
                assert "over 300" in over.json()["error"]
                for amount in (0, -1, 1e16):
                    debit = {"step_id": f"d{amount}", "spend": [{"amount": amount, "reason": "m"}]}
                    answer = post(api, f"/runs/{run_id}/steps", debit)
                    assert refusal(answer) == (422, "invalid", None, "spend[0].amount")
        finally:
            running.shutdown()


# -- retries -------------------------------------------------------------------------


def _send_and_hang_up(url: str, path: str, body: dict[str, Any]) -> None:
    """Send a request and close the socket without reading: a client whose answer was lost."""
    parts = urlsplit(url)
    raw = json.dumps(body).encode()
    head = (
        f"POST /api/v1{path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(raw)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection((parts.hostname, parts.port), timeout=5) as conn:
        conn.sendall(head + raw)
        conn.shutdown(socket.SHUT_WR)


def test_a_step_whose_answer_was_lost_is_retried_safely(
    ob: Outbox, api: ApiClient, server: OutboxServer
) -> None:
    run_id = start(api)
    intents = [
        {"kind": "http.request", "payload": {"url": "http://127.0.0.1:9/m", "json": {"n": i}}}
        for i in range(3)
    ]
    step = {"step_id": "charge", "result": {"ok": 1}, "intents": intents}
    _send_and_hang_up(server.url, f"/runs/{run_id}/steps", step)
    wait_for(lambda: ob.run(run_id).completed_steps == ["charge"], timeout=10)
    recorded = {e.id for e in ob.effects(run_id=run_id)}
    # The agent did not see the answer and sends the same request again, twice.
    for _ in range(2):
        again = post(api, f"/runs/{run_id}/steps", step)
        assert again.status_code == 200, again.text
        assert again.json()["replayed"] is True
        assert again.json()["step"]["result"] == {"ok": 1}
        assert {uuid.UUID(e["id"]) for e in again.json()["effects"]} == recorded
    assert len(ob.effects(run_id=run_id)) == 3


def test_every_write_retried_with_its_own_id_changes_nothing(ob: Outbox, api: ApiClient) -> None:
    run_id = str(uuid.uuid4())
    start_body = {"agent": "billing", "version": "1", "run_id": run_id}
    step = {"step_id": "s", "intents": [{"kind": "k", "payload": {"a": 1}, "key": "mine-1"}]}
    signal = {"name": "approval", "dedup_key": "mail-1"}
    writes = [
        ("/runs", start_body, (201, 200)),
        (f"/runs/{run_id}/steps", step, (201, 200)),
        (f"/runs/{run_id}/signals", signal, (202, 202)),
        (f"/runs/{run_id}/fail", {"error": "gave up"}, (200, 200)),
    ]
    for path, body, (first, later) in writes:
        answers = [post(api, path, body) for _ in range(3)]
        assert [a.status_code for a in answers] == [first, later, later], path
        if "replayed" in answers[0].json():
            assert [a.json()["replayed"] for a in answers] == [False, True, True], path
    assert [r.id for r in ob.runs()] == [uuid.UUID(run_id)]
    assert [e.idempotency_key for e in ob.effects()] == ["mine-1"]
    assert ob.run(run_id).record.error == "gave up"
    # The caller's key taken by another run is a conflict naming the intent, not a copy.
    key_again = {"step_id": "t", "intents": [{"kind": "k", "payload": {"a": 1}, "key": "mine-1"}]}
    other = str(uuid.uuid4())
    post(api, "/runs", {"agent": "billing", "version": "1", "run_id": other})
    conflict = post(api, f"/runs/{other}/steps", key_again)
    assert refusal(conflict)[:2] == (409, "idempotency_conflict")
    assert conflict.json()["field"] == "intents[0].key" and conflict.json()["key"] == "mine-1"


# -- the token ------------------------------------------------------------------------


def test_only_the_api_token_opens_the_api_and_it_opens_nothing_else(ob: Outbox) -> None:
    operator, metrics = "operator-token-0123456789", "metrics-token-0123456789"
    credentials = Credentials(
        operator_token=operator.encode(), metrics_token=metrics.encode(), api_token=TOKEN.encode()
    )
    running = OutboxServer(ob, ServeSettings(port=0), credentials).start()
    try:
        for other in (operator, metrics):
            with ApiClient(running.url, token=other) as api:
                answer = api.post("/runs", json={"agent": "a", "version": "1"})
                assert answer.status_code == 401 and answer.json()["code"] == "unauthenticated"
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        assert httpx.get(f"{running.url}/metrics", headers=bearer).status_code == 401
        # The console reads for anyone; signing in to act wants the operator's token.
        with httpx.Client(base_url=running.url, follow_redirects=False) as browser:
            page = browser.get("/console/login")
            csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)[1]  # type: ignore[index]
            login = {"csrf": csrf, "name": "agent", "token": TOKEN, "next": "/console/"}
            assert browser.post("/console/login", data=login).status_code == 403
    finally:
        running.shutdown()
