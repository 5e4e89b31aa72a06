"""``smtp.send``: an email through SMTP, with the idempotency key as its ``Message-ID``.

SMTP servers do not dedup on Message-ID and cannot be asked whether a message
was accepted, so this deliverer is not idempotent. 4xx replies are retried,
5xx fail. A crash between the send and its record leaves the effect
``unknown`` for an operator, never resent blindly, unless read-back is
configured: many providers (and a Bcc-to-self rule) file every message sent
through them in a folder; with ``imap_host`` set, the reconciler searches that
folder (``imap_folder``, default ``Sent``) for the Message-ID before any
resend: found, succeeded; not found, sent again with the same Message-ID.
Where no folder receives sent mail, leave it off: only an operator can tell.

A sender, recipient or subject holding a line break (or another control
character) fails at once, nothing sent: it would add headers of the payload's
choosing (a ``Bcc:``), and no retry can make it valid.
"""

from __future__ import annotations

import contextlib
import imaplib
import os
import re
import smtplib
from email.message import EmailMessage
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from outbox.delivery import (
    Deliverer,
    DelivererConfig,
    Delivery,
    Failed,
    NotApplied,
    Outcome,
    Retry,
    Succeeded,
    Unknown,
)
from outbox.governance.intent_rules import HEADER_VALUE_FORBIDDEN

__all__ = ["Email", "SmtpConfig", "SmtpDeliverer"]

# A header field may hold a tab; a CR, LF, NUL or other control character would
# end the field and start one of the payload's choosing.
_HEADER_FORBIDDEN = re.compile(HEADER_VALUE_FORBIDDEN)


class Email(BaseModel):
    """Payload of an ``smtp.send`` effect."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    sender: str | None = Field(default=None, alias="from")
    to: list[str] = Field(min_length=1)
    cc: list[str] = Field(default_factory=list)
    subject: str = Field(max_length=998)
    text: str = ""
    html: str | None = None

    @field_validator("sender", "subject")
    @classmethod
    def _one_line(cls, value: str | None) -> str | None:
        if value is not None and _HEADER_FORBIDDEN.search(value):
            raise ValueError("holds a line break or another control character (a header field)")
        return value

    @field_validator("to", "cc")
    @classmethod
    def _one_line_each(cls, value: list[str]) -> list[str]:
        for address in value:
            if _HEADER_FORBIDDEN.search(address):
                raise ValueError(
                    "an address holds a line break or another control character (a header field)"
                )
        return value


class SmtpConfig(DelivererConfig):
    """Where and how to send."""

    #: The SMTP server.
    host: str = "localhost"
    #: Its port.
    port: int = Field(default=25, ge=1, le=65535)
    #: Upgrade the connection with STARTTLS before logging in.
    starttls: bool = False
    #: Log in as this user (none: no login)...
    username: str | None = None
    #: ... with the password in this environment variable (read at each send).
    password_env: str | None = None
    #: ``From`` when the payload names no sender.
    default_sender: str = "agent-outbox@localhost"
    #: ``Message-ID`` is ``<idempotency key@this>``: search the mail log for it.
    message_id_domain: str = "agent-outbox"
    #: Seconds one SMTP conversation may take.
    timeout: float = Field(default=30.0, gt=0)
    #: Read-back: an IMAP server whose ``imap_folder`` receives every message sent.
    imap_host: str | None = None
    #: Its port.
    imap_port: int = Field(default=993, ge=1, le=65535)
    #: Connect with TLS (IMAPS); false: plain IMAP.
    imap_ssl: bool = True
    #: Log in as this user (none: no login)...
    imap_username: str | None = None
    #: ... with the password in this environment variable (read at each lookup).
    imap_password_env: str | None = None
    #: The folder searched for the Message-ID.
    imap_folder: str = "Sent"


class SmtpDeliverer(Deliverer[SmtpConfig]):
    """Sends one email per effect; ``Message-ID: <key@domain>``."""

    payload_model: ClassVar[type[BaseModel] | None] = Email

    def message(self, email: Email, delivery: Delivery) -> EmailMessage:
        """The message as it will be sent (the key becomes the Message-ID)."""
        msg = EmailMessage()
        msg["From"] = email.sender or self.config.default_sender
        msg["To"] = ", ".join(email.to)
        if email.cc:
            msg["Cc"] = ", ".join(email.cc)
        msg["Subject"] = email.subject
        msg["Message-ID"] = self._message_id(delivery)
        msg["X-Outbox-Effect-Id"] = str(delivery.effect_id)
        msg.set_content(email.text)
        if email.html is not None:
            msg.add_alternative(email.html, subtype="html")
        return msg

    def deliver(self, delivery: Delivery) -> Outcome:
        """Send once (blocking; the daemon runs it in a thread)."""
        config = self.config
        email: Email = delivery.payload
        try:
            msg = self.message(email, delivery)
        except ValueError as exc:  # the email package refuses a header: no retry fixes it
            return Failed(f"the message cannot be built: {exc}")
        sender = email.sender or config.default_sender
        accepted: list[str] = []
        refused: dict[str, Any] = {}
        client: smtplib.SMTP | None = None
        try:
            client = smtplib.SMTP(config.host, config.port, timeout=config.timeout)
            if config.starttls:
                client.starttls()
            if config.username is not None:
                client.login(config.username, os.environ.get(config.password_env or "", ""))
            client.ehlo_or_helo_if_needed()
            code, reply = client.mail(sender)
            if code != 250:
                return _reply_outcome(code, reply)
            for rcpt in [*email.to, *email.cc]:
                code, reply = client.rcpt(rcpt)
                if code in (250, 251):
                    accepted.append(rcpt)
                else:
                    refused[rcpt] = [code, reply.decode(errors="replace")]
            if not accepted:
                if any(400 <= code < 500 for code, _ in refused.values()):
                    return Retry(f"no recipient accepted (some only for now): {refused}")
                return Failed(f"all recipients refused: {refused}")
            try:
                code, reply = client.data(msg.as_bytes())
            except smtplib.SMTPDataError as exc:
                # The DATA command itself was refused (no 354): nothing was transmitted.
                return _reply_outcome(exc.smtp_code, exc.smtp_error)
            except (smtplib.SMTPException, OSError) as exc:
                # The message may have been transmitted: never resend blindly.
                return Unknown(f"connection lost during DATA: {type(exc).__name__}: {exc}")
            if code != 250:
                return _reply_outcome(code, reply)
        except smtplib.SMTPResponseException as exc:
            return _reply_outcome(exc.smtp_code, exc.smtp_error)
        except (smtplib.SMTPException, OSError) as exc:
            return Retry(f"{type(exc).__name__}: {exc}")
        finally:
            if client is not None:
                _quit_quietly(client)
        return Succeeded(
            {"message_id": msg["Message-ID"], "accepted": accepted, "refused": refused}
        )

    def _message_id(self, delivery: Delivery) -> str:
        return f"<{delivery.idempotency_key}@{self.config.message_id_domain}>"

    def lookup(self, delivery: Delivery) -> Any:
        """Search the sent-mail folder for the Message-ID (blocking; run in a thread)."""
        config = self.config
        if config.imap_host is None:
            raise NotImplementedError("no imap_host configured")
        maker = imaplib.IMAP4_SSL if config.imap_ssl else imaplib.IMAP4
        client = maker(config.imap_host, config.imap_port, timeout=config.timeout)
        try:
            if config.imap_username is not None:
                password = os.environ.get(config.imap_password_env or "", "")
                client.login(config.imap_username, password)
            status, _ = client.select(_quoted(config.imap_folder), readonly=True)
            if status != "OK":
                raise RuntimeError(f"IMAP folder {config.imap_folder!r} cannot be opened")
            message_id = self._message_id(delivery)
            status, found = client.search(None, "HEADER", "Message-ID", _quoted(message_id))
            if status != "OK":
                raise RuntimeError(f"IMAP search failed: {found!r}")
        finally:
            with contextlib.suppress(imaplib.IMAP4.error, OSError):
                client.logout()
        if found and found[0] and found[0].split():
            return Succeeded(
                {"message_id": message_id, "looked_up": True, "folder": config.imap_folder}
            )
        return NotApplied()

    @property
    def has_lookup(self) -> bool:
        """Only with a configured ``imap_host``."""
        return self.config.imap_host is not None


def _quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _quit_quietly(client: smtplib.SMTP) -> None:
    """Say QUIT and close; its reply cannot change an outcome already decided.

    (``with smtplib.SMTP(...)`` raises from ``__exit__`` on a non-221 QUIT reply,
    which turned an accepted message into a retry: a second email.)
    """
    try:
        client.quit()
    except (smtplib.SMTPException, OSError):
        pass
    finally:
        client.close()


def _reply_outcome(code: int, reply: bytes | str) -> Outcome:
    text = reply.decode(errors="replace") if isinstance(reply, bytes) else reply
    reason = f"SMTP {code}: {text}"
    return Retry(reason) if 400 <= code < 500 else Failed(reason)
