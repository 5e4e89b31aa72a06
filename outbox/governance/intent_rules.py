"""What an intent may contain: the rules ``tx.intend`` checks once per intent, as data.

The rules are named constants and tables (no logic hidden in branches), so the
same rules can be written as PostgreSQL functions for agents in other languages
and a test can hold both to the same cases. Each refusal carries a stable
``code`` (the SQL port returns the same codes) and names the field; it never
repeats a value that may be a secret. ``docs/reference/client.md`` ("What an intent may
contain") documents them for people.

What is checked:

- kinds match :data:`KIND_PATTERN` (a compensation's kind too);
- idempotency and ordering keys, and every other identifier a caller names
  (agent, version, step id, signal name), hold no control character
  (:data:`CONTROL_CHARACTERS`: a CR/LF would forge log lines and break headers);
- a payload that is a JSON object and has a top-level ``headers`` object: each
  header name is an HTTP token, and is not a hop-by-hop or framing header
  (:data:`FRAMING_HEADERS`, ``Proxy-*``: they would corrupt the request), not a
  header the deliverer sets (:data:`RESERVED_HEADERS`), and not a
  credential-bearing header (:data:`CREDENTIAL_NAMES`,
  :data:`CREDENTIAL_NAME_PATTERN`); each value is text with no control
  character other than a tab, and is not an authorization scheme followed by
  a secret (:data:`CREDENTIAL_VALUE_PATTERN`);
- a top-level ``url`` string holds no control character, no userinfo
  (``user:password@``) and no credential-bearing query or fragment parameter
  (:data:`CREDENTIAL_QUERY_NAMES`, :data:`CREDENTIAL_NAME_PATTERN`).

Secrets never ride in payloads (they are stored in plain text and kept for
history): a deliverer reads them when it calls, by reference. See
:data:`CREDENTIALS_BY_REFERENCE`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote_plus, urlsplit

from outbox.errors import ValidationError

__all__ = [
    "CONTROL_CHARACTERS",
    "CREDENTIALS_BY_REFERENCE",
    "CREDENTIAL_FIELD_NAMES",
    "CREDENTIAL_NAMES",
    "CREDENTIAL_NAME_PATTERN",
    "CREDENTIAL_QUERY_NAMES",
    "CREDENTIAL_SCHEMES",
    "CREDENTIAL_VALUE_PATTERN",
    "FRAMING_HEADERS",
    "FRAMING_HEADER_PREFIXES",
    "HEADERS_FIELD",
    "HEADER_NAME_PATTERN",
    "HEADER_NAME_RULES",
    "HEADER_VALUE_FORBIDDEN",
    "KIND_PATTERN",
    "MAX_AMOUNT",
    "MAX_ATTEMPTS",
    "MAX_DELAY_SECONDS",
    "MAX_FAIRNESS_KEY_LENGTH",
    "MAX_KEY_LENGTH",
    "MAX_KIND_LENGTH",
    "MAX_PRIORITY",
    "MAX_SCHEMA_VERSION",
    "QUERY_NAME_RULES",
    "RESERVED_HEADERS",
    "RESERVED_HEADER_PREFIXES",
    "RESERVED_KIND_PREFIXES",
    "URL_FIELD",
    "NameRule",
    "Violation",
    "check_identifier",
    "check_payload",
    "credential_name",
    "find_violation",
    "identifier_violation",
    "normalise_name",
]

# -- the intent's own fields ----------------------------------------------------------

#: An effect kind (and a compensation's kind): a dotted name, as deliverers are registered.
KIND_PATTERN = r"^[A-Za-z0-9_.:-]+$"
#: Kinds a caller cannot name: the dry-run namespace (``outbox.models.DRY_RUN_KIND_PREFIX``)
#: belongs to dry runs, so a real intent can never be served by the recording deliverer
#: and a dry run's effect can never be served by a real one.
RESERVED_KIND_PREFIXES = ("dry-run:",)
MAX_KIND_LENGTH = 200
#: Idempotency keys and ordering keys.
MAX_KEY_LENGTH = 500
#: ``max_attempts`` of one intent.
MAX_ATTEMPTS = 1000
#: ``schema_version`` is stored as a PostgreSQL ``integer``.
MAX_SCHEMA_VERSION = 2**31 - 1
#: The longest ``delay_seconds``, sleep or wait timeout: ten years. Longer is a mistake
#: (an infinite one overflows PostgreSQL's timestamps).
MAX_DELAY_SECONDS = 10 * 365 * 24 * 3600
#: The largest ``cost``, ``budget`` or spend: beyond it a float no longer holds cents.
MAX_AMOUNT = 10**15
#: Priorities run from ``-MAX_PRIORITY`` to ``MAX_PRIORITY``; higher is claimed first (default 0).
MAX_PRIORITY = 1000
#: A fairness key (a tenant, a provider): claims share capacity between them.
MAX_FAIRNESS_KEY_LENGTH = 200

#: C0 controls (CR, LF, NUL ...), DEL, C1 controls and the Unicode line and
#: paragraph separators. Refused in keys and identifiers: they forge log lines
#: and break the headers a key is sent in.
CONTROL_CHARACTERS = "[\x00-\x1f\x7f-\x9f\u2028\u2029]"
# Python strings may hold lone surrogates, which are not text PostgreSQL (or UTF-8) can hold.
_SURROGATES = "[\ud800-\udfff]"

# -- payload fields the rules look at ---------------------------------------------------

#: A payload's top-level ``headers`` object (HTTP headers, Kafka record headers).
HEADERS_FIELD = "headers"
#: A payload's top-level ``url`` string.
URL_FIELD = "url"

#: An HTTP header name is a token (RFC 9110, section 5.1).
HEADER_NAME_PATTERN = r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$"
#: Header values may hold a tab, but no other control character (RFC 9110, section 5.5).
HEADER_VALUE_FORBIDDEN = "[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]"

#: Hop-by-hop and framing headers: the HTTP client sets them; from a payload they
#: change how the request is framed (a forged Transfer-Encoding corrupts the body).
FRAMING_HEADERS = frozenset(
    {
        "connection",
        "content-length",
        "expect",
        "host",
        "http2-settings",
        "keep-alive",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
FRAMING_HEADER_PREFIXES = ("proxy-",)
#: Set by the deliverer from the intent itself.
RESERVED_HEADERS = frozenset({"idempotency-key"})
RESERVED_HEADER_PREFIXES = ("x-outbox-",)

#: Names that carry a credential, whole (compared after :func:`normalise_name`).
CREDENTIAL_NAMES = frozenset({"authorization", "cookie", "set-cookie", "www-authenticate"})
#: Parts of names that carry a credential (searched in the normalised name).
#: Besides ``api-key`` and friends anywhere in a name, a key named for what it unlocks,
#: as a word of its own: ``Ocp-Apim-Subscription-Key`` (Azure API Management),
#: ``X-Functions-Key`` (Azure Functions), ``DD-Application-Key``, ``X-App-Key``,
#: ``X-Master-Key``, ``X-License-Key``, ``authkey``, the S3 customer encryption key.
#: Names that only end in ``key`` stay ordinary (``X-Partition-Key``, ``sort_key``,
#: ``X-Public-Key-Id``): a routing or lookup key is not a secret.
CREDENTIAL_NAME_PATTERN = (
    r"token|secret|passw(or)?d|passphrase|credential|session|cookie"
    r"|api-?key|access-?key|private-?key|secret-?key"
    r"|authori[sz]ation|authentication|(^|-)auth(-|$)"
    r"|(^|-)(subscription|functions?|app|application|master|license|insert|signing|auth"
    r"|encryption(-customer)?)-?key(-|$)"
)
#: URL query (and fragment) parameters that carry a credential, whole, besides the
#: pattern: request signatures of pre-signed URLs are bearer secrets too.
#:
#: ``key`` is refused although some URLs use it for something public (an object or
#: a lookup key): it is how Google (``?key=AIza...``), Bing Maps, Trello and many
#: others take an API key in the URL, and the two mistakes do not cost the same. A
#: refused intent fails at once, naming the parameter, and nothing is written; a
#: key let through is stored in plain text, kept for history and copied into gc
#: archives, where no later fix reaches it. Only the whole name is refused:
#: ``keyword``, ``sort_key`` and ``key_id`` are not.
CREDENTIAL_QUERY_NAMES = frozenset(
    {
        "key",
        "sig",
        "signature",
        "x-amz-signature",
        "x-amz-credential",
        "x-goog-signature",
        "x-goog-credential",
        "jwt",
        "pwd",
        "pass",
    }
)
#: Object fields (in any JSON a reader shows) whose values are credentials, besides the
#: names of :data:`CREDENTIAL_NAMES` and :data:`CREDENTIAL_NAME_PATTERN`: the URL
#: parameters above, but ``key``, which in a JSON object is far more often a lookup key
#: (an S3 object, a cache entry) than a secret.
CREDENTIAL_FIELD_NAMES = CREDENTIAL_QUERY_NAMES - {"key"}
#: Authorization schemes followed by a secret: ``Bearer`` and ``Basic`` (RFC 9110),
#: ``Token`` (GitHub, Django REST framework), ``ApiKey``/``Api-Key``/``Key``
#: (Elasticsearch and others), ``SSWS`` (Okta) and ``OAuth``.
CREDENTIAL_SCHEMES = r"bearer|basic|token|(api-?)?key|ssws|oauth"
#: A header value that is an authorization scheme and its secret (``Bearer eyJhbGciOi...``),
#: whatever the header's name, so a credential cannot ride under an innocent one. The
#: secret is one token68 of 16+ characters, so prose that starts with one of these words
#: ("Token expired for ...") is not refused.
CREDENTIAL_VALUE_PATTERN = rf"^\s*({CREDENTIAL_SCHEMES})\s+[A-Za-z0-9._~+/-]{{16,}}=*\s*$"

#: How a credential reaches a sink instead: said by every credential refusal.
CREDENTIALS_BY_REFERENCE = (
    "payloads are stored in plain text, so credentials go by reference: name one "
    "in the payload's 'credential' field and configure it in the deliverers config "
    "([kinds.<kind>.credentials.<name>] with env = ... or file = ...)"
)


def normalise_name(name: str) -> str:
    """Header and parameter names are compared lower-case, with ``_`` read as ``-``."""
    return name.lower().replace("_", "-")


@dataclass(frozen=True)
class NameRule:
    """Refuse a normalised name that is in ``names``, starts with a prefix, or matches ``pattern``.

    Rules are tried in their table's order; the first that matches gives the refusal.
    """

    code: str
    reason: str
    names: frozenset[str] = frozenset()
    prefixes: tuple[str, ...] = ()
    pattern: str | None = None

    def matches(self, normalised: str) -> bool:
        """Whether this rule refuses the (already normalised) name."""
        if normalised in self.names or normalised.startswith(self.prefixes):
            return True
        return self.pattern is not None and _compiled(self.pattern).search(normalised) is not None


#: The rules on header names, in order.
HEADER_NAME_RULES: tuple[NameRule, ...] = (
    NameRule(
        "framing-header",
        "is a hop-by-hop or framing header: the HTTP client sets it",
        names=FRAMING_HEADERS,
        prefixes=FRAMING_HEADER_PREFIXES,
    ),
    NameRule(
        "reserved-header",
        "is set by the deliverer (the idempotency key travels as the intent's key)",
        names=RESERVED_HEADERS,
        prefixes=RESERVED_HEADER_PREFIXES,
    ),
    NameRule(
        "credential-header",
        f"carries a credential; {CREDENTIALS_BY_REFERENCE}",
        names=CREDENTIAL_NAMES,
        pattern=CREDENTIAL_NAME_PATTERN,
    ),
)
#: The rules on URL query and fragment parameter names.
QUERY_NAME_RULES: tuple[NameRule, ...] = (
    NameRule(
        "credential-query-parameter",
        f"carries a credential; {CREDENTIALS_BY_REFERENCE}",
        names=CREDENTIAL_NAMES | CREDENTIAL_QUERY_NAMES,
        pattern=CREDENTIAL_NAME_PATTERN,
    ),
)

#: Every refusal's code and reason, for the SQL port and the docs.
REASONS: Mapping[str, str] = {
    "control-character": "holds a control character (CR, LF, NUL, ...), which is refused",
    "surrogate": "holds a lone surrogate, which is not valid Unicode text",
    "headers-type": "must be an object of header names to text values",
    "header-name-syntax": (
        "is not a valid header name (an HTTP token: letters, digits and !#$%&'*+.^_`|~-)"
    ),
    "header-value-type": "must be text",
    "header-value-control": "holds a control character (CR, LF, NUL, ...) other than a tab",
    "credential-value": f"is an authorization scheme and its secret; {CREDENTIALS_BY_REFERENCE}",
    "url-type": "must be text",
    "url-control": "holds a control character (CR, LF, NUL, ...)",
    "url-userinfo": f"holds a user name or password before the host; {CREDENTIALS_BY_REFERENCE}",
    **{rule.code: rule.reason for rule in HEADER_NAME_RULES + QUERY_NAME_RULES},
}


_cache: dict[str, re.Pattern[str]] = {}


def _compiled(pattern: str) -> re.Pattern[str]:
    found = _cache.get(pattern)
    if found is None:
        found = _cache[pattern] = re.compile(pattern, re.IGNORECASE)
    return found


_IDENTIFIER_FORBIDDEN = _compiled(f"({CONTROL_CHARACTERS})|({_SURROGATES})")
_HEADER_NAME = _compiled(HEADER_NAME_PATTERN)
_HEADER_VALUE_FORBIDDEN = _compiled(HEADER_VALUE_FORBIDDEN)
_CREDENTIAL_VALUE = _compiled(CREDENTIAL_VALUE_PATTERN)
_URL_FORBIDDEN = _compiled(CONTROL_CHARACTERS)


@dataclass(frozen=True)
class Violation:
    """Why a value is refused: the rule's code, the field, and what may be shown of it."""

    code: str
    field: str
    shown: str

    @property
    def reason(self) -> str:
        """The rule's explanation."""
        return REASONS[self.code]

    def error(self) -> ValidationError:
        """The typed error a caller gets."""
        return ValidationError(self.field, self.shown, self.reason, rule=self.code)


def identifier_violation(value: str, field: str) -> Violation | None:
    """A control character or lone surrogate in a key or identifier, if any."""
    match = _IDENTIFIER_FORBIDDEN.search(value)
    if match is None:
        return None
    return Violation("control-character" if match[1] else "surrogate", field, value)


def check_identifier(value: str, field: str) -> str:
    """Return ``value``, or raise :class:`ValidationError` if it holds a control character."""
    found = identifier_violation(value, field)
    if found is not None:
        raise found.error()
    return value


def find_violation(payload: Any, field: str = "payload") -> Violation | None:
    """The first rule a payload breaks, or ``None`` (only top-level ``headers`` and ``url``)."""
    if not isinstance(payload, dict):
        return None
    headers = payload.get(HEADERS_FIELD)
    if headers is not None:
        found = _headers_violation(headers, f"{field}.{HEADERS_FIELD}")
        if found is not None:
            return found
    url = payload.get(URL_FIELD)
    if url is not None:
        return _url_violation(url, f"{field}.{URL_FIELD}")
    return None


def credential_name(name: str, *, in_url: bool = False) -> bool:
    """Whether a header, field or (``in_url``) URL parameter of this name carries a credential.

    The same table the rules refuse by: :data:`CREDENTIAL_NAMES`,
    :data:`CREDENTIAL_NAME_PATTERN`, and :data:`CREDENTIAL_QUERY_NAMES` in a URL or
    :data:`CREDENTIAL_FIELD_NAMES` elsewhere. Readers (the console) use it to redact.
    """
    normalised = normalise_name(name)
    if normalised in (CREDENTIAL_QUERY_NAMES if in_url else CREDENTIAL_FIELD_NAMES):
        return True
    return normalised in CREDENTIAL_NAMES or (
        _compiled(CREDENTIAL_NAME_PATTERN).search(normalised) is not None
    )


def check_payload(payload: Any, field: str = "payload") -> None:
    """Raise :class:`ValidationError` naming the field if the payload breaks a rule."""
    found = find_violation(payload, field)
    if found is not None:
        raise found.error()


# The same few header and parameter names come back intent after intent: their
# verdict is remembered (bounded), so a payload's names cost a dict lookup each.
_MAX_REMEMBERED = 4096
_header_codes: dict[str, str | None] = {}
_query_codes: dict[str, str | None] = {}
_QUERY_NAMES = re.compile(r"(?:^|[&;])([^=&;]*)=")


def _rule_code(
    name: str, rules: tuple[NameRule, ...], remembered: dict[str, str | None]
) -> str | None:
    try:
        return remembered[name]
    except KeyError:
        pass
    normalised = normalise_name(name)
    code = next((rule.code for rule in rules if rule.matches(normalised)), None)
    if len(remembered) < _MAX_REMEMBERED:
        remembered[name] = code
    return code


def _headers_violation(headers: Any, field: str) -> Violation | None:
    if not isinstance(headers, dict):
        return Violation("headers-type", field, type(headers).__name__)
    for name, value in headers.items():
        if not isinstance(name, str) or _HEADER_NAME.match(name) is None:
            return Violation("header-name-syntax", field, _printable(name))
        code = _rule_code(name, HEADER_NAME_RULES, _header_codes)
        if code is not None:
            return Violation(code, field, name)
        if not isinstance(value, str):
            return Violation("header-value-type", f"{field}.{name}", type(value).__name__)
        if _HEADER_VALUE_FORBIDDEN.search(value) is not None:
            # The value itself is not shown: it may be a secret.
            shown = f"<{len(value)} characters>"
            return Violation("header-value-control", f"{field}.{name}", shown)
        if _CREDENTIAL_VALUE.match(value) is not None:
            shown = value.split()[0] + " <hidden>"
            return Violation("credential-value", f"{field}.{name}", shown)
    return None


def _url_violation(url: Any, field: str) -> Violation | None:
    if not isinstance(url, str):
        return Violation("url-type", field, type(url).__name__)
    if _URL_FORBIDDEN.search(url) is not None:
        return Violation("url-control", field, _printable(_redacted(url)))
    if "@" not in url and "=" not in url:
        return None  # no userinfo, no parameters: nothing more to look at
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unbalanced [ in the host: the deliverer refuses the URL
        return None
    if "@" in parts.netloc:
        return Violation("url-userinfo", field, _redacted(url))
    for text in (parts.query, parts.fragment):
        # Some servers split parameters on ';' as well as '&'; names may be %-encoded.
        for name in _QUERY_NAMES.findall(text):
            if "%" in name or "+" in name:
                name = unquote_plus(name)
            if _rule_code(name, QUERY_NAME_RULES, _query_codes) is not None:
                return Violation("credential-query-parameter", field, _redacted(url))
    return None


def _printable(value: Any) -> str:
    """Shown with control characters escaped, so an error cannot forge a log line."""
    return ascii(value)[1:-1] if isinstance(value, str) else repr(value)


def _redacted(url: str) -> str:
    """The URL as it may be shown: no userinfo, no query or fragment values."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    shown = f"{parts.scheme}://{host}{parts.path}"
    if parts.query:
        shown += "?" + "&".join(
            f"{n}=..." for n, _ in parse_qsl(parts.query, keep_blank_values=True)
        )
    if parts.fragment:
        shown += "#..."
    return shown
