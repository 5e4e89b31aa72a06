"""Where an HTTP deliverer may connect: resolve once, check, connect to exactly what was checked.

A payload names the URL an ``http.request`` effect calls, so without a guard an
intent could make the deliverer reach the cloud metadata service, a database
on the private network, or the deliverer's own loopback (SSRF). The guard sits
in the connection itself (an httpcore network backend), so it applies to every
connection the client opens, whatever opened it: the first request, a lookup,
each hop of a followed redirect.

- The host name is resolved **once**, every address it resolves to is
  checked, and the socket connects to a checked address (the name still goes
  in the ``Host`` header and in TLS: SNI and certificate verification are for
  the name). There is no second lookup for a rebinding resolver to answer
  differently.
- A name that cannot be resolved is not connected to (fail closed); the
  attempt is retried as "not sent".
- Refused (see :func:`address_refusal`): every range of IANA's IPv4 and IPv6
  special-purpose address registries (private, loopback, link-local, shared
  address space 100.64.0.0/10, benchmarking, documentation, protocol
  assignments, 6to4, Teredo, ...), multicast, the reserved 240.0.0.0/4, and
  any IPv6 address outside global unicast (2000::/3). An IPv4-mapped
  (``::ffff:a.b.c.d``) or NAT64 (``64:ff9b::a.b.c.d``) address is judged by
  the IPv4 address it embeds. When a name resolves to several addresses, one
  refused address refuses the name.
- ``allow_private`` (networks, or host names whose addresses are all allowed)
  and ``allowed_hosts`` (name patterns) are checked here too, per connection.
- Environment proxies are not used: through a proxy the deliverer would not
  know which address it reaches.

:func:`redact_url` and :class:`RedactUrls` keep URL query strings and
userinfo (where tokens hide) out of log lines.
"""

from __future__ import annotations

import asyncio
import fnmatch
import ipaddress
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpcore
import httpx

__all__ = [
    "AddressPolicy",
    "AddressRefused",
    "GuardedTransport",
    "RedactUrls",
    "Resolver",
    "address_refusal",
    "redact_url",
    "system_resolver",
]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# IANA IPv4 Special-Purpose Address Registry (and multicast, which has its own).
SPECIAL_V4: tuple[tuple[str, str], ...] = (
    ("0.0.0.0/8", "'this network'"),
    ("10.0.0.0/8", "private-use"),
    ("100.64.0.0/10", "shared address space (carrier-grade NAT)"),
    ("127.0.0.0/8", "loopback"),
    ("169.254.0.0/16", "link-local"),
    ("172.16.0.0/12", "private-use"),
    ("192.0.0.0/24", "IETF protocol assignments"),
    ("192.0.2.0/24", "documentation (TEST-NET-1)"),
    ("192.31.196.0/24", "AS112-v4"),
    ("192.52.193.0/24", "AMT"),
    ("192.88.99.0/24", "deprecated 6to4 relay anycast"),
    ("192.168.0.0/16", "private-use"),
    ("192.175.48.0/24", "direct delegation AS112 service"),
    ("198.18.0.0/15", "benchmarking"),
    ("198.51.100.0/24", "documentation (TEST-NET-2)"),
    ("203.0.113.0/24", "documentation (TEST-NET-3)"),
    ("224.0.0.0/4", "multicast"),
    ("255.255.255.255/32", "limited broadcast"),
    ("240.0.0.0/4", "reserved"),
)
# IANA IPv6 Special-Purpose Address Registry, within global unicast (2000::/3);
# everything outside 2000::/3 is refused anyway (loopback, unspecified, ULA,
# link-local, multicast, discard-only, the IPv4-compatible and -mapped forms).
SPECIAL_V6: tuple[tuple[str, str], ...] = (
    ("2001::/32", "Teredo"),
    ("2001::/23", "IETF protocol assignments"),
    ("2001:db8::/32", "documentation"),
    ("2002::/16", "6to4"),
    ("2620:4f:8000::/48", "direct delegation AS112 service"),
    ("3fff::/20", "documentation"),
)
GLOBAL_UNICAST_V6 = ipaddress.IPv6Network("2000::/3")
NAT64_V6 = ipaddress.IPv6Network("64:ff9b::/96")

_V4 = tuple((ipaddress.IPv4Network(net), f"{name} ({net})") for net, name in SPECIAL_V4)
_V6 = tuple((ipaddress.IPv6Network(net), f"{name} ({net})") for net, name in SPECIAL_V6)


def address_refusal(address: IPAddress) -> str | None:
    """Why ``address`` may not be called (the range it is in), or None for a public address."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped
        if embedded is None and address in NAT64_V6:
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is not None:
            inner = address_refusal(embedded)
            return None if inner is None else f"embeds {embedded}: {inner}"
        if address not in GLOBAL_UNICAST_V6:
            return "not global unicast (outside 2000::/3)"
        for network6, name in _V6:
            if address in network6:
                return name
        return None
    for network4, name in _V4:
        if address in network4:
            return name
    return None


class AddressRefused(Exception):
    """A connection the policy does not allow; nothing was sent."""


def redact_url(url: Any) -> str:
    """``url`` without userinfo and with the query string's values hidden (for logs)."""
    text = str(url)
    try:
        parts = urlsplit(text)
    except ValueError:
        return "<unparsable URL>"
    netloc = parts.netloc.rpartition("@")[2]
    if parts.username is not None or parts.password is not None:
        netloc = "***@" + netloc
    query = "&".join(
        f"{pair.partition('=')[0]}=***" if "=" in pair else "***"
        for pair in parts.query.split("&")
        if pair
    )
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


class RedactUrls(logging.Filter):
    """Rewrites URL arguments of log records (httpx logs every request's URL at INFO)."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Redact, never drop."""
        if isinstance(record.args, tuple) and record.args:
            record.args = tuple(
                redact_url(arg) if isinstance(arg, httpx.URL) or _looks_like_url(arg) else arg
                for arg in record.args
            )
        return True


def _looks_like_url(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(("http://", "https://"))


def install_log_redaction(names: Iterable[str] = ("httpx", "httpcore")) -> None:
    """Put one :class:`RedactUrls` on each named logger (idempotent)."""
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactUrls) for f in logger.filters):
            logger.addFilter(RedactUrls())


#: ``await resolver(host, port)`` -> the addresses ``host`` resolves to, as text.
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]


async def system_resolver(host: str, port: int) -> list[str]:
    """The operating system's answer (``getaddrinfo``), once."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    seen: list[str] = []
    for info in infos:
        address = str(info[4][0])
        if address not in seen:
            seen.append(address)
    return seen


class AddressPolicy:
    """``allowed_hosts`` patterns, and the networks and names ``allow_private`` lets through."""

    def __init__(self, allowed_hosts: Sequence[str] | None, allow_private: Sequence[str]) -> None:
        self.allowed_hosts = None if allowed_hosts is None else [p.lower() for p in allowed_hosts]
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        self.private_names: set[str] = set()
        for entry in allow_private:
            try:
                self.networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                self.private_names.add(entry.lower())

    def host_refusal(self, host: str) -> str | None:
        """Why ``host`` may not be called by name (``allowed_hosts``), or None."""
        host = host.lower()
        if self.allowed_hosts is not None and not any(
            fnmatch.fnmatch(host, pattern) for pattern in self.allowed_hosts
        ):
            return f"url host {host!r} is not in allowed_hosts"
        return None

    def refusal(self, host: str, address: IPAddress) -> str | None:
        """Why ``host`` resolving to ``address`` may not be called, or None."""
        if host.lower() in self.private_names:
            return None
        if any(address in network for network in self.networks):
            return None
        why = address_refusal(address)
        if why is None:
            return None
        return (
            f"url host {host!r} resolves to non-public address {address} ({why}); "
            "allow it with allow_private in the deliverer config"
        )


class GuardedBackend(httpcore.AsyncNetworkBackend):
    """Opens TCP connections only to addresses the policy allows, resolving each name once."""

    def __init__(
        self,
        policy: AddressPolicy,
        resolver: Resolver = system_resolver,
        inner: httpcore.AsyncNetworkBackend | None = None,
    ) -> None:
        self.policy = policy
        self.resolver = resolver
        self.inner = inner or httpcore.AnyIOBackend()

    async def checked_addresses(self, host: str, port: int) -> list[str]:
        """Every address ``host`` resolves to, all allowed; raises when one is not."""
        refusal = self.policy.host_refusal(host)
        if refusal is not None:
            raise AddressRefused(refusal)
        try:
            ipaddress.ip_address(host.partition("%")[0])
        except ValueError:
            pass
        else:  # an address literal: nothing to resolve
            literal = self.policy.refusal(host, ipaddress.ip_address(host.partition("%")[0]))
            if literal is not None:
                raise AddressRefused(literal)
            return [host]
        try:
            answers = list(await self.resolver(host, port))
        except (OSError, UnicodeError) as exc:
            # Fail closed: no address was checked, so none is connected to.
            raise httpcore.ConnectError(f"could not resolve {host!r}: {exc}") from exc
        if not answers:
            raise httpcore.ConnectError(f"could not resolve {host!r}: no address")
        addresses = []
        for answer in answers:
            try:
                address = ipaddress.ip_address(answer.partition("%")[0])
            except ValueError as exc:
                raise AddressRefused(f"url host {host!r} resolved to {answer!r}") from exc
            refusal = self.policy.refusal(host, address)
            if refusal is not None:
                raise AddressRefused(refusal)
            addresses.append(answer)  # as answered: an IPv6 scope stays on
        return addresses

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        """Resolve ``host`` once, check, and connect to the first checked address that answers."""
        last: Exception | None = None
        for address in await self.checked_addresses(host, port):
            try:
                return await self.inner.connect_tcp(
                    address,
                    port,
                    timeout=timeout,
                    local_address=local_address,
                    socket_options=socket_options,
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                last = exc
        assert last is not None
        raise last

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        """Never: a payload's URL does not name a socket file."""
        raise AddressRefused("unix sockets are not called")

    async def sleep(self, seconds: float) -> None:
        """As the inner backend sleeps."""
        await self.inner.sleep(seconds)


class GuardedTransport(httpx.AsyncHTTPTransport):
    """httpx's own transport, connecting through a :class:`GuardedBackend`.

    httpx takes no network backend, so its connection pool is replaced by one
    built the same way with ours (``tests/integration/test_http_guard.py``
    proves every connection passes the guard, so a change in httpx shows there).
    """

    def __init__(
        self,
        policy: AddressPolicy,
        *,
        resolver: Resolver = system_resolver,
        limits: httpx.Limits,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        context = ssl_context or httpx.create_ssl_context()
        super().__init__(verify=context, limits=limits)
        self.backend = GuardedBackend(policy, resolver)
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=context,
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=self.backend,
        )
