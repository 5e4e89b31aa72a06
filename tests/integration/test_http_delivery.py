"""http.request against a real HTTP sink: keys, 429/Retry-After, 500 storms, timeouts, downtime."""

from __future__ import annotations

import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest

from deliverers.http import HttpDeliverer
from deliverers.testing import Fault, IdempotentHttpSink
from outbox import Outbox, StepTransaction
from tests.support import DaemonThread, wait_for


@pytest.fixture
def sink() -> Iterator[IdempotentHttpSink]:
    with IdempotentHttpSink() as running:
        yield running


def http(**config: Any) -> dict[str, HttpDeliverer]:
    settings = {"allow_private": ["127.0.0.1"], **config}
    return {"http.request": HttpDeliverer.from_config("http.request", settings)}


def intend(ob: Outbox, url: str, n: int = 1, **payload: Any) -> list[str]:
    run = ob.start_run("agent", "1")
    keys: list[str] = []

    def step(tx: StepTransaction) -> None:
        for i in range(n):
            body = {"url": url, "json": {"operation": f"op-{i}"}, **payload}
            keys.append(tx.intend("http.request", body).idempotency_key)

    run.transaction("s", step)
    return keys


def statuses(ob: Outbox) -> list[str]:
    return sorted(e.status.value for e in ob.effects(limit=10_000))


def test_each_intent_is_applied_once_with_its_key(
    ob: Outbox, dsn: str, sink: IdempotentHttpSink
) -> None:
    keys = intend(ob, f"{sink.url}/ledger", n=20)
    with DaemonThread(dsn, http()):
        wait_for(lambda: statuses(ob) == ["succeeded"] * 20)
    stats = sink.stats()
    assert stats["keys_applied"] == 20 and stats["duplicate_keys_applied"] == []
    assert sorted(sink.state.applied) == sorted(keys)
    effect = ob.effects()[0]
    assert effect.result["status"] == 200
    assert '"applied": true' in effect.result["body"]


def test_429_with_retry_after_is_honoured_and_slows_the_kind(
    ob: Outbox, dsn: str, sink: IdempotentHttpSink
) -> None:
    intend(ob, f"{sink.url}/ledger", n=1)
    sink.inject(Fault("429", times=1, retry_after="2"))
    started = time.monotonic()
    with DaemonThread(dsn, http(), retry_base_seconds=0.01):
        wait_for(lambda: statuses(ob) == ["succeeded"], timeout=20)
    assert time.monotonic() - started >= 2.0, "the retry waited for Retry-After"
    effect = ob.effects()[0]
    attempts = ob.store.attempts(effect.id)
    assert [a.outcome for a in attempts] == ["retry", "succeeded"]
    assert attempts[0].detail["status"] == 429
    assert sink.stats()["keys_applied"] == 1


def test_500_storm_then_success_applies_once(
    ob: Outbox, dsn: str, sink: IdempotentHttpSink
) -> None:
    intend(ob, f"{sink.url}/ledger", n=3)
    sink.inject(Fault("500_before", times=6))
    sink.inject(Fault("500_after", times=3))
    with DaemonThread(dsn, http(), retry_base_seconds=0.01, retry_cap_seconds=0.05):
        wait_for(lambda: statuses(ob) == ["succeeded"] * 3, timeout=30)
    stats = sink.stats()
    # 500_after applied the effect and then failed: the redelivery was deduplicated.
    assert stats["keys_applied"] == 3
    assert stats["duplicate_keys_applied"] == [] and stats["duplicate_operations"] == []
    assert stats["redeliveries"] >= 9


def test_timeouts_are_retried_with_the_same_key(
    ob: Outbox, dsn: str, sink: IdempotentHttpSink
) -> None:
    (key,) = intend(ob, f"{sink.url}/ledger", n=1, timeout=0.5)
    sink.inject(Fault("hang", times=1, hang_seconds=1.5))
    with DaemonThread(dsn, http(), retry_base_seconds=0.01):
        wait_for(lambda: statuses(ob) == ["succeeded"], timeout=30)
    attempts = ob.store.attempts(ob.effects()[0].id)
    assert attempts[0].outcome == "retry"
    assert attempts[0].detail["error"] == "timed out after 0.5s: no complete answer"
    assert [a.outcome for a in attempts][-1] == "succeeded"
    assert sink.state.received[key] >= 2
    assert sink.stats()["duplicate_keys_applied"] == []


def test_a_sink_that_is_down_then_up(ob: Outbox, dsn: str) -> None:
    probe = IdempotentHttpSink().start()
    url, port = probe.url, probe._server.server_address[1]
    probe.stop()  # nothing listens on this port now
    intend(ob, f"{url}/ledger", n=2)
    with DaemonThread(dsn, http(), retry_base_seconds=0.05, retry_cap_seconds=0.2):
        wait_for(
            lambda: any(
                a.outcome == "retry" for e in ob.effects() for a in ob.store.attempts(e.id)
            ),
            timeout=20,
        )
        with IdempotentHttpSink(port=int(port)) as back:
            wait_for(lambda: statuses(ob) == ["succeeded"] * 2, timeout=30)
            assert back.stats()["keys_applied"] == 2


def test_non_retryable_4xx_fails_with_the_status(
    ob: Outbox, dsn: str, sink: IdempotentHttpSink
) -> None:
    intend(ob, f"{sink.url}/nowhere", n=1, method="GET")
    with DaemonThread(dsn, http()):
        wait_for(lambda: statuses(ob) == ["failed"])
    effect = ob.effects()[0]
    assert effect.last_error == "HTTP 404"


def test_url_outside_the_allowlist_fails_without_a_call(
    ob: Outbox, dsn: str, sink: IdempotentHttpSink
) -> None:
    intend(ob, f"{sink.url}/ledger", n=1)  # loopback, not allowed by default
    deliverers = {"http.request": HttpDeliverer.from_config("http.request", {})}
    with DaemonThread(dsn, deliverers):
        wait_for(lambda: statuses(ob) == ["failed"])
    assert "non-public address 127.0.0.1" in (ob.effects()[0].last_error or "")
    assert sink.state.requests == 0

    intend(ob, "http://10.1.2.3/x", n=1)
    allow_list = http(allowed_hosts=["api.example.com"])
    with DaemonThread(dsn, allow_list):
        wait_for(lambda: statuses(ob) == ["failed", "failed"])
    assert any("not in allowed_hosts" in (e.last_error or "") for e in ob.effects())


def test_payload_that_fails_its_schema_fails_with_the_field(ob: Outbox, dsn: str) -> None:
    run = ob.start_run("agent", "1")
    run.transaction(
        "s", lambda tx: tx.intend("http.request", {"url": "ftp://x", "bogus": 1}) and None
    )
    with DaemonThread(dsn, http()):
        wait_for(lambda: statuses(ob) == ["failed"])
    error = ob.effects()[0].last_error or ""
    assert error.startswith("payload does not match the schema of kind 'http.request'")
    assert "url" in error and "bogus" in error


def test_oversized_response_is_read_up_to_the_limit(
    ob: Outbox, dsn: str, sink: IdempotentHttpSink
) -> None:
    intend(ob, f"{sink.url}/big/{50 * 1024 * 1024}", n=1, method="GET")
    with DaemonThread(dsn, http(read_limit_bytes=64 * 1024, excerpt_bytes=100)):
        wait_for(lambda: statuses(ob) == ["succeeded"], timeout=30)
    result = ob.effects()[0].result
    assert result["truncated"] is True
    assert result["bytes_read"] == 64 * 1024
    assert len(result["body"]) == 100


def test_credentials_come_from_the_environment(
    ob: Outbox, dsn: str, sink: IdempotentHttpSink, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SINK_TOKEN", "s3cret")
    seen: list[str] = []
    original = sink._answer

    def spy(
        handler: BaseHTTPRequestHandler, key: str | None, raw: bytes, fault: Fault | None
    ) -> None:
        seen.append(handler.headers.get("Authorization", ""))
        original(handler, key, raw, fault)

    monkeypatch.setattr(sink, "_answer", spy)
    intend(ob, f"{sink.url}/ledger", n=1, credential="sink")
    config = http(credentials={"sink": {"env": "SINK_TOKEN", "prefix": "Bearer "}})
    with DaemonThread(dsn, config):
        wait_for(lambda: statuses(ob) == ["succeeded"])
    assert seen == ["Bearer s3cret"]
    assert "s3cret" not in str(ob.effects()[0].payload)
