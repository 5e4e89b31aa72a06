"""Which claim statement a partition gets: the plain one while one lane holds its rows.

A lane is a (priority, fairness key) pair. While one lane holds a partition's
ready rows (no priorities or fairness keys in use, or only one of each), a
claim is the plain statement it always was. When more do, the plain
statement takes nothing and says so, the claim is made again at once with the
lanes statement, and the partition keeps getting that one while several lanes
hold rows (every claim reports it). So the extra work of sharing a batch
between lanes is paid only while there is something to share, and the switch
costs one extra statement, once. See :func:`outbox.storage.sql.queue.claim`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

from outbox.storage.sql import queue

__all__ = ["ClaimMode"]


class ClaimMode:
    """Per partition: plain or lanes claim; both clients' stores keep one."""

    def __init__(self) -> None:
        self._lanes: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
        self._lock = threading.Lock()

    @staticmethod
    def _key(
        spec: queue.QueueSpec, partition: Mapping[str, str]
    ) -> tuple[str, tuple[tuple[str, str], ...]]:
        return spec.table.name, tuple(sorted(partition.items()))

    def statement(
        self, spec: queue.QueueSpec, partition: Mapping[str, str], *, rated: bool
    ) -> tuple[Any, bool]:
        """The claim statement for this partition now, and whether it is the lanes one."""
        with self._lock:
            lanes = self._key(spec, partition) in self._lanes
        return queue.claim(spec, rated=rated, lanes=lanes), lanes

    def claimed(
        self,
        spec: queue.QueueSpec,
        partition: Mapping[str, str],
        lanes: bool,
        rows: Iterable[Any],
    ) -> tuple[list[Any], bool]:
        """The claimed rows (mappings), and True when the claim must be made again with lanes."""
        claimed: list[Any] = []
        multi = False
        for row in rows:
            multi = bool(row["multi_lane"])
            if row["id"] is not None:
                claimed.append(row)
        key = self._key(spec, partition)
        with self._lock:
            if multi:
                self._lanes.add(key)
            else:
                self._lanes.discard(key)
        return claimed, multi and not lanes
