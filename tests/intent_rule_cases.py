"""The cases every implementation of the intent rules must agree on (``governance.intent_rules``).

Python checks them in ``tests/unit/test_intent_rules.py``; a port of the rules
(PostgreSQL functions for agents in other languages) is held to the same table.
Each case: a payload, then the refusal's code and field, or ``None`` when accepted.
"""

from __future__ import annotations

from typing import Any

PayloadCase = tuple[Any, tuple[str, str] | None]

H = "payload.headers"
U = "payload.url"

PAYLOAD_CASES: list[PayloadCase] = [
    # accepted
    ({"url": "https://api.example.com/v1/charges", "headers": {"X-Request-Id": "r-1"}}, None),
    ({"headers": {"Content-Type": "application/json", "Accept": "*/*"}}, None),
    ({"headers": {"X-Trace": "a\tb"}}, None),
    ({"headers": {"X-Plan": "basic tier"}}, None),
    ({"headers": {}}, None),
    ({"url": "https://example.com/search?q=tokens+of+love&page=2"}, None),
    # names that merely contain "key" are ordinary (only the whole name `key` is refused)
    ({"url": "https://example.com/a?keyword=red&sort_key=date&key_id=7&monkey=1#top"}, None),
    ({"headers": {"X-Partition-Key": "p-1", "X-Cache-Key": "c", "X-Public-Key-Id": "k"}}, None),
    ({"headers": {"X-Status": "Token expired for user 0123456789abcdef"}}, None),
    ({"url": "https://example.com/path@with-at-in-path"}, None),
    ({"body": {"headers": {"Authorization": "nested objects are the body, not headers"}}}, None),
    ({"json": {"url": "https://u:p@nested.example.com"}}, None),
    (["headers", {"Authorization": "x"}], None),
    ("a plain string", None),
    (None, None),
    # hop-by-hop and framing headers (M5)
    ({"headers": {"Transfer-Encoding": "chunked"}}, ("framing-header", H)),
    ({"headers": {"content-length": "5"}}, ("framing-header", H)),
    ({"headers": {"Connection": "close"}}, ("framing-header", H)),
    ({"headers": {"Host": "internal.example"}}, ("framing-header", H)),
    ({"headers": {"TE": "trailers"}}, ("framing-header", H)),
    ({"headers": {"Trailer": "X-Sum"}}, ("framing-header", H)),
    ({"headers": {"Upgrade": "websocket"}}, ("framing-header", H)),
    ({"headers": {"Keep-Alive": "timeout=5"}}, ("framing-header", H)),
    ({"headers": {"Proxy-Connection": "keep-alive"}}, ("framing-header", H)),
    ({"headers": {"Proxy-Authorization": "Basic eA=="}}, ("framing-header", H)),
    ({"headers": {"Expect": "100-continue"}}, ("framing-header", H)),
    # set by the deliverer
    ({"headers": {"Idempotency-Key": "mine"}}, ("reserved-header", H)),
    ({"headers": {"X-Outbox-Attempt": "9"}}, ("reserved-header", H)),
    # credential-bearing header names (M1)
    ({"headers": {"Authorization": "Bearer abc"}}, ("credential-header", H)),
    ({"headers": {"Cookie": "sid=1"}}, ("credential-header", H)),
    ({"headers": {"X-Auth-Token": "abc"}}, ("credential-header", H)),
    ({"headers": {"Api-Key": "abc"}}, ("credential-header", H)),
    ({"headers": {"X-API-KEY": "abc"}}, ("credential-header", H)),
    ({"headers": {"apikey": "abc"}}, ("credential-header", H)),
    ({"headers": {"X_Api_Key": "abc"}}, ("credential-header", H)),
    ({"headers": {"X-Client-Secret": "abc"}}, ("credential-header", H)),
    ({"headers": {"X-Password": "abc"}}, ("credential-header", H)),
    ({"headers": {"X-Session-Id": "abc"}}, ("credential-header", H)),
    ({"headers": {"X-Amz-Security-Token": "abc"}}, ("credential-header", H)),
    ({"headers": {"X-Auth": "abc"}}, ("credential-header", H)),
    ({"headers": {"X-Access-Key": "abc"}}, ("credential-header", H)),
    ({"headers": {"X-Authorization": "abc"}}, ("credential-header", H)),
    ({"headers": {"Ocp-Apim-Subscription-Key": "abc"}}, ("credential-header", H)),
    ({"headers": {"subscriptionKey": "abc"}}, ("credential-header", H)),
    ({"headers": {"X-Functions-Key": "abc"}}, ("credential-header", H)),
    ({"headers": {"DD-Application-Key": "abc"}}, ("credential-header", H)),
    ({"headers": {"X-App-Key": "abc"}}, ("credential-header", H)),
    ({"headers": {"X-Master-Key": "abc"}}, ("credential-header", H)),
    ({"headers": {"X-License-Key": "abc"}}, ("credential-header", H)),
    ({"headers": {"authkey": "abc"}}, ("credential-header", H)),
    ({"headers": {"X-Insert-Key": "abc"}}, ("credential-header", H)),
    ({"headers": {"webhook_signing_key": "abc"}}, ("credential-header", H)),
    (
        {"headers": {"X-Amz-Server-Side-Encryption-Customer-Key": "abc"}},
        ("credential-header", H),
    ),
    # header syntax and values (L4)
    ({"headers": {"X-Ok": "fine", "Bad Name": "v"}}, ("header-name-syntax", H)),
    ({"headers": {"X-A\r\nX-Injected": "v"}}, ("header-name-syntax", H)),
    ({"headers": {"": "v"}}, ("header-name-syntax", H)),
    ({"headers": {"X-Note": "a\r\nX-Injected: 1"}}, ("header-value-control", H + ".X-Note")),
    ({"headers": {"X-Note": "a\nb"}}, ("header-value-control", H + ".X-Note")),
    ({"headers": {"X-Note": "a\x00b"}}, ("header-value-control", H + ".X-Note")),
    ({"headers": {"X-Note": "a\x7fb"}}, ("header-value-control", H + ".X-Note")),
    ({"headers": {"X-Count": 3}}, ("header-value-type", H + ".X-Count")),
    (
        {"headers": {"X-Forward": "Bearer eyJhbGciOiJIUzI1NiJ9.e30"}},
        ("credential-value", H + ".X-Forward"),
    ),
    (
        {"headers": {"X-Forward": "basic dXNlcjpwYXNzd29yZA=="}},
        ("credential-value", H + ".X-Forward"),
    ),
    (
        {"headers": {"X-Forward": "Token 9944b09199c62bcf9418ad846dd0e4bbdfc6ee4b"}},
        ("credential-value", H + ".X-Forward"),
    ),
    (
        {"headers": {"X-Forward": "ApiKey VnVhQ2ZHY0JDZGJrUW0tZTVhT3g6dWky=="}},
        ("credential-value", H + ".X-Forward"),
    ),
    (
        {"headers": {"X-Forward": "api-key 0123456789abcdef0123"}},
        ("credential-value", H + ".X-Forward"),
    ),
    (
        {"headers": {"X-Forward": "Key 0123456789abcdef0123"}},
        ("credential-value", H + ".X-Forward"),
    ),
    (
        {"headers": {"X-Forward": "SSWS 00QCjAl4MlV-WPXM-ABCDEFGHIJ"}},
        ("credential-value", H + ".X-Forward"),
    ),
    (
        {"headers": {"X-Forward": "OAuth y0_AgAAAAAAxxxxxxxxxxxxxxxxxx"}},
        ("credential-value", H + ".X-Forward"),
    ),
    ({"headers": [["Authorization", "x"]]}, ("headers-type", H)),
    ({"headers": "Authorization: x"}, ("headers-type", H)),
    # URLs (M1, L4)
    ({"url": "https://user:pw@api.example.com/"}, ("url-userinfo", U)),
    ({"url": "https://token@api.example.com/"}, ("url-userinfo", U)),
    ({"url": "https://api.example.com/?access_token=abc"}, ("credential-query-parameter", U)),
    ({"url": "https://api.example.com/?a=1&api_key=abc"}, ("credential-query-parameter", U)),
    ({"url": "https://api.example.com/?apiKey=abc"}, ("credential-query-parameter", U)),
    ({"url": "https://api.example.com/?token=abc"}, ("credential-query-parameter", U)),
    ({"url": "https://blob.example.com/c/b?sv=2024&sig=abc"}, ("credential-query-parameter", U)),
    ({"url": "https://s3.example.com/o?X-Amz-Signature=abc"}, ("credential-query-parameter", U)),
    (
        {"url": "https://maps.example.com/geo?a=x&key=AIzaSyA-0123456789abcdefghijklmnopqrs"},
        ("credential-query-parameter", U),
    ),
    ({"url": "https://example.com/a?Key=user-42#section"}, ("credential-query-parameter", U)),
    ({"url": "https://api.example.com/?subscription-key=abc"}, ("credential-query-parameter", U)),
    ({"url": "https://api.example.com/?access_key=abc"}, ("credential-query-parameter", U)),
    ({"url": "https://api.example.com/?appKey=abc"}, ("credential-query-parameter", U)),
    ({"url": "https://api.example.com/?client_secret=abc"}, ("credential-query-parameter", U)),
    ({"url": "https://api.example.com/?password="}, ("credential-query-parameter", U)),
    ({"url": "https://api.example.com/?a=1;token=abc"}, ("credential-query-parameter", U)),
    ({"url": "https://api.example.com/?%74oken=abc"}, ("credential-query-parameter", U)),
    ({"url": "https://app.example.com/cb#access_token=abc"}, ("credential-query-parameter", U)),
    ({"url": "https://api.example.com/a\r\nHost: evil"}, ("url-control", U)),
    ({"url": "https://api.example.com/\x00"}, ("url-control", U)),
    ({"url": ["https://api.example.com/"]}, ("url-type", U)),
    # headers are checked before the URL
    (
        {"url": "https://u:p@example.com", "headers": {"Cookie": "a"}},
        ("credential-header", H),
    ),
]

#: Keys, ordering keys and other names a caller gives: accepted, or the refusal's code.
IDENTIFIER_CASES: list[tuple[str, str | None]] = [
    ("invoice-42", None),
    ("order 7 / confirmation", None),
    ("ключ-ü-✓", None),
    ("a\\u0000b", None),  # the six characters \u0000 are text, not a NUL (L5)
    ("a\r\nb", "control-character"),
    ("a\nINFO forged log line", "control-character"),
    ("a\x00b", "control-character"),
    ("a\tb", "control-character"),
    ("a\x1bb", "control-character"),
    ("a\x85b", "control-character"),
    ("a\u2028b", "control-character"),
    ("a\x7fb", "control-character"),
    ("a\ud800b", "surrogate"),
]
