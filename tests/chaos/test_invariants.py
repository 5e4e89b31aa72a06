"""The invariant checker is itself tested: each violation, made by hand, is detected.

Pure inputs first (one test per violation, and a clean history with every
legitimate twist: retries, a reconciled expiry, stale late answers, ``unknown``);
then the real loaders, on a real database and a real sink log that are
corrupted on purpose.
"""

from __future__ import annotations

import hashlib
import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text

from deliverers.testing import Fault, IdempotentHttpSink
from outbox import Outbox
from tests.chaos import invariants
from tests.chaos.invariants import Applied, AttemptRecord, Intent, check
from tests.chaos.workload import LoggingSink


def intent(n: int, status: str = "succeeded", attempt: int = 1, kind: str = "http.request"):
    return Intent(f"e{n}", f"k{n}", kind, status, attempt, f"op{n}")


def log(*entries: tuple[str, int, str]) -> list[AttemptRecord]:
    return [
        AttemptRecord(seq, effect_id, attempt, outcome)
        for seq, (effect_id, attempt, outcome) in enumerate(entries, start=1)
    ]


def applied(*ns: int) -> list[Applied]:
    return [Applied(f"k{n}", f"op{n}") for n in ns]


def test_a_clean_history_with_every_legitimate_twist_has_no_violation() -> None:
    intents = [
        intent(1),  # plain success
        intent(2, attempt=3),  # retry, expired (reconciled), success; a stale late answer
        intent(3, "unknown", kind="http.blind"),  # visible, for an operator: not a violation
        intent(4, "failed", attempt=2),  # gave up: terminal, never applied
    ]
    attempts = log(
        ("e1", 1, "succeeded"),
        ("e2", 1, "retry"),
        ("e2", 2, "expired"),
        ("e2", 3, "succeeded"),
        ("e2", 2, "stale"),
        ("e3", 1, "expired"),
        ("e4", 1, "retry"),
        ("e4", 2, "failed"),
    )
    report = check(
        intents, attempts, applied(1, 2), expected_operations=["op1", "op2", "op3", "op4"]
    )
    assert report.counts() == dict.fromkeys(report.VIOLATIONS, 0), report.summary()
    assert report.clean and report.stale == 1
    assert report.statuses == {"succeeded": 2, "unknown": 1, "failed": 1}
    report.assert_clean()


@pytest.mark.parametrize("status", ["pending", "in_flight", "dispatched"])
def test_an_open_intent_is_lost(status: str) -> None:
    report = check([intent(1), intent(2, status)], log(("e1", 1, "succeeded")), applied(1))
    assert report.counts()["lost"] == 1 and "e2" in report.lost[0]
    with pytest.raises(AssertionError, match="lost"):
        report.assert_clean()


def test_a_committed_operation_without_an_intent_is_lost() -> None:
    report = check(
        [intent(1)], log(("e1", 1, "succeeded")), applied(1), expected_operations=["op1", "op9"]
    )
    assert report.lost == ["operation op9: no intent"]


def test_a_key_applied_twice_is_a_duplicate() -> None:
    report = check([intent(1)], log(("e1", 1, "succeeded")), applied(1, 1))
    assert report.duplicate_keys == ["k1"] and report.duplicate_operations == ["op1"]


def test_one_operation_under_two_keys_is_a_duplicate() -> None:
    twins = [Intent("e1", "k1", "http.request", "succeeded", 1, "op1")]
    twins.append(Intent("e2", "k2", "http.request", "succeeded", 1, "op1"))
    report = check(
        twins,
        log(("e1", 1, "succeeded"), ("e2", 1, "succeeded")),
        [Applied("k1", "op1"), Applied("k2", "op1")],
    )
    assert report.duplicate_keys == []
    assert report.duplicate_operations == ["op1"]
    assert report.duplicate_intents == ["op1"]


def test_applied_with_no_intent_is_a_phantom() -> None:
    report = check(
        [intent(1)],
        log(("e1", 1, "succeeded")),
        [
            *applied(1),
            Applied("k-nobody", "op-x"),  # a key no intent has
            Applied(None, "op-y"),  # no key at all
            Applied("k1", "op-z"),  # an intent's key with another operation
            Applied("k1", None),  # an intent's key with a body that is not its intent's
        ],
    )
    assert report.counts()["phantoms"] == 4, report.phantoms


def test_a_success_followed_by_a_non_stale_change_is_a_regression() -> None:
    report = check(
        [intent(1, attempt=2)],
        log(("e1", 1, "succeeded"), ("e1", 2, "succeeded")),
        applied(1),
    )
    assert report.counts()["regressed"] == 1
    assert "then succeeded@2" in report.regressed[0]


def test_a_success_then_an_expiry_is_a_regression_even_if_it_ends_succeeded() -> None:
    report = check([intent(1)], log(("e1", 1, "succeeded"), ("e1", 1, "expired")), applied(1))
    assert report.counts()["regressed"] == 1


def test_a_logged_success_whose_row_moved_back_is_a_regression() -> None:
    report = check([intent(1, "failed")], log(("e1", 1, "succeeded")), applied(1))
    assert report.counts()["regressed"] == 1 and "now failed" in report.regressed[0]


def test_succeeded_but_never_applied_at_the_sink_is_a_regression() -> None:
    report = check([intent(1)], log(("e1", 1, "succeeded")), [])
    assert report.counts()["regressed"] == 1 and "never applied" in report.regressed[0]
    other_sink = check([intent(1)], log(("e1", 1, "succeeded")), [], sink_kinds=["other"])
    assert other_sink.clean


def test_succeeded_with_nothing_in_the_attempt_log_is_a_regression() -> None:
    report = check([intent(1)], [], applied(1))
    assert report.counts()["regressed"] == 1


def test_lookup_and_operator_successes_count_as_successes() -> None:
    looked = AttemptRecord(1, "e1", 1, "looked_up", detail={"lookup": "applied"})
    resolved = AttemptRecord(2, "e2", 1, "resolved", detail={"as": "succeeded"})
    report = check([intent(1), intent(2)], [looked, resolved], applied(1, 2))
    assert report.clean, report.summary()
    later = AttemptRecord(3, "e1", 2, "retry")
    assert check([intent(1)], [looked, later], applied(1)).counts()["regressed"] == 1


# -- the real loaders ------------------------------------------------------------------------


@pytest.fixture
def sink(tmp_path: Path) -> Iterator[LoggingSink]:
    with LoggingSink(tmp_path / "sink.jsonl") as running:
        yield running


def test_the_logging_sink_logs_applications_not_requests(sink: LoggingSink) -> None:
    sink.inject(Fault("500_before", times=1))
    sink.inject(Fault("500_after", times=1))
    with httpx.Client() as client:
        for _ in range(3):  # refused, applied (then 500), replayed
            client.post(
                sink.url + "/x", json={"operation": "op1"}, headers={"Idempotency-Key": "k"}
            )
        client.post(sink.url + "/x", json={"operation": "op2"}, headers={"Idempotency-Key": "k2"})
    applied_lines, requests = invariants.load_sink_log(sink.log_path)
    assert requests == 4
    assert applied_lines == [Applied("k", "op1"), Applied("k2", "op2")]
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


def test_the_logging_sink_ignores_a_request_whose_body_was_cut_off(sink: LoggingSink) -> None:
    send_headers_then_die(sink, "k1")
    response = deliver_whole(sink, "k1")
    assert response.status_code == 200 and response.json()["applied"] is True
    assert invariants.load_sink_log(sink.log_path) == ([Applied("k1", "op1")], 1)


def test_the_reference_sink_ignores_a_request_whose_body_was_cut_off() -> None:
    with IdempotentHttpSink() as sink:
        send_headers_then_die(sink, "k1")
        response = deliver_whole(sink, "k1")
        assert response.status_code == 200, response.text
        assert sink.state.body_hash["k1"] == hashlib.sha256(b'{"operation":"op1"}').hexdigest()


def test_the_loaders_detect_a_row_corrupted_in_a_real_database(
    ob: Outbox, dsn: str, tmp_path: Path, sink: LoggingSink
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
                    "INSERT INTO outbox_effect_attempts (effect_id, attempt, worker, outcome)"
                    " VALUES (:id, 1, 'hand', 'succeeded')"
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

    report = invariants.load(dsn, sink.log_path, expected_operations=[*ops, "op-never"])
    counts = report.counts()
    assert counts["lost"] == 3, report.lost  # two pending rows, and op-never has no intent
    assert counts["regressed"] == 1 and str(effects[1].id) in report.regressed[0]
    assert counts["phantoms"] == 1
    assert counts["duplicate_keys"] == counts["duplicate_operations"] == 0
    assert report.statuses == {"succeeded": 1, "pending": 2}

    with pytest.raises(AssertionError, match="did not settle"):
        invariants.settle(dsn, timeout=0.3)
    with ob.engine.begin() as conn:
        conn.execute(text("UPDATE outbox_effects SET status = 'unknown'"))
    assert invariants.settle(dsn, timeout=5, sink=sink) == {"unknown": 3}
