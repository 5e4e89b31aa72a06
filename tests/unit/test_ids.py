from __future__ import annotations

import time

from outbox.ids import uuid7


def test_uuid7_has_version_7_and_the_rfc_variant() -> None:
    value = uuid7()
    assert value.version == 7
    assert value.variant == "specified in RFC 4122"


def test_uuid7_orders_by_time_and_does_not_repeat() -> None:
    first = uuid7()
    time.sleep(0.002)
    later = [uuid7() for _ in range(1000)]
    assert all(first < v for v in later)
    assert len(set(later)) == 1000
    millis = later[0].int >> 80
    assert abs(millis - time.time_ns() // 1_000_000) < 5000
