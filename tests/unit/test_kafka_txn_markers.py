"""The transactional read-back's verdict from records and markers (no broker: pure functions)."""

from __future__ import annotations

import pytest

from deliverers.kafka_txn import (
    Marker,
    RawRecord,
    TransactionUndecided,
    committed_records,
    find_committed,
)
from outbox.delivery import NotApplied, Succeeded

NOTE = {"topic": "t", "partition": 0, "offset": 0}


def rec(offset: int, producer: int, key: str, *, transactional: bool = True) -> RawRecord:
    return RawRecord(offset, producer, transactional, (("idempotency-key", key.encode()),), b"v")


def test_only_records_followed_by_their_producers_commit_are_visible() -> None:
    items: list[RawRecord | Marker] = [
        rec(0, 1, "a"),
        rec(1, 2, "b"),  # producer 2's transaction is aborted below
        Marker(2, 1, commit=True),
        Marker(3, 2, commit=False),
        rec(4, 3, "c", transactional=False),
    ]
    visible, open_left = committed_records(iter(items))
    assert [r.offset for r in visible] == [0, 4]
    assert open_left is False


def test_a_committed_record_with_the_key_is_found_with_its_offset() -> None:
    items: list[RawRecord | Marker] = [
        rec(5, 1, "b"),
        Marker(6, 1, commit=False),
        rec(7, 2, "b"),
        Marker(8, 2, commit=True),
    ]
    found = find_committed(iter(items), "b", "idempotency-key", NOTE)
    assert isinstance(found, Succeeded)
    assert found.result == {"topic": "t", "partition": 0, "offset": 7, "looked_up": True}


def test_an_aborted_record_with_the_key_is_not_applied() -> None:
    items: list[RawRecord | Marker] = [rec(0, 1, "k"), Marker(1, 1, commit=False)]
    assert isinstance(find_committed(iter(items), "k", "idempotency-key", NOTE), NotApplied)


def test_an_open_transaction_leaves_the_lookup_undecided() -> None:
    items: list[RawRecord | Marker] = [
        rec(0, 1, "other"),
        Marker(1, 1, commit=True),
        rec(2, 4, "k"),
    ]
    with pytest.raises(TransactionUndecided):
        find_committed(iter(items), "k", "idempotency-key", NOTE)
