"""The invariant checker's loaders, on a real database and a real sink log corrupted on purpose."""

from __future__ import annotations

import hashlib
import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text

from deliverers.record import RecordingSink
from deliverers.testing import Fault, IdempotentHttpSink
from outbox import Outbox
from outbox.check import logs
from outbox.check.invariants import Applied


def pairs(applied: list[Applied]) -> list[tuple[str | None, str | None]]:
    return [(a.key, a.operation) for a in applied]


@pytest.fixture
def sink(tmp_path: Path) -> Iterator[RecordingSink]:
    with RecordingSink(tmp_path / "sink.jsonl") as running:
        yield running


def test_the_logging_sink_logs_applications_not_requests(sink: RecordingSink) -> None:
    sink.inject(Fault("500_before", times=1))
    sink.inject(Fault("500_after", times=1))
    with httpx.Client() as client:
        for _ in range(3):  # refused, applied (then 500), replayed
            client.post(
                sink.url + "/x", json={"operation": "op1"}, headers={"Idempotency-Key": "k"}
            )
        client.post(sink.url + "/x", json={"operation": "op2"}, headers={"Idempotency-Key": "k2"})
    applied_lines, requests = logs.load_sink_log(sink.log_path)
    assert requests == 4
    assert pairs(applied_lines) == [("k", "op1"), ("k2", "op2")]
    assert sink.stats()["keys_applied"] == 2


def send_headers_then_die(sink: IdempotentHttpSink, key: str) -> None:
    """What a deliverer killed between writing a request's headers and its body leaves."""
    host, port = sink._server.server_address[:2]
    with socket.create_connection((str(host), int(port))) as conn:
        conn.sendall(
            b"POST /ops/0 HTTP/1.1\r\nHost: sink\r\nContent-Type: application/json\r\n"
            b"Idempotency-Key: " + key.encode() + b"\r\nContent-Length: 19\r\n\r\n"
        )
        conn.shutdown(socket.SHUT_WR)  # the body never comes: the server reads EOF
        conn.settimeout(10)
        while conn.recv(4096):  # until the server is done with it (answered or closed)
            pass


def deliver_whole(sink: IdempotentHttpSink, key: str) -> httpx.Response:
    with httpx.Client() as client:
        return client.post(
            sink.url + "/ops/0", json={"operation": "op1"}, headers={"Idempotency-Key": key}
        )


def test_the_logging_sink_ignores_a_request_whose_body_was_cut_off(sink: RecordingSink) -> None:
    send_headers_then_die(sink, "k1")
    response = deliver_whole(sink, "k1")
    assert response.status_code == 200 and response.json()["applied"] is True
    applied_lines, requests = logs.load_sink_log(sink.log_path)
    assert (pairs(applied_lines), requests) == ([("k1", "op1")], 1)


def test_the_reference_sink_ignores_a_request_whose_body_was_cut_off() -> None:
    with IdempotentHttpSink() as sink:
        send_headers_then_die(sink, "k1")
        response = deliver_whole(sink, "k1")
        assert response.status_code == 200, response.text
        assert sink.state.body_hash["k1"] == hashlib.sha256(b'{"operation":"op1"}').hexdigest()


def test_the_loaders_detect_a_row_corrupted_in_a_real_database(
    ob: Outbox, dsn: str, tmp_path: Path, sink: RecordingSink
) -> None:
    run = ob.start_run("agent", "1")
    ops = [f"op{n}" for n in range(3)]
    run.transaction(
        "s",
        lambda tx: (
            [tx.intend("http.request", {"url": sink.url, "json": {"operation": op}}) for op in ops]
            and None
        ),
    )
    effects = ob.effects()
    with httpx.Client() as client:  # deliver the first two by hand
        for e in effects[:2]:
            client.post(
                sink.url, json=e.payload["json"], headers={"Idempotency-Key": e.idempotency_key}
            )
    with ob.engine.begin() as conn:
        for e in effects[:2]:
            conn.execute(
                text(
                    "INSERT INTO outbox_effect_attempts"
                    " (effect_id, attempt, worker, outcome, shard)"
                    " SELECT id, 1, 'hand', 'succeeded', shard FROM outbox_effects WHERE id = :id"
                ),
                {"id": e.id},
            )
        conn.execute(
            text("UPDATE outbox_effects SET status = 'succeeded', attempt = 1 WHERE id = :id"),
            {"id": effects[0].id},
        )
        # the second regressed: logged succeeded, back to pending
        conn.execute(
            text("UPDATE outbox_effects SET status = 'pending', attempt = 1 WHERE id = :id"),
            {"id": effects[1].id},
        )
    with sink.log_path.open("a") as handle:  # and a phantom
        handle.write(json.dumps({"event": "applied", "key": "ghost", "operation": "op9"}) + "\n")

    report = logs.load(dsn, sink.log_path, expected_operations=[*ops, "op-never"])
    counts = report.counts()
    assert counts["lost"] == 3, report.lost  # two pending rows, and op-never has no intent
    assert counts["regressed"] == 1 and str(effects[1].id) in report.regressed[0]
    assert counts["phantoms"] == 1
    assert counts["duplicate_keys"] == counts["duplicate_operations"] == 0
    assert report.statuses == {"succeeded": 1, "pending": 2}

    with pytest.raises(AssertionError, match="did not settle"):
        logs.settle(dsn, timeout=0.3)
    with ob.engine.begin() as conn:
        conn.execute(text("UPDATE outbox_effects SET status = 'unknown'"))
    assert logs.settle(dsn, timeout=5, sink=sink) == {"unknown": 3}
