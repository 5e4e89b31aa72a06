"""Idempotency keys: stable, collision-free, assigned once when an intent is written."""

from __future__ import annotations

import hashlib
from uuid import UUID

__all__ = ["compensation_key", "derive_key"]


def _length_prefixed(*parts: str) -> str:
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode()
        # The length prefix keeps ("a", "bc") and ("ab", "c") apart.
        digest.update(len(data).to_bytes(8, "big"))
        digest.update(data)
    return digest.hexdigest()


def derive_key(run_id: UUID | str, step_id: str, index: int) -> str:
    """Default key of the ``index``-th intent of step ``step_id`` in run ``run_id``.

    Hex sha256 over the length-prefixed triple. The same triple always gives the
    same key, so a replayed step re-derives the key it used the first time.
    """
    return _length_prefixed(str(run_id), step_id, str(index))


def compensation_key(original_key: str) -> str:
    """Key of the effect that compensates (undoes) the effect with ``original_key``."""
    return _length_prefixed("compensate", original_key)
