"""Time-ordered ids (UUID version 7, RFC 9562) for runs, effects and signals.

A random (version 4) primary key lands on a random index page at every
insert; a time-ordered one lands on the rightmost page, which is already in
memory. Python 3.11 has no ``uuid.uuid7``, hence these few lines.
"""

from __future__ import annotations

import os
import time
import uuid

__all__ = ["uuid7"]


def uuid7() -> uuid.UUID:
    """48 bits of Unix milliseconds, the version and variant bits, 74 random bits."""
    value = (time.time_ns() // 1_000_000) << 80 | int.from_bytes(os.urandom(10), "big")
    value = (value & ~(0xF << 76)) | (0x7 << 76)  # version 7
    value = (value & ~(0x3 << 62)) | (0x2 << 62)  # RFC 4122 variant
    return uuid.UUID(int=value)
