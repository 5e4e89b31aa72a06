"""The HTTP deliverer against real local servers: DNS pinning, redirects, deadlines, body caps.

Issue 11: H1 (the guard resolved a name, httpx resolved it again to connect:
a rebinding resolver reached 127.0.0.1), M2 (the timeout bounded each read,
not the call; lookups read bodies of any size), M1 (URLs with tokens logged).

A resolver stands in for DNS: either injected into the deliverer, or the
system's ``getaddrinfo`` answering one made-up name differently on each call,
as a rebinding DNS server does (the deliverer's default resolution path).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import pydantic
import pytest

from deliverers.http import HttpDeliverer, HttpRequest
from deliverers.testing import Fault, IdempotentHttpSink
from outbox.delivery import Delivery, Failed, NotApplied, Outcome, Retry, Succeeded, Unknown

REBIND = "rebind.test"


def deliver(deliverer: HttpDeliverer, url: str, **payload: Any) -> Outcome:
    try:
        request = deliverer.parse_payload({"url": url, "json": {"n": 1}, **payload})
    except pydantic.ValidationError as exc:
        return Failed(str(exc.errors()[0]["msg"]))  # as the daemon records it
    assert isinstance(request, HttpRequest)
    delivery = Delivery(uuid.uuid4(), None, deliverer.kind, request, uuid.uuid4().hex, 1)

    async def once() -> Outcome:
        try:
            return await deliverer.deliver(delivery)
        finally:
            await deliverer.aclose()

    return asyncio.run(once())


def lookup(deliverer: HttpDeliverer, key: str = "k") -> Any:
    delivery = Delivery(uuid.uuid4(), None, deliverer.kind, None, key, 1)

    async def once() -> Any:
        try:
            return await deliverer.lookup(delivery)
        finally:
            await deliverer.aclose()

    return asyncio.run(once())


@pytest.fixture
def two_loopback_sinks() -> Iterator[tuple[IdempotentHttpSink, IdempotentHttpSink]]:
    """A sink on 127.0.0.2 (allowed) and one on 127.0.0.1 (not), on the same port."""
    allowed = IdempotentHttpSink(host="127.0.0.2").start()
    port = int(allowed.url.rsplit(":", 1)[1])
    forbidden = IdempotentHttpSink(host="127.0.0.1", port=port).start()
    try:
        yield allowed, forbidden
    finally:
        allowed.stop()
        forbidden.stop()


class Rebinding:
    """Answers ``answers[i]`` on the i-th lookup of a name (the last one from then on)."""

    def __init__(self, *answers: Sequence[str] | BaseException) -> None:
        self.answers = list(answers)
        self.calls = 0

    def next(self) -> Sequence[str]:
        answer = self.answers[min(self.calls, len(self.answers) - 1)]
        self.calls += 1
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def __call__(self, host: str, port: int) -> Sequence[str]:
        return self.next()


@pytest.fixture
def rebinding_dns(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Rebinding]]:
    """The system resolver answers ``rebind.test`` as the test's Rebinding says."""
    holder: list[Rebinding] = []
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode() if isinstance(host, bytes) else host
        if name != REBIND:
            return real(host, port, *args, **kwargs)
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, int(port or 0)))
            for address in holder[0].next()
        ]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield holder


def test_a_rebinding_name_reaches_only_the_address_that_was_checked(
    two_loopback_sinks: tuple[IdempotentHttpSink, IdempotentHttpSink],
    rebinding_dns: list[Rebinding],
) -> None:
    """Checked: 127.0.0.2 (allowed). A second lookup would say 127.0.0.1: there is none."""
    allowed, forbidden = two_loopback_sinks
    rebinding_dns.append(Rebinding(["127.0.0.2"], ["127.0.0.1"]))
    port = allowed.url.rsplit(":", 1)[1]
    deliverer = HttpDeliverer.from_config("http.request", {"allow_private": ["127.0.0.2"]})
    assert isinstance(deliverer, HttpDeliverer)
    outcome = deliver(deliverer, f"http://{REBIND}:{port}/ledger")
    assert isinstance(outcome, Succeeded), outcome
    assert allowed.stats()["requests"] == 1
    assert forbidden.stats()["requests"] == 0, "the connection went to an unchecked address"
    assert rebinding_dns[0].calls == 1, "one lookup per connection"


def test_public_then_loopback_never_reaches_loopback(
    two_loopback_sinks: tuple[IdempotentHttpSink, IdempotentHttpSink],
) -> None:
    """The check sees a public address; the connection goes there (and fails), not to loopback."""
    _, loopback = two_loopback_sinks
    port = loopback.url.rsplit(":", 1)[1]
    resolver = Rebinding(["93.184.216.34"], ["127.0.0.1"])
    deliverer = HttpDeliverer("http.request", resolver=resolver)
    outcome = deliver(deliverer, f"http://{REBIND}:{port}/ledger", timeout=1.0)
    assert isinstance(outcome, Retry) and outcome.reason.startswith("not sent"), outcome
    assert loopback.stats()["requests"] == 0
    assert resolver.calls == 1


def test_a_name_that_does_not_resolve_is_not_connected_to(
    rebinding_dns: list[Rebinding],
) -> None:
    """Fail closed: a failed check is no licence to connect (a second lookup may rebind)."""
    with IdempotentHttpSink() as sink:
        port = sink.url.rsplit(":", 1)[1]
        rebinding_dns.append(
            Rebinding(socket.gaierror(-2, "Name or service not known"), ["127.0.0.1"])
        )
        deliverer = HttpDeliverer.from_config("http.request", {})
        assert isinstance(deliverer, HttpDeliverer)
        outcome = deliver(deliverer, f"http://{REBIND}:{port}/ledger")
        assert isinstance(outcome, Retry), outcome
        assert "not sent" in outcome.reason and "could not resolve" in outcome.reason
        assert sink.stats()["requests"] == 0


def test_every_address_of_a_name_is_checked() -> None:
    with IdempotentHttpSink() as sink:
        port = sink.url.rsplit(":", 1)[1]
        resolver = Rebinding(["93.184.216.34", "169.254.169.254"])
        deliverer = HttpDeliverer("http.request", resolver=resolver)
        outcome = deliver(deliverer, f"http://{REBIND}:{port}/x")
        assert isinstance(outcome, Failed) and "169.254.169.254 (link-local" in outcome.reason


def test_metadata_and_carrier_grade_nat_addresses_are_refused_without_a_call() -> None:
    deliverer = HttpDeliverer("http.request")
    for url in (
        "http://100.100.100.200/latest/meta-data",
        "http://[::ffff:169.254.169.254]/latest",
        "http://[64:ff9b::7f00:1]:8080/",
        "http://[2002:7f00:1::1]/",
    ):
        outcome = deliver(deliverer, url, timeout=1.0)
        assert isinstance(outcome, Failed) and "non-public address" in outcome.reason, url


# -- redirects: every hop is checked; credentials stay with the first origin -------------


def test_a_redirect_to_a_refused_address_is_not_followed(
    two_loopback_sinks: tuple[IdempotentHttpSink, IdempotentHttpSink],
) -> None:
    allowed, forbidden = two_loopback_sinks
    allowed.inject(Fault("redirect", times=1, status=307, location=f"{forbidden.url}/ledger"))
    deliverer = HttpDeliverer.from_config(
        "http.request", {"allow_private": ["127.0.0.2"], "follow_redirects": True}
    )
    assert isinstance(deliverer, HttpDeliverer)
    outcome = deliver(deliverer, f"{allowed.url}/ledger")
    assert isinstance(outcome, Failed) and "non-public address 127.0.0.1" in outcome.reason
    assert forbidden.stats()["requests"] == 0


def test_a_followed_redirect_leaves_the_credential_behind_at_another_origin(
    two_loopback_sinks: tuple[IdempotentHttpSink, IdempotentHttpSink],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first, second = two_loopback_sinks
    monkeypatch.setenv("SINK_KEY", "s3cret")
    first.inject(Fault("redirect", times=1, status=307, location=f"{first.url}/moved"))
    first.inject(Fault("redirect", times=1, status=308, location=f"{second.url}/ledger"))
    deliverer = HttpDeliverer.from_config(
        "http.request",
        {
            "allow_private": ["127.0.0.0/8"],
            "follow_redirects": True,
            "credentials": {"sink": {"header": "X-Api-Key", "env": "SINK_KEY"}},
        },
    )
    assert isinstance(deliverer, HttpDeliverer)
    outcome = deliver(deliverer, f"{first.url}/ledger", credential="sink")
    assert isinstance(outcome, Succeeded), outcome
    assert [c.get("X-Api-Key") for c in first.state.credentials_seen] == ["s3cret", "s3cret"]
    assert second.state.credentials_seen == [{}], "the credential went to another origin"
    assert second.stats()["keys_applied"] == 1


def test_redirects_are_not_followed_unless_configured() -> None:
    with IdempotentHttpSink() as sink:
        sink.inject(Fault("redirect", times=1, status=307, location=f"{sink.url}/moved"))
        deliverer = HttpDeliverer.from_config("http.request", {"allow_private": ["127.0.0.1"]})
        assert isinstance(deliverer, HttpDeliverer)
        outcome = deliver(deliverer, f"{sink.url}/ledger")
        assert isinstance(outcome, Failed) and outcome.reason == "HTTP 307"


# -- M2: one deadline per call, and a capped body, for deliver and lookup ----------------


def test_a_sink_trickling_its_answer_cannot_hold_a_call_past_its_timeout() -> None:
    with IdempotentHttpSink() as sink:
        sink.inject(Fault("trickle", times=1, interval=0.5, body=b"x" * 40))
        deliverer = HttpDeliverer.from_config(
            "http.blind", {"allow_private": ["127.0.0.1"], "idempotent": False}
        )
        assert isinstance(deliverer, HttpDeliverer)
        started = time.monotonic()
        outcome = deliver(deliverer, f"{sink.url}/ledger", timeout=1.0)
        took = time.monotonic() - started
    assert took < 5, f"a 1 s call took {took:.1f}s (each read was within its timeout)"
    # The request was sent (and applied): a sink that cannot dedup goes to an operator.
    assert isinstance(outcome, Unknown), outcome
    assert "timed out after 1.0s" in outcome.reason


def test_a_lookup_has_a_deadline_too() -> None:
    with IdempotentHttpSink() as sink:
        sink.inject(Fault("trickle", times=1, interval=0.5, body=b'{"applied": true}' * 3))
        deliverer = HttpDeliverer.from_config(
            "http.request",
            {
                "allow_private": ["127.0.0.1"],
                "lookup_url": f"{sink.url}/idempotency/{{key}}",
                "lookup_timeout": 1.0,
            },
        )
        assert isinstance(deliverer, HttpDeliverer)
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"within 1\.0s"):
            lookup(deliverer)
        assert time.monotonic() - started < 5
        assert isinstance(lookup(deliverer), NotApplied)


def test_a_lookup_reads_a_huge_answer_only_up_to_the_limit() -> None:
    size = 200 * 1024 * 1024
    with IdempotentHttpSink() as sink:
        deliverer = HttpDeliverer.from_config(
            "http.request",
            {
                "allow_private": ["127.0.0.1"],
                "lookup_url": f"{sink.url}/big/{size}",
                "read_limit_bytes": 64 * 1024,
                "excerpt_bytes": 10,
            },
        )
        assert isinstance(deliverer, HttpDeliverer)
        answer = lookup(deliverer)
        assert isinstance(answer, Succeeded) and answer.result["body"] == "x" * 10
        time.sleep(0.2)  # the server notices the closed connection
        sent = sink.state.big_bytes_sent
    assert sent < size // 4, f"{sent} of {size} bytes were read for a lookup"


# -- M1: URLs in deliverer logs hide tokens and userinfo ---------------------------------


def test_logged_urls_hide_query_strings_and_userinfo(caplog: pytest.LogCaptureFixture) -> None:
    with IdempotentHttpSink() as sink:
        host_port = sink.url.removeprefix("http://")
        deliverer = HttpDeliverer.from_config("http.request", {"allow_private": ["127.0.0.1"]})
        assert isinstance(deliverer, HttpDeliverer)
        with caplog.at_level(logging.DEBUG):
            # Userinfo and credential parameters never reach a call (issue 27 item 14:
            # refused at send time); any other parameter may still hold something private.
            outcome = deliver(deliverer, f"http://{host_port}/ledger?state=t0ken&v=2")
            refused = deliver(
                deliverer, f"http://alice:pa55word@{host_port}/ledger?access_token=t0ken"
            )
    assert isinstance(outcome, Succeeded)
    text = caplog.text
    assert "HTTP Request: POST" in text, "httpx logs each request"
    assert "t0ken" not in text and "pa55word" not in text and "alice" not in text
    assert "state=***" in text
    assert isinstance(refused, Failed) and "pa55word" not in refused.reason


def test_a_lookup_obeys_allow_private_and_allowed_hosts_as_a_call_does() -> None:
    """docs/reference/deliverers-config.md: ``lookup_url`` is reached under the same rules."""
    with IdempotentHttpSink() as sink:
        template = f"{sink.url}/idempotency/{{key}}"
        for config in (
            {"lookup_url": template},  # loopback, not allowed
            {"lookup_url": template, "allow_private": ["127.0.0.1"], "allowed_hosts": ["x.test"]},
        ):
            refused = HttpDeliverer.from_config("http.request", config)
            assert isinstance(refused, HttpDeliverer)
            with pytest.raises(PermissionError):
                lookup(refused)
        assert sink.state.gets == 0, "a refused lookup never connects"
        allowed = HttpDeliverer.from_config(
            "http.request", {"lookup_url": template, "allow_private": ["127.0.0.1"]}
        )
        assert isinstance(allowed, HttpDeliverer)
        assert isinstance(lookup(allowed), NotApplied)
        assert sink.state.gets == 1
