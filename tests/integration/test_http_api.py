"""The HTTP API of `outbox serve` on a real uvicorn server and a real PostgreSQL.

Every answer is checked against the OpenAPI document (tests/api_client.py).
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from deliverers.testing import RecordingDeliverer
from outbox import Outbox
from outbox.keys import derive_key
from outbox.serve.app import OutboxServer
from outbox.serve.settings import Credentials, ServeSettings
from tests.api_client import TOKEN, ApiClient
from tests.support import DaemonThread, wait_for


def serve(ob: Outbox, **settings: Any) -> OutboxServer:
    return OutboxServer(
        ob,
        ServeSettings(port=0, console=False, **settings),
        Credentials(api_token=TOKEN.encode()),
    ).start()


@pytest.fixture
def server(ob: Outbox) -> Iterator[OutboxServer]:
    running = serve(ob, wait_poll=0.05)
    yield running
    running.shutdown()


@pytest.fixture
def api(server: OutboxServer) -> Iterator[ApiClient]:
    with ApiClient(server.url, timeout=30) as client:
        yield client


def start(api: ApiClient, **body: Any) -> str:
    answer = api.post("/runs", json={"agent": "billing", "version": "1", **body})
    assert answer.status_code == 201, answer.text
    return str(answer.json()["run"]["id"])


def three_intents(sink_url: str = "http://127.0.0.1:9") -> list[dict[str, Any]]:
    return [
        {
            "kind": "http.request",
            "payload": {"url": f"{sink_url}/mail", "json": {"operation": f"op-{i}"}},
        }
        for i in range(3)
    ]


# -- auth and limits -------------------------------------------------------------------


def test_calls_without_the_token_are_refused(ob: Outbox, server: OutboxServer) -> None:
    run = ob.start_run("billing", "1")
    for token in (None, "wrong-token-0123456789"):
        with ApiClient(server.url, token=token) as anonymous:
            for method, path in (
                ("GET", f"/runs/{run.id}"),
                ("POST", "/runs"),
                ("POST", f"/runs/{run.id}/steps"),
                ("GET", "/effects"),
                ("GET", "/no-such-route"),
            ):
                answer = anonymous.request(method, path, json={"agent": "x", "version": "1"})
                assert answer.status_code == 401, (method, path)
                assert answer.json()["code"] == "unauthenticated"
                assert answer.headers["www-authenticate"].startswith("Bearer")
    # Another scheme carrying the right secret is not the bearer token either.
    basic = httpx.get(f"{server.url}/api/v1/runs", headers={"Authorization": f"Basic {TOKEN}"})
    assert basic.status_code == 401
    assert len(ob.runs()) == 1
    # The document is public: it holds nothing secret.
    document = httpx.get(f"{server.url}/api/v1/openapi.json")
    assert document.status_code == 200 and document.json()["openapi"] == "3.1.0"


def test_the_api_is_off_without_a_token(ob: Outbox) -> None:
    running = OutboxServer(ob, ServeSettings(port=0, console=False), Credentials()).start()
    try:
        with ApiClient(running.url) as api:
            answer = api.get("/runs")
        assert answer.status_code == 503 and answer.json()["code"] == "api_disabled"
        assert "OUTBOX_API_TOKEN" in answer.json()["error"]
    finally:
        running.shutdown()


def test_an_oversized_body_is_refused_unread_and_writes_nothing(ob: Outbox) -> None:
    running = serve(ob, max_body_bytes=4096)
    try:
        with ApiClient(running.url) as api:
            run_id = start(api)
            big = {"step_id": "big", "intents": [{"kind": "k.x", "payload": "x" * 5000}]}
            answer = api.post(f"/runs/{run_id}/steps", json=big)
            assert answer.status_code == 413 and answer.json()["code"] == "body_too_large"
            # Without a Content-Length (chunked), the limit holds as well.
            raw = json.dumps(big).encode()
            chunked = api.post(
                f"/runs/{run_id}/steps",
                content=iter([raw[:3000], raw[3000:]]),
                headers={"Content-Type": "application/json"},
            )
            assert chunked.status_code == 413
            assert api.get(f"/runs/{run_id}").json()["steps"] == []
        assert ob.effects() == []
    finally:
        running.shutdown()


# -- steps: atomic, replayed, conflicts ---------------------------------------------------


def test_a_step_with_three_intents_and_a_checkpoint_commits_at_once(
    ob: Outbox, api: ApiClient
) -> None:
    run_id = start(api, inputs={"month": "2026-10"}, budget=10)
    answer = api.post(
        f"/runs/{run_id}/steps",
        json={
            "step_id": "send-summary",
            "result": {"sent": 3},
            "state": {"cursor": 7},
            "plan": ["match", "send-summary", "close"],
            "intents": three_intents(),
            "spend": [{"amount": 1.5, "reason": "model"}],
        },
    )
    assert answer.status_code == 201, answer.text
    step = answer.json()
    assert step["replayed"] is False and step["step"]["result"] == {"sent": 3}
    keys = [e["idempotency_key"] for e in step["effects"]]
    # The keys are the client's own, derived from (run, step, index).
    assert keys == [derive_key(uuid.UUID(run_id), "send-summary", i) for i in range(3)]
    run = ob.run(run_id)
    assert run.state == {"cursor": 7} and run.plan == ["match", "send-summary", "close"]
    assert run.completed_steps == ["send-summary"] and str(run.record.spent) == "1.5"
    assert [e.idempotency_key for e in run.effects()] == keys
    read = api.get(f"/runs/{run_id}").json()
    assert [s["step_id"] for s in read["steps"]] == ["send-summary"]
    assert read["run"]["state"] == {"cursor": 7}


def test_state_and_plan_left_out_stay_and_null_sets_null(ob: Outbox, api: ApiClient) -> None:
    run_id = start(api)
    api.post(f"/runs/{run_id}/steps", json={"step_id": "a", "state": {"n": 1}, "plan": [1]})
    api.post(f"/runs/{run_id}/steps", json={"step_id": "b", "result": 2})
    assert (ob.run(run_id).state, ob.run(run_id).plan) == ({"n": 1}, [1])
    api.post(f"/runs/{run_id}/steps", json={"step_id": "c", "state": None})
    assert ob.run(run_id).state is None and ob.run(run_id).plan == [1]


def test_a_replayed_step_returns_the_recorded_result_without_new_intents(
    ob: Outbox, api: ApiClient
) -> None:
    run_id = start(api)
    body = {"step_id": "send", "result": {"n": 1}, "state": {"s": 1}, "intents": three_intents()}
    first = api.post(f"/runs/{run_id}/steps", json=body)
    assert first.status_code == 201
    # The agent retries after a lost answer, or a resumed agent sends the step
    # again with what it would compute now: the recorded step wins, nothing is written.
    again = api.post(f"/runs/{run_id}/steps", json=body)
    changed = api.post(
        f"/runs/{run_id}/steps",
        json={**body, "result": {"n": 2}, "state": {"s": 2}, "intents": three_intents()[:1]},
    )
    for replay in (again, changed):
        assert replay.status_code == 200, replay.text
        assert replay.json()["replayed"] is True
        assert replay.json()["step"]["result"] == {"n": 1}
        assert replay.json()["effects"] == first.json()["effects"]
    assert len(ob.effects(run_id=run_id)) == 3 and ob.run(run_id).state == {"s": 1}


def test_concurrent_sends_of_one_step_record_it_once(ob: Outbox, api: ApiClient) -> None:
    run_id = start(api)
    body = {"step_id": "race", "result": "r", "intents": three_intents()}
    answers: list[httpx.Response] = []

    def send() -> None:
        with ApiClient(api.base_url.join("/").__str__().rstrip("/")) as client:
            answers.append(client.post(f"/runs/{run_id}/steps", json=body))

    threads = [threading.Thread(target=send) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(a.status_code for a in answers) == [200, 200, 200, 201]
    effects = {tuple(e["id"] for e in a.json()["effects"]) for a in answers}
    assert len(effects) == 1, "every answer names the same, stored effects"
    assert len(ob.effects(run_id=run_id)) == 3


def test_a_key_conflict_is_a_409_naming_the_intent_and_writes_nothing(
    ob: Outbox, api: ApiClient
) -> None:
    run_id = start(api)
    other_run = start(api)
    charge = {"kind": "payments.charge", "payload": {"cents": 500}, "key": "invoice-77"}
    assert api.post(f"/runs/{run_id}/steps", json={"step_id": "a", "intents": [charge]}).is_success
    # The same key with the same kind and payload, in the same run: the same intent.
    same = api.post(f"/runs/{run_id}/steps", json={"step_id": "b", "intents": [charge]})
    assert same.status_code == 201 and same.json()["effects"][0]["step_id"] == "a"
    for target, intent, why in (
        (run_id, {**charge, "payload": {"cents": 900}}, "payload"),
        (run_id, {**charge, "kind": "payments.refund"}, "kind"),
        (other_run, charge, "run"),
    ):
        answer = api.post(
            f"/runs/{target}/steps",
            json={
                "step_id": f"conflict-{why}",
                "state": {"must": "not be written"},
                "intents": [{"kind": "k.x", "payload": 1}, intent],
            },
        )
        assert answer.status_code == 409, (why, answer.text)
        error = answer.json()
        assert error["code"] == "idempotency_conflict"
        assert error["field"] == "intents[1].key" and error["key"] == "invoice-77"
        assert "invoice-77" in error["error"]
        assert ob.run(target).step(f"conflict-{why}") is None
    assert len(ob.effects()) == 1 and ob.run(run_id).state == {}


def test_an_over_budget_step_is_a_409_and_writes_nothing(ob: Outbox, api: ApiClient) -> None:
    run_id = start(api, budget=1)
    answer = api.post(
        f"/runs/{run_id}/steps",
        json={
            "step_id": "s",
            "spend": [{"amount": 2, "reason": "model"}],
            "intents": three_intents(),
        },
    )
    assert answer.status_code == 409 and answer.json()["code"] == "budget_exceeded"
    assert ob.effects() == [] and ob.run(run_id).completed_steps == []


# -- bad input ----------------------------------------------------------------------------


def _intent(**fields: Any) -> dict[str, Any]:
    return {"step_id": "s", "intents": [{"kind": "k", "payload": 1, **fields}]}


BAD_STEPS: list[tuple[bytes | dict[str, Any], int, str, str | None]] = [
    (b"{not json", 400, "malformed", None),
    (b'{"step_id": "s", "result": NaN}', 400, "malformed", None),
    (b'["step_id"]', 400, "malformed", None),
    (b"[" * 100 + b"]" * 100, 400, "malformed", None),
    ({}, 422, "invalid", "step_id"),
    ({"step_id": ""}, 422, "invalid", "step_id"),
    ({"step_id": "a\nb"}, 422, "invalid", "step_id"),
    ({"step_id": "s", "colour": 1}, 422, "invalid", "colour"),
    (
        {"step_id": "s", "intents": [{"kind": "k", "payload": 1}, {"kind": "a b", "payload": 1}]},
        422,
        "invalid",
        "intents[1].kind",
    ),
    ({"step_id": "s", "intents": [{"kind": "k"}]}, 422, "invalid", "intents[0].payload"),
    (_intent(max_attempts=0), 422, "invalid", "intents[0].max_attempts"),
    (_intent(key="a\r\nb"), 422, "invalid", "intents[0].key"),
    (_intent(compensate={"kind": "a b", "payload": 1}), 422, "invalid", "intents[0].compensate"),
    (
        _intent(payload={"headers": {"Authorization": "x"}}),
        422,
        "invalid",
        "intents[0].payload.headers",
    ),
    (
        _intent(payload={"url": "https://u:p@example.com/"}),
        422,
        "invalid",
        "intents[0].payload.url",
    ),
    (
        {"step_id": "s", "spend": [{"amount": -1, "reason": "x"}]},
        422,
        "invalid",
        "spend[0].amount",
    ),
    (b'{"step_id": "s", "result": "\\ud800"}', 422, "invalid", "result"),
]


def test_bad_step_input_is_refused_naming_the_field(ob: Outbox, api: ApiClient) -> None:
    run_id = start(api)
    for body, status, code, field in BAD_STEPS:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        answer = api.post(
            f"/runs/{run_id}/steps", content=raw, headers={"Content-Type": "application/json"}
        )
        assert answer.status_code == status, (body, answer.text)
        assert answer.json()["code"] == code, (body, answer.text)
        assert answer.json().get("field") == field, (body, answer.text)
    assert ob.effects() == [] and ob.run(run_id).completed_steps == []


def test_bad_paths_queries_and_media_types_are_refused_naming_them(api: ApiClient) -> None:
    run_id = start(api)
    cases = [
        (api.get("/runs/not-a-uuid"), 422, "invalid", "run_id"),
        (api.get("/effects/12"), 422, "invalid", "effect_id"),
        (api.get(f"/runs/{uuid.uuid4()}"), 404, "run_not_found", "run_id"),
        (api.get(f"/effects/{uuid.uuid4()}"), 404, "effect_not_found", "effect_id"),
        (api.get("/runs", params={"limit": "many"}), 422, "invalid", "limit"),
        (api.get("/runs", params={"status": "sleepy"}), 422, "invalid", "status"),
        (api.get("/runs?limit=1&limit=2"), 422, "invalid", "limit"),
        (api.get("/effects", params={"step_id": "s"}), 422, "invalid", "step_id"),
        (api.get("/effects", params={"colour": "red"}), 422, "invalid", "colour"),
        (api.post("/runs", json={"agent": "a"}), 422, "invalid", "version"),
        (
            api.post("/runs", json={"agent": "a", "version": "1", "budget": True}),
            422,
            "invalid",
            "budget",
        ),
        (
            api.post("/runs", data={"agent": "a", "version": "1"}),
            415,
            "unsupported_media_type",
            None,
        ),
        (api.post(f"/runs/{run_id}/signals", json={"payload": 1}), 422, "invalid", "name"),
        (api.post(f"/runs/{run_id}/fail", json={}), 422, "invalid", "error"),
        (api.delete("/runs"), 405, "method_not_allowed", None),
        (api.get("/nowhere"), 404, "not_found", None),
    ]
    for answer, status, code, field in cases:
        described = f"{answer.request.method} {answer.request.url}: {answer.text}"
        assert answer.status_code == status, described
        assert answer.json()["code"] == code, described
        assert answer.json().get("field") == field, described


# -- runs: idempotent start, signals, the end ------------------------------------------------


def test_a_start_with_its_own_run_id_is_safe_to_retry(ob: Outbox, api: ApiClient) -> None:
    run_id = str(uuid.uuid4())
    body = {"agent": "billing", "version": "1", "inputs": {"m": 10}, "budget": 5, "run_id": run_id}
    first = api.post("/runs", json=body)
    again = api.post("/runs", json={**body, "inputs": {"m": 10}})
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["replayed"] is True and again.json()["run"]["id"] == run_id
    changed = (("inputs", {"m": 11}), ("version", "2"), ("budget", 6), ("agent", "x"))
    for field, value in (*changed, ("mode", "dry_run")):
        answer = api.post("/runs", json={**body, field: value})
        assert answer.status_code == 409, answer.text
        assert (answer.json()["code"], answer.json()["field"]) == ("run_conflict", field)
    assert len(ob.runs()) == 1
    # A dry run started over HTTP is one, as start_run(..., mode="dry_run") makes it.
    dry = api.post("/runs", json={"agent": "billing", "version": "1", "mode": "dry_run"})
    assert dry.status_code == 201 and dry.json()["run"]["dry_run"] is True
    assert ob.run(dry.json()["run"]["id"]).record.mode.value == "dry_run"


def test_a_start_with_a_business_key_is_one_run_and_keeps_priority_and_fairness(
    ob: Outbox, api: ApiClient
) -> None:
    body = {
        "agent": "billing",
        "version": "1",
        "inputs": {"m": 1},
        "key": "invoice-2026-11",
        "priority": 4,
        "fairness_key": "tenant-a",
    }
    first = api.post("/runs", json=body)
    again = api.post("/runs", json=body)
    assert (first.status_code, again.status_code) == (201, 200), again.text
    run = first.json()["run"]
    assert (run["key"], run["priority"], run["fairness_key"]) == ("invoice-2026-11", 4, "tenant-a")
    assert again.json() == {"run": again.json()["run"], "replayed": True}
    assert again.json()["run"]["id"] == run["id"]
    refused = api.post("/runs", json={**body, "on_conflict": "reject"})
    assert refused.status_code == 409, refused.text
    assert len(ob.runs()) == 1
    assert ob.run(run["id"]).record.priority == 4


def test_an_intents_priority_fairness_and_approval_reach_the_effect(
    ob: Outbox, api: ApiClient
) -> None:
    run_id = start(api, priority=2, fairness_key="tenant-a")
    intents = [
        {"kind": "mail.send", "payload": {"n": 0}},
        {"kind": "mail.send", "payload": {"n": 1}, "priority": 9, "fairness_key": "tenant-b"},
        {"kind": "pay.send", "payload": {"amount": 900}, "approval": {"timeout": 3600}},
    ]
    answer = api.post(f"/runs/{run_id}/steps", json={"step_id": "notify", "intents": intents})
    assert answer.status_code == 201, answer.text
    effects = {e.payload.get("n", "pay"): e for e in ob.effects(run_id=run_id)}
    assert (effects[0].priority, effects[0].fairness_key) == (2, "tenant-a")
    assert (effects[1].priority, effects[1].fairness_key) == (9, "tenant-b")
    assert effects["pay"].status.value == "awaiting_approval"


def test_signals_reach_the_run_once_per_dedup_key(ob: Outbox, api: ApiClient) -> None:
    run_id = start(api)
    body = {"name": "approval", "payload": {"by": "cfo"}, "dedup_key": "mail-7"}
    first = api.post(f"/runs/{run_id}/signals", json=body)
    again = api.post(f"/runs/{run_id}/signals", json=body)
    assert (first.status_code, again.status_code) == (202, 202)
    assert (first.json()["duplicate"], again.json()["duplicate"]) == (False, True)
    assert ob.run(run_id).wait_signal("approval", name="approval", timeout=1) == {"by": "cfo"}
    missing = api.post(f"/runs/{uuid.uuid4()}/signals", json=body)
    assert missing.status_code == 404 and missing.json()["code"] == "run_not_found"


def test_a_run_completes_once_and_then_refuses_work(ob: Outbox, api: ApiClient) -> None:
    run_id = start(api)
    done = api.post(f"/runs/{run_id}/complete", json={"result": {"total": 3}})
    assert done.status_code == 200 and done.json()["run"]["status"] == "completed"
    again = api.post(f"/runs/{run_id}/complete", json={"result": {"total": 4}})
    assert again.json()["replayed"] is True and again.json()["run"]["result"] == {"total": 3}
    for path, body in (
        ("fail", {"error": "late"}),
        ("steps", {"step_id": "late", "intents": three_intents()}),
        ("signals", {"name": "approval"}),
    ):
        answer = api.post(f"/runs/{run_id}/{path}", json=body)
        assert answer.status_code == 409 and answer.json()["code"] == "run_terminal", path
    assert ob.effects() == []


def test_runs_and_effects_are_listed_with_filters(ob: Outbox, api: ApiClient) -> None:
    one = start(api)
    two = start(api, agent="triage")
    api.post(f"/runs/{one}/steps", json={"step_id": "a", "intents": three_intents()[:2]})
    api.post(f"/runs/{one}/steps", json={"step_id": "b", "intents": three_intents()[:1]})
    assert [r["id"] for r in api.get("/runs", params={"agent": "triage"}).json()["runs"]] == [two]
    assert len(api.get("/runs", params={"limit": 1}).json()["runs"]) == 1
    assert len(api.get("/effects", params={"run_id": one}).json()["effects"]) == 3
    of_a = api.get("/effects", params={"run_id": one, "step_id": "a"}).json()["effects"]
    assert [e["step_index"] for e in of_a] == [0, 1]
    assert api.get("/effects", params={"status": "succeeded"}).json()["effects"] == []
    view = api.get(f"/effects/{of_a[0]['id']}").json()
    assert view["effect"]["status"] == "pending" and view["attempts"] == []


# -- the long poll ---------------------------------------------------------------------------


def one_effect(api: ApiClient, url: str) -> str:
    run_id = start(api)
    body = {"step_id": "s", "intents": three_intents(url)[:1]}
    return str(api.post(f"/runs/{run_id}/steps", json=body).json()["effects"][0]["id"])


def test_the_long_poll_returns_when_the_effect_finishes(
    dsn: str, api: ApiClient, server: OutboxServer
) -> None:
    effect_id = one_effect(api, "http://127.0.0.1:9")
    answers: list[tuple[float, httpx.Response]] = []

    def poll() -> None:
        began = time.monotonic()
        answer = api.get(f"/effects/{effect_id}/outcome", params={"wait": 30})
        answers.append((time.monotonic() - began, answer))

    waiter = threading.Thread(target=poll)
    waiter.start()
    watch = server.app.state.api.handlers.watch
    wait_for(lambda: watch.waiting == 1, timeout=10, message="the poll to wait")
    deliverer = RecordingDeliverer("http.request")
    with DaemonThread(dsn, {"http.request": deliverer}):
        waiter.join(30)
    took, answer = answers[0]
    assert answer.status_code == 200 and took < 10
    outcome = answer.json()
    assert outcome["done"] is True and outcome["status"] == "succeeded"
    assert outcome["result"] == {"recorded": 1} and outcome["error"] is None
    assert outcome["effect"]["id"] == effect_id
    # Asked again, it answers at once.
    assert api.get(f"/effects/{effect_id}/outcome", params={"wait": 30}).json()["done"] is True


def test_the_long_poll_times_out_cleanly(api: ApiClient) -> None:
    effect_id = one_effect(api, "http://127.0.0.1:9")
    began = time.monotonic()
    answer = api.get(f"/effects/{effect_id}/outcome", params={"wait": 0.6})
    took = time.monotonic() - began
    assert answer.status_code == 200 and 0.5 <= took < 5
    assert (answer.json()["done"], answer.json()["status"]) == (False, "pending")
    immediate = api.get(f"/effects/{effect_id}/outcome", params={"wait": 0})
    assert immediate.json()["done"] is False
    bad = api.get(f"/effects/{effect_id}/outcome", params={"wait": "nan"})
    assert bad.status_code == 422 and bad.json()["field"] == "wait"


def test_the_server_caps_how_long_a_poll_waits(ob: Outbox) -> None:
    running = serve(ob, max_wait=0.5)
    try:
        with ApiClient(running.url) as api:
            effect_id = one_effect(api, "http://127.0.0.1:9")
            began = time.monotonic()
            answer = api.get(f"/effects/{effect_id}/outcome", params={"wait": 3600})
            assert answer.json()["done"] is False and time.monotonic() - began < 5
    finally:
        running.shutdown()


def test_a_client_that_leaves_a_long_poll_leaves_nothing_behind(
    api: ApiClient, server: OutboxServer
) -> None:
    effect_id = one_effect(api, "http://127.0.0.1:9")
    watch = server.app.state.api.handlers.watch
    sockets = []
    for _ in range(5):
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(
            f"GET /api/v1/effects/{effect_id}/outcome?wait=60 HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {TOKEN}\r\n\r\n".encode()
        )
        sockets.append(sock)
    wait_for(lambda: watch.waiting == 5, timeout=10, message="five waiters")
    for sock in sockets:
        sock.close()
    wait_for(lambda: watch.waiting == 0, timeout=5, message="the waiters to go with their clients")
    polls = watch.polls
    time.sleep(0.3)
    assert watch.polls == polls, "nobody waits, so nothing polls"
    assert api.get("/runs").status_code == 200


def test_long_polls_take_at_most_half_the_request_slots(ob: Outbox) -> None:
    running = serve(ob, max_concurrency=4)
    try:
        with ApiClient(running.url) as api:
            effect_id = one_effect(api, "http://127.0.0.1:9")
            results: list[httpx.Response] = []

            def poll() -> None:
                with ApiClient(running.url) as client:
                    results.append(client.get(f"/effects/{effect_id}/outcome?wait=2"))

            waiters = [threading.Thread(target=poll) for _ in range(2)]
            for waiter in waiters:
                waiter.start()
            watch = running.app.state.api.handlers.watch
            wait_for(lambda: watch.waiting == 2, timeout=10, message="two waiters")
            refused = api.get(f"/effects/{effect_id}/outcome?wait=2")
            assert refused.status_code == 503 and refused.json()["code"] == "too_many_waiters"
            assert refused.headers["retry-after"] == "1"
            assert api.get("/runs").status_code == 200  # other requests still get through
            for waiter in waiters:
                waiter.join(10)
            assert [r.json()["done"] for r in results] == [False, False]
    finally:
        running.shutdown()


def test_a_stopping_server_answers_its_long_polls_at_once(ob: Outbox) -> None:
    running = serve(ob)
    with ApiClient(running.url, timeout=30) as api:
        effect_id = one_effect(api, "http://127.0.0.1:9")
        answers: list[httpx.Response] = []
        waiter = threading.Thread(
            target=lambda: answers.append(api.get(f"/effects/{effect_id}/outcome?wait=60"))
        )
        waiter.start()
        watch = running.app.state.api.handlers.watch
        wait_for(lambda: watch.waiting == 1, timeout=10, message="the poll to wait")
        began = time.monotonic()
        running.shutdown()
        took = time.monotonic() - began
        waiter.join(10)
    # Not held until uvicorn's grace period runs out and cut: answered, done=false.
    assert took < 3, f"shutdown took {took:.1f}s"
    assert answers and answers[0].status_code == 200 and answers[0].json()["done"] is False
