"""smtp.send read-back against real servers: aiosmtpd files each accepted message in the
``Sent`` folder of a real IMAP server (pymap, in-memory), as providers do; the reconciler
searches that folder for the Message-ID before any resend."""

from __future__ import annotations

import imaplib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import SMTP, Envelope, Session

from deliverers.smtp import SmtpDeliverer
from outbox import EffectStatus, Outbox
from outbox.delivery.attempt import delivery_for
from outbox.storage.async_store import ClaimedEffect
from tests.integration.test_reconcile import intend, lose_attempts, run_reconcile

USER, PASSWORD = "demouser", "demopass"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def imap(tmp_path: Path) -> Iterator[int]:
    port = free_port()
    log = (tmp_path / "pymap.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from pymap.main import main; sys.exit(main())",
            "--port",
            str(port),
            "--no-tls",
            "dict",
            "--demo-data",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError((tmp_path / "pymap.log").read_text()) from None
                time.sleep(0.1)
        yield port
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


class FileInSent:
    """Accepts every message and files a copy in the IMAP Sent folder (as a provider would)."""

    def __init__(self, imap_port: int) -> None:
        self.imap_port = imap_port
        self.accepted: list[bytes] = []

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        assert isinstance(envelope.content, bytes)
        self.accepted.append(envelope.content)
        client = imaplib.IMAP4("127.0.0.1", self.imap_port)
        try:
            client.login(USER, PASSWORD)
            client.append("Sent", None, None, envelope.content)
        finally:
            client.logout()
        return "250 OK"


@pytest.fixture
def smtp(imap: int) -> Iterator[tuple[int, FileInSent]]:
    handler = FileInSent(imap)
    controller = Controller(handler, hostname="127.0.0.1", port=free_port())
    controller.start()
    try:
        yield controller.port, handler
    finally:
        controller.stop()
        controller.loop.close()


def deliverer(smtp_port: int, imap_port: int, **extra: Any) -> SmtpDeliverer:
    made = SmtpDeliverer.from_config(
        "email.send",
        {
            "host": "127.0.0.1",
            "port": smtp_port,
            "imap_host": "127.0.0.1",
            "imap_port": imap_port,
            "imap_ssl": False,
            "imap_username": USER,
            "imap_password_env": "OUTBOX_TEST_IMAP_PASSWORD",
            **extra,
        },
    )
    assert isinstance(made, SmtpDeliverer)
    return made


def test_an_email_lost_after_sending_is_found_in_sent_and_one_never_sent_is_resent(
    ob: Outbox,
    dsn: str,
    imap: int,
    smtp: tuple[int, FileInSent],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OUTBOX_TEST_IMAP_PASSWORD", PASSWORD)
    smtp_port, handler = smtp
    mail = {"to": ["ap@example.com"], "subject": "October", "text": "All matched.\n"}
    intend(ob, "email.send", [mail, {**mail, "subject": "November"}])
    sent, never = ob.effects()
    lose_attempts(dsn, ["email.send"])
    # The first deliverer got as far as the SMTP server accepting the message, then died.
    claimed = ClaimedEffect.from_row({**ob.effect(sent.id).model_dump(), "lease_owner": None})
    sender = deliverer(smtp_port, imap)
    outcome = sender.deliver(delivery_for(claimed, sender.parse_payload(sent.payload)))
    assert type(outcome).__name__ == "Succeeded"
    assert len(handler.accepted) == 1

    report = run_reconcile(dsn, {"email.send": deliverer(smtp_port, imap)})
    assert sorted(report.counts.items()) == [("looked_up_redeliver", 1), ("looked_up_succeeded", 1)]
    found = ob.effect(sent.id)
    assert found.status == EffectStatus.SUCCEEDED
    assert found.result["message_id"] == f"<{sent.idempotency_key}@agent-outbox>"
    assert found.result["folder"] == "Sent"
    assert ob.effect(never.id).status == EffectStatus.PENDING
    assert len(handler.accepted) == 1, "the reconciler only asked; it sent nothing"


def test_without_imap_the_deliverer_offers_no_lookup() -> None:
    plain = SmtpDeliverer.from_config("email.send", {"host": "127.0.0.1"})
    assert plain.has_lookup is False and plain.idempotent is False
