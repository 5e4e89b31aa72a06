"""Issue 27, item 14: the deliverers hold their rules at send time, whatever road a row took.

An intent's rules are checked when it is written, but a row can reach the table
another way: written before the current rules, or by a direct ``INSERT``. So the
HTTP deliverer refuses userinfo URLs and framing or credential headers when it
sends, the SMTP deliverer refuses a CR/LF in a header field as a permanent
failure (not a retry), an HTTP-date ``Retry-After`` is read against the sink's
own clock, and an idempotency conflict does not say which run holds the key.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest

from deliverers.http import HttpDeliverer, parse_retry_after
from deliverers.smtp import SmtpDeliverer
from deliverers.testing import Fault, IdempotentHttpSink
from outbox import Outbox
from outbox.errors import IdempotencyConflict, RunExists
from tests.integration.test_smtp import RecordingHandler, Server
from tests.support import DaemonThread, wait_for


@pytest.fixture
def sink() -> Iterator[IdempotentHttpSink]:
    with IdempotentHttpSink() as running:
        yield running


def http() -> dict[str, HttpDeliverer]:
    made = HttpDeliverer.from_config("http.request", {"allow_private": ["127.0.0.1"]})
    assert isinstance(made, HttpDeliverer)
    return {"http.request": made}


def intend_then_rewrite(ob: Outbox, kind: str, payload: dict[str, Any]) -> str:
    """An innocent intent whose row is then rewritten by hand (the rules are not asked)."""
    run = ob.start_run("agent", "1")
    effect_id: str = run.transaction(
        "s", lambda tx: str(tx.intend(kind, {"url": "https://x.example/", "to": ["a@x"]}).id)
    )
    with ob.engine.begin() as conn:
        conn.exec_driver_sql(
            "UPDATE outbox_effects SET payload = %s::jsonb WHERE id = %s",
            (json.dumps(payload), effect_id),
        )
    return effect_id


def seen_by(sink: IdempotentHttpSink) -> list[dict[str, str]]:
    seen: list[dict[str, str]] = []
    original = sink._answer

    def spy(
        handler: BaseHTTPRequestHandler, key: str | None, raw: bytes, fault: Fault | None
    ) -> None:
        seen.append(dict(handler.headers.items()))
        original(handler, key, raw, fault)

    sink._answer = spy  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize(
    ("payload", "said"),
    [
        ({"url": "{userinfo}/ledger"}, "user name"),
        ({"url": "{sink}/ledger", "headers": {"Transfer-Encoding": "chunked"}}, "framing"),
        ({"url": "{sink}/ledger", "headers": {"X-Auth-Token": "t0k3n"}}, "credential"),
        (
            {"url": "{sink}/ledger", "headers": {"X-Note": "Bearer abcdefghijklmnopqrstu"}},
            "authorization scheme",
        ),
        ({"url": "{sink}/ledger?api_key=k3y"}, "credential"),
    ],
)
def test_the_http_deliverer_refuses_what_the_rules_refuse_at_send_time(
    ob: Outbox, dsn: str, sink: IdempotentHttpSink, payload: dict[str, Any], said: str
) -> None:
    userinfo = sink.url.replace("http://", "http://alice:hunter2@")
    url = payload["url"].replace("{sink}", sink.url).replace("{userinfo}", userinfo)
    payload = {**payload, "url": url}
    seen = seen_by(sink)
    effect_id = intend_then_rewrite(ob, "http.request", {**payload, "json": {"n": 1}})
    with DaemonThread(dsn, http()):
        wait_for(lambda: ob.effect(effect_id).status.value in ("failed", "succeeded"))
    effect = ob.effect(effect_id)
    assert effect.status.value == "failed", effect.last_error
    assert effect.attempt == 1  # not retried
    assert said in (effect.last_error or ""), effect.last_error
    assert seen == []  # nothing was sent
    for secret in ("hunter2", "t0k3n", "abcdefghijklmnopqrstu", "k3y"):
        assert secret not in (effect.last_error or "")


def test_smtp_refuses_a_line_break_in_a_header_field_once_not_by_retrying(
    ob: Outbox, dsn: str
) -> None:
    handler = RecordingHandler()
    server = Server(handler)
    server.start()
    try:
        smtp = SmtpDeliverer.from_config(
            "smtp.send", {"host": "127.0.0.1", "port": server.port, "timeout": 5.0}
        )
        run = ob.start_run("agent", "1")
        ids = run.transaction(
            "s",
            lambda tx: [
                str(tx.intend("smtp.send", body, max_attempts=5).id)
                for body in (
                    {"to": ["ap@example.com"], "subject": "Hi\r\nBcc: all@example.com"},
                    {"to": ["ap@example.com\r\nBcc: all@example.com"], "subject": "Hi"},
                    {"to": ["ap@example.com"], "cc": ["x@example.com\n"], "subject": "Hi"},
                    {"to": ["ap@example.com"], "from": "me@example.com\r\n", "subject": "Hi"},
                )
            ],
        )
        with DaemonThread(dsn, {"smtp.send": smtp}, retry_base_seconds=0.01):
            wait_for(lambda: all(ob.effect(i).status.value == "failed" for i in ids))
        for effect_id in ids:
            effect = ob.effect(effect_id)
            assert effect.attempt == 1, effect.last_error
            assert "line break" in (effect.last_error or "") or "control" in (
                effect.last_error or ""
            ), effect.last_error
        assert handler.messages == []
    finally:
        server.stop()
        server.loop.close()


def test_an_http_date_retry_after_is_read_against_the_sinks_clock() -> None:
    # The sink's clock is an hour ahead of ours: its Date and its Retry-After agree
    # that the wait is two minutes, whatever our clock says.
    sink_now = datetime.now(UTC) + timedelta(hours=1)
    retry_at = sink_now + timedelta(seconds=120)
    after = parse_retry_after(
        format_datetime(retry_at, usegmt=True), date=format_datetime(sink_now, usegmt=True)
    )
    assert after == pytest.approx(120, abs=1)


@pytest.mark.parametrize("zone", ["Asia/Tokyo", "America/Los_Angeles", "Pacific/Kiritimati"])
def test_an_http_date_retry_after_does_not_depend_on_the_local_time_zone(zone: str) -> None:
    code = (
        "from datetime import UTC, datetime, timedelta\n"
        "from email.utils import format_datetime\n"
        "from deliverers.http import parse_retry_after\n"
        "at = datetime.now(UTC) + timedelta(seconds=300)\n"
        "for text in (format_datetime(at, usegmt=True), at.strftime('%a %b %d %H:%M:%S %Y'),\n"
        "             at.strftime('%A, %d-%b-%y %H:%M:%S GMT')):\n"
        "    print(round(parse_retry_after(text)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "TZ": zone},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert all(abs(int(s) - 300) <= 2 for s in out), out


def test_an_idempotency_conflict_does_not_name_the_run_that_holds_the_key(ob: Outbox) -> None:
    holder = ob.start_run("agent", "1")
    holder.transaction("s", lambda tx: tx.intend("k.x", {"n": 1}, key="shared-key") and None)
    prober = ob.start_run("agent", "1")
    with pytest.raises(IdempotencyConflict) as caught:
        prober.transaction("p", lambda tx: tx.intend("k.x", {"n": 1}, key="shared-key"))
    assert str(holder.id) not in str(caught.value)
    first = ob.start_run("agent", "1", key="run-key", inputs={"a": 1})
    with pytest.raises(IdempotencyConflict) as caught:
        ob.start_run("agent", "1", key="run-key", inputs={"a": 2})
    assert str(first.id) not in str(caught.value)
    with pytest.raises(RunExists) as exists:
        ob.start_run("agent", "1", key="run-key", inputs={"a": 1}, on_conflict="reject")
    assert exists.value.run_id == first.id  # the caller that holds the key gets it as data
    assert str(first.id) not in str(exists.value)
    assert uuid.UUID(str(exists.value.run_id))
