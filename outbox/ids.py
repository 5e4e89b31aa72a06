"""Ids: time-ordered UUIDs (version 7, RFC 9562) for rows, and lease owner names for processes.

A random (version 4) primary key lands on a random index page at every
insert; a time-ordered one lands on the rightmost page, which is already in
memory. Python 3.11 has no ``uuid.uuid7``, hence these few lines.
"""

from __future__ import annotations

import os
import socket
import time
import uuid

__all__ = ["RELAY_OWNER_PREFIX", "default_owner", "uuid7"]

#: Lease owners of Kafka relays start with this: a stream deliverer may take an
#: effect from a relay (the record it read proves the publish landed), never
#: from another deliverer.
RELAY_OWNER_PREFIX = "relay:"


def uuid7() -> uuid.UUID:
    """48 bits of Unix milliseconds, the version and variant bits, 74 random bits."""
    value = (time.time_ns() // 1_000_000) << 80 | int.from_bytes(os.urandom(10), "big")
    value = (value & ~(0xF << 76)) | (0x7 << 76)  # version 7
    value = (value & ~(0x3 << 62)) | (0x2 << 62)  # RFC 4122 variant
    return uuid.UUID(int=value)


def default_owner() -> str:
    """A lease owner name unique to this process: host, pid and a random suffix."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
