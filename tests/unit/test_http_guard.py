"""The HTTP deliverer's address policy, exhaustively, and URL redaction in logs (issue 11: H1, M1).

The pinning itself (resolve once, connect to what was checked) is proved with
real servers in tests/integration/test_http_guard.py.
"""

from __future__ import annotations

import ipaddress
import logging

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from deliverers.http_guard import (
    SPECIAL_V4,
    SPECIAL_V6,
    AddressPolicy,
    RedactUrls,
    address_refusal,
    redact_url,
)

REFUSED = {
    # IPv4 special-purpose registry, one address per range, and the cases of the report
    "0.0.0.0": "'this network'",
    "0.1.2.3": "'this network'",
    "10.0.0.1": "private-use",
    "100.64.0.1": "shared address space",
    "100.100.100.200": "shared address space",  # a cloud metadata service
    "100.127.255.254": "shared address space",
    "127.0.0.1": "loopback",
    "127.255.255.254": "loopback",
    "169.254.169.254": "link-local",  # the usual metadata service
    "172.16.0.1": "private-use",
    "172.31.255.255": "private-use",
    "192.0.0.8": "IETF protocol assignments",
    "192.0.0.170": "IETF protocol assignments",
    "192.0.2.1": "documentation",
    "192.31.196.1": "AS112",
    "192.52.193.1": "AMT",
    "192.88.99.1": "6to4 relay",
    "192.168.1.1": "private-use",
    "192.175.48.1": "AS112",
    "198.18.0.1": "benchmarking",
    "198.19.255.255": "benchmarking",
    "198.51.100.7": "documentation",
    "203.0.113.9": "documentation",
    "224.0.0.1": "multicast",
    "239.255.255.250": "multicast",
    "240.0.0.1": "reserved",
    "255.255.255.255": "limited broadcast",
    # IPv6
    "::": "not global unicast",
    "::1": "not global unicast",
    "::127.0.0.1": "not global unicast",  # IPv4-compatible (deprecated)
    "fe80::1": "not global unicast",
    "fc00::1": "not global unicast",
    "fd12:3456::1": "not global unicast",
    "fec0::1": "not global unicast",  # site-local (deprecated)
    "ff02::1": "not global unicast",
    "100::1": "not global unicast",  # discard-only
    "64:ff9b:1::1": "not global unicast",  # local-use NAT64
    "5f00::1": "not global unicast",  # SRv6 SIDs
    "2001::1": "Teredo",
    "2001:0:4136:e378:8000:63bf:3fff:fdd2": "Teredo",
    "2001:2::1": "IETF protocol assignments",  # benchmarking
    "2001:10::1": "IETF protocol assignments",  # ORCHID
    "2001:db8::1": "documentation",
    "3fff::1": "documentation",
    "2002:7f00:1::1": "6to4",  # 6to4 of 127.0.0.1
    "2002:a9fe:a9fe::1": "6to4",  # 6to4 of 169.254.169.254
    "2002:808:808::1": "6to4",  # even of a public address: 6to4 is not called
    "2620:4f:8000::1": "AS112",
    # forms embedding an IPv4 address are judged by it
    "::ffff:127.0.0.1": "embeds 127.0.0.1: loopback",
    "::ffff:169.254.169.254": "embeds 169.254.169.254: link-local",
    "::ffff:100.100.100.200": "embeds 100.100.100.200: shared address space",
    "::ffff:10.0.0.1": "embeds 10.0.0.1: private-use",
    "64:ff9b::7f00:1": "embeds 127.0.0.1: loopback",  # NAT64 of 127.0.0.1
    "64:ff9b::a9fe:a9fe": "embeds 169.254.169.254: link-local",
    "64:ff9b::c0a8:101": "embeds 192.168.1.1: private-use",
}

ALLOWED = [
    "8.8.8.8",
    "1.1.1.1",
    "93.184.216.34",
    "100.63.255.255",  # just below the shared address space
    "100.128.0.0",  # just above it
    "172.32.0.1",
    "192.0.1.1",
    "198.20.0.1",
    "223.255.255.254",
    "2606:4700:4700::1111",
    "2a00:1450:4001:80b::200e",
    "::ffff:8.8.8.8",  # IPv4-mapped public address
    "64:ff9b::808:808",  # NAT64 of 8.8.8.8 (IPv6-only networks with DNS64)
]


@pytest.mark.parametrize("text", sorted(REFUSED))
def test_special_purpose_addresses_are_refused(text: str) -> None:
    refusal = address_refusal(ipaddress.ip_address(text))
    assert refusal is not None and REFUSED[text] in refusal


@pytest.mark.parametrize("text", ALLOWED)
def test_public_addresses_are_allowed(text: str) -> None:
    assert address_refusal(ipaddress.ip_address(text)) is None


@given(st.sampled_from(SPECIAL_V4 + SPECIAL_V6), st.integers(min_value=0))
def test_every_address_of_every_listed_range_is_refused(entry: tuple[str, str], n: int) -> None:
    network = ipaddress.ip_network(entry[0])
    address = network[n % network.num_addresses]
    assert address_refusal(address) is not None, address


@given(st.integers(min_value=0, max_value=2**32 - 1))
def test_no_ipv4_address_python_deems_non_global_is_allowed(n: int) -> None:
    address = ipaddress.IPv4Address(n)
    if not address.is_global or address.is_multicast:
        assert address_refusal(address) is not None, address


@given(st.integers(min_value=0, max_value=2**128 - 1))
def test_no_ipv6_address_python_deems_non_global_is_allowed(n: int) -> None:
    address = ipaddress.IPv6Address(n)
    if address.ipv4_mapped is not None or address in ipaddress.ip_network("64:ff9b::/96"):
        return  # judged by the embedded IPv4 address (above)
    if not address.is_global or address.is_multicast:
        assert address_refusal(address) is not None, address


@given(st.integers(min_value=0, max_value=2**32 - 1))
def test_embedded_ipv4_forms_are_judged_like_the_address_they_embed(n: int) -> None:
    v4 = ipaddress.IPv4Address(n)
    expected = address_refusal(v4) is None
    mapped = ipaddress.IPv6Address(f"::ffff:{v4}")
    nat64 = ipaddress.IPv6Address(int(ipaddress.IPv6Address("64:ff9b::")) | n)
    assert (address_refusal(mapped) is None) is expected
    assert (address_refusal(nat64) is None) is expected


def test_allow_private_lets_named_networks_and_hosts_through() -> None:
    policy = AddressPolicy(None, ["127.0.0.1", "10.0.0.0/8", "sink.internal"])
    loopback = ipaddress.ip_address("127.0.0.1")
    assert policy.refusal("localhost", loopback) is None
    assert policy.refusal("x", ipaddress.ip_address("10.9.8.7")) is None
    assert policy.refusal("SINK.internal", ipaddress.ip_address("192.168.0.1")) is None
    refusal = policy.refusal("x", ipaddress.ip_address("127.0.0.2"))
    assert refusal is not None and "non-public address 127.0.0.2" in refusal
    assert "allow_private" in refusal


def test_allowed_hosts_patterns() -> None:
    policy = AddressPolicy(["api.example.com", "*.hooks.example.org"], [])
    assert policy.host_refusal("API.example.com") is None
    assert policy.host_refusal("a.hooks.example.org") is None
    assert "not in allowed_hosts" in (policy.host_refusal("example.com") or "")
    assert AddressPolicy(None, []).host_refusal("anything") is None


def test_redact_url_hides_userinfo_and_query_values() -> None:
    assert redact_url("https://user:pw@api.example.com:8443/p/a?access_token=abc&x=1#f") == (
        "https://***@api.example.com:8443/p/a?access_token=***&x=***"
    )
    assert redact_url("http://h/p?flag") == "http://h/p?***"
    assert redact_url("http://h/plain") == "http://h/plain"
    assert redact_url(httpx.URL("http://t0ken@h/")) == "http://***@h/"


def test_the_log_filter_redacts_url_arguments(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("test.redaction")
    logger.addFilter(RedactUrls())
    try:
        with caplog.at_level(logging.INFO, logger="test.redaction"):
            logger.info(
                "HTTP Request: %s %s %d", "POST", httpx.URL("http://u:p@h/x?key=s3cret"), 200
            )
    finally:
        logger.filters.clear()
    assert caplog.messages == ["HTTP Request: POST http://***@h/x?key=*** 200"]
