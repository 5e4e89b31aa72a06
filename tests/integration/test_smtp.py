"""smtp.send against a real SMTP server (aiosmtpd on loopback): headers, replies, lost links."""

from __future__ import annotations

import asyncio
import email
import email.policy
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from email.message import EmailMessage
from typing import Any

import pytest
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import SMTP, Envelope, Session

from deliverers.smtp import Email, SmtpDeliverer
from outbox.delivery import Delivery, Failed, Retry, Succeeded, Unknown


@dataclass
class Received:
    mail_from: str
    rcpt_tos: list[str]
    message: EmailMessage


@dataclass
class RecordingHandler:
    """Accepts by default; each reply can be overridden to misbehave."""

    rcpt_replies: dict[str, str] = field(default_factory=dict)
    mail_reply: str | None = None
    data_reply: str = "250 OK"
    quit_reply: str | None = None
    #: When set, DATA is answered only after this event (the message is already stored).
    hold_data_until: threading.Event | None = None
    messages: list[Received] = field(default_factory=list)
    rcpt_seen: list[str] = field(default_factory=list)

    async def handle_MAIL(
        self, server: SMTP, session: Session, envelope: Envelope, address: str, mail_options: Any
    ) -> str:
        if self.mail_reply is not None:
            return self.mail_reply
        envelope.mail_from = address
        return "250 OK"

    async def handle_RCPT(
        self, server: SMTP, session: Session, envelope: Envelope, address: str, rcpt_options: Any
    ) -> str:
        self.rcpt_seen.append(address)
        reply = self.rcpt_replies.get(address)
        if reply is not None:
            return reply
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        assert isinstance(envelope.content, bytes)
        message = email.message_from_bytes(envelope.content, policy=email.policy.default)
        assert isinstance(message, EmailMessage)
        assert envelope.mail_from is not None
        self.messages.append(Received(envelope.mail_from, list(envelope.rcpt_tos), message))
        if self.hold_data_until is not None:
            while not self.hold_data_until.is_set():
                await asyncio.sleep(0.01)
        return self.data_reply

    async def handle_QUIT(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        return self.quit_reply or "221 Bye"


class RefuseDataCommand(SMTP):
    """Answers the DATA command itself with 554, before any message text is sent."""

    async def smtp_DATA(self, arg: str) -> None:
        await self.push("554 5.7.1 no message accepted from you")


class Server(Controller):
    def __init__(self, handler: RecordingHandler, smtp_class: type[SMTP] = SMTP) -> None:
        super().__init__(handler, hostname="127.0.0.1", port=free_port())
        self.smtp_class = smtp_class

    def factory(self) -> SMTP:
        return self.smtp_class(self.handler, **self.SMTP_kwargs)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def handler() -> RecordingHandler:
    return RecordingHandler()


@pytest.fixture
def server(handler: RecordingHandler) -> Iterator[Server]:
    controller = Server(handler)
    controller.start()
    try:
        yield controller
    finally:
        controller.stop()
        controller.loop.close()


def deliverer_for(port: int, **config: Any) -> SmtpDeliverer:
    settings = {"host": "127.0.0.1", "port": port, "timeout": 5.0, **config}
    made = SmtpDeliverer.from_config("email.send", settings)
    assert isinstance(made, SmtpDeliverer)
    return made


def delivery(deliverer: SmtpDeliverer, key: str = "key-123", **payload: Any) -> Delivery:
    body = {"to": ["ap@example.com"], "subject": "October", "text": "All matched.\n", **payload}
    return Delivery(
        effect_id=uuid.uuid4(),
        run_id=uuid.uuid4(),
        kind=deliverer.kind,
        payload=deliverer.parse_payload(body),
        idempotency_key=key,
        attempt=1,
    )


def test_deliverer_declares_no_dedup_and_no_lookup() -> None:
    """SMTP cannot dedup or be asked: a crash mid-send must end `unknown`, never resent."""
    deliverer = deliverer_for(25)
    assert deliverer.idempotent is False
    assert deliverer.has_lookup is False


def test_message_arrives_with_the_key_as_message_id(
    server: Server, handler: RecordingHandler
) -> None:
    deliverer = deliverer_for(server.port)
    sent = delivery(
        deliverer,
        key="abc123",
        **{"from": "agent@example.com", "cc": ["boss@example.com"]},
        html="<p>All matched.</p>",
    )
    outcome = deliverer.deliver(sent)

    assert outcome == Succeeded(
        {
            "message_id": "<abc123@agent-outbox>",
            "accepted": ["ap@example.com", "boss@example.com"],
            "refused": {},
        }
    )
    [received] = handler.messages
    assert received.mail_from == "agent@example.com"
    assert received.rcpt_tos == ["ap@example.com", "boss@example.com"]
    message = received.message
    assert message["Message-ID"] == "<abc123@agent-outbox>"
    assert message["From"] == "agent@example.com"
    assert message["To"] == "ap@example.com"
    assert message["Cc"] == "boss@example.com"
    assert message["Subject"] == "October"
    assert message["X-Outbox-Effect-Id"] == str(sent.effect_id)
    plain = message.get_body(("plain",))
    html = message.get_body(("html",))
    assert plain is not None and html is not None
    assert plain.get_content() == "All matched.\n"
    assert html.get_content().strip() == "<p>All matched.</p>"


def test_default_sender_and_message_id_domain_come_from_the_config(
    server: Server, handler: RecordingHandler
) -> None:
    deliverer = deliverer_for(
        server.port, default_sender="robot@corp.example", message_id_domain="mail.corp.example"
    )
    outcome = deliverer.deliver(delivery(deliverer, key="k9", to=["a@x.example", "b@x.example"]))

    assert isinstance(outcome, Succeeded)
    [received] = handler.messages
    assert received.mail_from == "robot@corp.example"
    assert received.message["From"] == "robot@corp.example"
    assert received.message["To"] == "a@x.example, b@x.example"
    assert received.message["Message-ID"] == "<k9@mail.corp.example>"
    assert received.message["Cc"] is None


def test_every_attempt_uses_the_same_message_id(server: Server, handler: RecordingHandler) -> None:
    """The key, not the attempt, names the message: a receiver can spot a duplicate."""
    deliverer = deliverer_for(server.port)
    for _ in range(2):
        assert isinstance(deliverer.deliver(delivery(deliverer, key="same")), Succeeded)
    assert [m.message["Message-ID"] for m in handler.messages] == ["<same@agent-outbox>"] * 2


def test_450_to_every_recipient_is_retried(server: Server, handler: RecordingHandler) -> None:
    handler.rcpt_replies = {"ap@example.com": "450 4.2.1 mailbox busy, try later"}
    deliverer = deliverer_for(server.port)

    outcome = deliverer.deliver(delivery(deliverer))

    assert isinstance(outcome, Retry)
    assert "450" in outcome.reason and "mailbox busy" in outcome.reason
    assert handler.rcpt_seen == ["ap@example.com"]
    assert handler.messages == []


def test_550_to_every_recipient_fails(server: Server, handler: RecordingHandler) -> None:
    handler.rcpt_replies = {
        "ap@example.com": "550 5.1.1 no such user",
        "cc@example.com": "550 5.1.1 no such user",
    }
    deliverer = deliverer_for(server.port)

    outcome = deliverer.deliver(delivery(deliverer, cc=["cc@example.com"]))

    assert isinstance(outcome, Failed)
    assert outcome.reason.startswith("all recipients refused")
    assert "550" in outcome.reason and "cc@example.com" in outcome.reason
    assert handler.messages == []


def test_mixed_temporary_and_permanent_refusals_are_retried(
    server: Server, handler: RecordingHandler
) -> None:
    """No recipient accepted, but one only for now: the whole message is tried again."""
    handler.rcpt_replies = {
        "ap@example.com": "550 5.1.1 no such user",
        "cc@example.com": "451 4.3.0 greylisted",
    }
    deliverer = deliverer_for(server.port)

    outcome = deliverer.deliver(delivery(deliverer, cc=["cc@example.com"]))

    assert isinstance(outcome, Retry)
    assert "451" in outcome.reason and "550" in outcome.reason
    assert handler.messages == []


def test_a_refused_recipient_is_recorded_when_others_accept(
    server: Server, handler: RecordingHandler
) -> None:
    handler.rcpt_replies = {"gone@example.com": "550 5.1.1 no such user"}
    deliverer = deliverer_for(server.port)

    outcome = deliverer.deliver(delivery(deliverer, to=["ap@example.com", "gone@example.com"]))

    assert isinstance(outcome, Succeeded)
    assert outcome.result["accepted"] == ["ap@example.com"]
    assert outcome.result["refused"] == {"gone@example.com": [550, "5.1.1 no such user"]}
    [received] = handler.messages
    assert received.rcpt_tos == ["ap@example.com"]


@pytest.mark.parametrize(
    ("reply", "expected"),
    [("451 4.3.0 local error, try later", Retry), ("554 5.6.0 message rejected", Failed)],
)
def test_reply_at_the_end_of_data_decides_by_its_class(
    server: Server, handler: RecordingHandler, reply: str, expected: type[Retry | Failed]
) -> None:
    """A reply *returned* by data() is definite: 4xx retry, 5xx fail (not `unknown`)."""
    handler.data_reply = reply
    deliverer = deliverer_for(server.port)

    outcome = deliverer.deliver(delivery(deliverer))

    assert type(outcome) is expected
    assert outcome.reason == f"SMTP {reply.split()[0]}: {reply.split(' ', 1)[1]}"


@pytest.mark.parametrize(
    ("reply", "expected"),
    [("451 4.7.1 sender deferred", Retry), ("553 5.7.1 sender not allowed", Failed)],
)
def test_refused_sender_decides_by_reply_class(
    server: Server, handler: RecordingHandler, reply: str, expected: type[Retry | Failed]
) -> None:
    handler.mail_reply = reply
    deliverer = deliverer_for(server.port)

    outcome = deliverer.deliver(delivery(deliverer))

    assert type(outcome) is expected
    assert reply.split()[0] in outcome.reason
    assert handler.rcpt_seen == []


def test_refused_data_command_is_classified_not_unknown(handler: RecordingHandler) -> None:
    """554 to the DATA command itself: no message text was sent, so Failed, not Unknown."""
    controller = Server(handler, smtp_class=RefuseDataCommand)
    controller.start()
    try:
        deliverer = deliverer_for(controller.port)
        outcome = deliverer.deliver(delivery(deliverer))
    finally:
        controller.stop()
        controller.loop.close()

    assert isinstance(outcome, Failed)
    assert outcome.reason == "SMTP 554: 5.7.1 no message accepted from you"
    assert handler.messages == []


def test_connection_lost_after_the_message_was_sent_is_unknown(
    server: Server, handler: RecordingHandler
) -> None:
    """The server stored the message but its reply never came: resending could duplicate it."""
    handler.hold_data_until = threading.Event()
    deliverer = deliverer_for(server.port, timeout=0.3)
    try:
        outcome = deliverer.deliver(delivery(deliverer, key="ambiguous"))
    finally:
        handler.hold_data_until.set()

    assert isinstance(outcome, Unknown)
    assert outcome.reason.startswith("connection lost during DATA")
    [received] = handler.messages  # it did arrive: exactly why Retry would be wrong
    assert received.message["Message-ID"] == "<ambiguous@agent-outbox>"


def test_a_bad_quit_reply_does_not_undo_an_accepted_message(
    server: Server, handler: RecordingHandler
) -> None:
    """Once DATA got 250 the email is out; a 4xx/5xx to QUIT must not turn it into a retry."""
    handler.quit_reply = "421 4.3.2 shutting down"
    deliverer = deliverer_for(server.port)

    outcome = deliverer.deliver(delivery(deliverer, key="once"))

    assert isinstance(outcome, Succeeded)
    assert outcome.result["message_id"] == "<once@agent-outbox>"
    assert len(handler.messages) == 1


def test_nothing_listening_is_retried() -> None:
    deliverer = deliverer_for(free_port(), timeout=2.0)
    started = time.monotonic()

    outcome = deliverer.deliver(delivery(deliverer))

    assert isinstance(outcome, Retry)
    assert "ConnectionRefusedError" in outcome.reason
    assert time.monotonic() - started < 2.0


def test_payload_model_uses_from_alias_and_needs_a_recipient() -> None:
    parsed = Email.model_validate({"from": "a@x.example", "to": ["b@x.example"], "subject": "s"})
    assert parsed.sender == "a@x.example"
    with pytest.raises(ValueError, match="to"):
        Email.model_validate({"to": [], "subject": "s"})
    with pytest.raises(ValueError, match="bcc"):
        Email.model_validate({"to": ["b@x.example"], "subject": "s", "bcc": ["c@x.example"]})
