"""Which host names ``outbox serve`` answers to, and what counts as its own origin.

A browser sends whatever ``Host`` the page's URL names. Under DNS rebinding a
page on ``rebind.example`` makes that name resolve to 127.0.0.1, and its
scripts then read the console with ``Host: rebind.example`` as if they were the
console's own. So the server answers only the names it was told are its own
(:class:`HostAllowList`), and the console's CSRF check takes "own origin" from
that list, never from the ``Host`` header a request brings.

An entry is a host name (``console.example.com``), an IP address (``10.0.0.5``,
``::1``), or a name with a leading dot (``.example.com``), which allows that
name and every name under it. Names are compared without case, without a
trailing dot and without the port. With no list, the default is the address the
server is bound to (unless it is a wildcard such as ``0.0.0.0``) and the
loopback names (``localhost``, ``127.0.0.1``, ``::1``).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from urllib.parse import urlsplit

__all__ = ["LOOPBACK_NAMES", "HostAllowList", "host_entry_problem", "split_host"]

#: Always allowed when no list is given.
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
_WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::", "[::]"})
# A DNS name (labels of letters, digits, hyphens and underscores), without the port.
_LABEL = r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?"
_NAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*$")
_PORT = re.compile(r"^[0-9]{1,5}$")


def _ip(text: str) -> str | None:
    try:
        return ipaddress.ip_address(text).compressed
    except ValueError:
        return None


def _normal(name: str) -> str | None:
    """A host name or address in one spelling (lower case, no trailing dot), or None."""
    name = name.strip().lower().removesuffix(".")
    if name.startswith("[") and name.endswith("]"):
        return _ip(name[1:-1])
    address = _ip(name)
    if address is not None:
        return address
    return name if _NAME.match(name) else None


def split_host(header: str) -> tuple[str, int | None] | None:
    """``Host`` header value → (normalised name, port or None), or None when malformed."""
    header = header.strip()
    if not header:
        return None
    if header.startswith("["):
        end = header.find("]")
        if end < 0:
            return None
        name, rest = header[: end + 1], header[end + 1 :]
        if rest and not rest.startswith(":"):
            return None
        port_text = rest[1:] if rest else None
    elif header.count(":") == 1:
        name, port_text = header.split(":")
    else:
        name, port_text = header, None
    normal = _normal(name)
    if normal is None:
        return None
    if port_text is None:
        return normal, None
    if not _PORT.match(port_text) or int(port_text) > 65535:
        return None
    return normal, int(port_text)


def host_entry_problem(entry: str) -> str | None:
    """Why ``entry`` cannot be an allowed host, or None when it can."""
    if not entry or entry != entry.strip():
        return "is empty or has spaces around it"
    if "://" in entry or "/" in entry:
        return "is a URL: give the host name alone (console.example.com)"
    if "*" in entry:
        return "holds a '*': name the hosts, or a domain with a leading dot (.example.com)"
    body = entry[1:] if entry.startswith(".") else entry
    if _normal(body) is None:
        return "is not a host name or an IP address (no port)"
    return None


class HostAllowList:
    """The host names one server answers to."""

    def __init__(self, entries: Iterable[str] | None, bound: str) -> None:
        if entries is None:
            own = _normal(bound) if bound not in _WILDCARD_BINDS else None
            entries = [*LOOPBACK_NAMES, *([own] if own else [])]
        exact: set[str] = set()
        domains: list[str] = []
        for entry in entries:
            if entry.startswith("."):
                domain = _normal(entry[1:])
                if domain is not None:
                    domains.append(domain)
                    exact.add(domain)
            else:
                normal = _normal(entry)
                if normal is not None:
                    exact.add(normal)
        self.exact = frozenset(exact)
        self.domains = tuple(domains)

    def allows(self, name: str) -> bool:
        """Whether the (normalised) host name is one of this server's."""
        return name in self.exact or any(name.endswith("." + d) for d in self.domains)

    def check(self, header: str | None) -> tuple[str, int | None] | None:
        """The request's (name, port) when its ``Host`` is allowed, else None."""
        if header is None:
            return None
        found = split_host(header)
        if found is None or not self.allows(found[0]):
            return None
        return found

    def is_own_origin(self, origin: str, scheme: str, port: int | None) -> bool:
        """Whether ``Origin`` is this server's own: an allowed name, on this scheme and port.

        ``scheme`` and ``port`` are those the request arrived on (the port of
        its already allowed ``Host``, or the scheme's default).
        """
        try:
            parts = urlsplit(origin)
            origin_port = parts.port
        except ValueError:
            return False
        if parts.scheme not in ("http", "https") or parts.scheme != scheme:
            return False
        if parts.path or parts.query or parts.fragment or parts.username or parts.password:
            return False
        name = _normal(parts.hostname or "")
        if name is None or not self.allows(name):
            return False
        default = 443 if scheme == "https" else 80
        return (origin_port or default) == (port or default)
