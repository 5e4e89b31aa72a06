"""Who may act in the console, and proof that a form was sent by the console itself.

Reading needs nothing beyond reaching the server (it binds 127.0.0.1 by
default). Acting (resolve, retry, cancel) needs a session, which a person gets
by entering the operator credential and their name at ``/console/login``; the
name is what the attempt log records as who. A session is a signed cookie
(HMAC under a key derived from the operator credential, so rotating the
credential ends every session), ``HttpOnly`` and ``SameSite=Strict``. Signing
out revokes the cookie in PostgreSQL (:meth:`ConsoleAuth.revocation`), so a copy
of it is refused by every server process until it would have expired.

Every POST, the login form included, must carry the CSRF token of the
browser's ``outbox_csrf`` cookie (double submit: a page on another origin can
neither read the cookie nor the token) and, when the browser says where the
request comes from (``Origin``, ``Sec-Fetch-Site``), come from this origin.
"This origin" is an allowed host name of the server
(:class:`~outbox.serve.hosts.HostAllowList`) on the scheme and port the request
came in on; it is never read from the request's ``Host`` header alone, which a
page under DNS rebinding chooses.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from starlette.requests import Request
from starlette.responses import Response

from outbox.governance.intent_rules import identifier_violation
from outbox.serve.hosts import HostAllowList
from outbox.serve.settings import Credentials
from outbox.serve.transport import HOST_KEY

__all__ = ["CSRF_COOKIE", "OPERATOR_KEY", "SESSION_COOKIE", "ConsoleAuth", "Operator"]

SESSION_COOKIE = "outbox_session"
CSRF_COOKIE = "outbox_csrf"
#: How long a login lasts.
SESSION_SECONDS = 12 * 3600
#: Where the console leaves the request's operator, once its session was checked
#: against the revocations (:meth:`ConsoleAuth.session` then the database).
OPERATOR_KEY = "outbox.operator"
#: The longest name recorded as who.
MAX_NAME = 100


@dataclass(frozen=True)
class Operator:
    """A person signed in with the operator credential."""

    name: str
    expires: int
    #: The session's MAC: what signing out revokes.
    mac: str = ""

    @property
    def revocation(self) -> str:
        """The digest stored when this session is signed out (never the cookie itself)."""
        return "console-session:" + hashlib.sha256(self.mac.encode()).hexdigest()

    @property
    def expires_at(self) -> datetime:
        """When the cookie stops being accepted anyway."""
        return datetime.fromtimestamp(self.expires, UTC)

    @property
    def who(self) -> str:
        """What the attempt log records."""
        return f"{self.name} (console)"


class ConsoleAuth:
    """Sessions and CSRF tokens of one console."""

    def __init__(self, credentials: Credentials, hosts: HostAllowList) -> None:
        self.credentials = credentials
        self.hosts = hosts
        token = credentials.operator_token
        # Without an operator credential nobody can sign in; the key still
        # signs CSRF tokens (the login form refuses anyway).
        seed = token if token is not None else secrets.token_bytes(32)
        self._key = hmac.new(seed, b"outbox-console-v1", hashlib.sha256).digest()

    @property
    def enabled(self) -> bool:
        """True when someone can sign in (an operator credential is configured)."""
        return self.credentials.operator_token is not None

    # -- sessions ---------------------------------------------------------------

    def _mac(self, purpose: bytes, data: bytes) -> str:
        return hmac.new(self._key, purpose + b"\0" + data, hashlib.sha256).hexdigest()

    def session_cookie(self, name: str) -> str:
        """The cookie value of a new session for ``name``."""
        payload = json.dumps({"n": name, "e": int(time.time()) + SESSION_SECONDS}).encode()
        data = base64.urlsafe_b64encode(payload).decode()
        return f"{data}.{self._mac(b'session', data.encode())}"

    def session(self, request: Request) -> Operator | None:
        """The operator the request's session cookie names, if it is signed and unexpired.

        Whether it was signed out is the database's to say: the console checks
        that before it sets :data:`OPERATOR_KEY` (see :meth:`operator`).
        """
        if not self.enabled:
            return None
        value = request.cookies.get(SESSION_COOKIE, "")
        data, _, mac = value.partition(".")
        if not data or not hmac.compare_digest(
            self._mac(b"session", data.encode()).encode(), mac.encode("utf-8", "replace")
        ):
            return None
        try:
            fields = json.loads(base64.urlsafe_b64decode(data.encode()))
            name, expires = fields["n"], fields["e"]
        except (ValueError, KeyError, TypeError):
            return None
        # Exactly the types sign_in writes: a float such as 1e400 is no expiry.
        if type(name) is not str or type(expires) is not int or name_problem(name):
            return None
        operator = Operator(name=name, expires=expires, mac=mac)
        return operator if operator.expires > time.time() else None

    @staticmethod
    def operator(request: Request) -> Operator | None:
        """The signed-in operator of this request: a valid session that was not signed out.

        Set by the console for every request before its page runs; a request it
        did not check has no operator (fail closed).
        """
        found = request.scope.get(OPERATOR_KEY)
        return found if isinstance(found, Operator) else None

    def sign_in(self, response: Response, request: Request, name: str) -> None:
        """Set the session cookie on ``response``."""
        response.set_cookie(
            SESSION_COOKIE,
            self.session_cookie(name),
            max_age=SESSION_SECONDS,
            path="/console",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )

    @staticmethod
    def sign_out(response: Response) -> None:
        """Clear the session cookie."""
        response.delete_cookie(SESSION_COOKIE, path="/console")

    # -- CSRF ---------------------------------------------------------------------

    def csrf_seed(self, request: Request) -> tuple[str, bool]:
        """The browser's CSRF cookie value, and whether it must be set now."""
        seed = request.cookies.get(CSRF_COOKIE, "")
        if len(seed) == 43 and seed.replace("-", "").replace("_", "").isalnum():
            return seed, False
        return secrets.token_urlsafe(32), True

    def csrf_token(self, seed: str) -> str:
        """The token forms carry for the cookie ``seed``."""
        return self._mac(b"csrf", seed.encode())

    @staticmethod
    def set_csrf_cookie(response: Response, request: Request, seed: str) -> None:
        """Give the browser its CSRF cookie."""
        response.set_cookie(
            CSRF_COOKIE,
            seed,
            path="/console",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )

    def csrf_refusal(self, request: Request, form_token: str | None) -> str | None:
        """Why this POST is not the console's own form, or None when it is."""
        origin = request.headers.get("origin")
        if origin is not None:
            # The Gate admitted the request's Host: its port is the one the browser used.
            allowed = request.scope.get(HOST_KEY)
            port = allowed[1] if allowed is not None else None
            if allowed is None or not self.hosts.is_own_origin(origin, request.url.scheme, port):
                return f"cross-origin request refused (Origin {origin[:100]!a})"
        fetch_site = request.headers.get("sec-fetch-site")
        if fetch_site is not None and fetch_site not in ("same-origin", "none"):
            return f"cross-site request refused (Sec-Fetch-Site {fetch_site[:40]!r})"
        seed = request.cookies.get(CSRF_COOKIE)
        if not seed or not form_token:
            return "missing CSRF token: reload the page and try again"
        if not hmac.compare_digest(
            self.csrf_token(seed).encode(), form_token.encode("utf-8", "replace")
        ):
            return "bad CSRF token: reload the page and try again"
        return None


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be recorded as who, or None."""
    if not name.strip() or len(name) > MAX_NAME:
        return f"your name (1 to {MAX_NAME} characters) is recorded with each action"
    if identifier_violation(name, "name") is not None:
        # A CR/LF would forge lines in the server's log and the attempt log.
        return "your name may not hold a control character (CR, LF, NUL, ...)"
    return None
