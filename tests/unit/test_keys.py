from __future__ import annotations

import uuid

from hypothesis import given
from hypothesis import strategies as st

from outbox.keys import compensation_key, derive_key


def test_key_is_deterministic_hex_sha256() -> None:
    run_id = uuid.UUID("12345678-1234-5678-1234-567812345678")
    key = derive_key(run_id, "send-summary", 0)
    assert key == derive_key(str(run_id), "send-summary", 0)
    assert len(key) == 64 and int(key, 16) >= 0


def test_length_prefix_keeps_split_points_apart() -> None:
    assert derive_key("a", "bc", 0) != derive_key("ab", "c", 0)
    assert derive_key("r", "s1", 0) != derive_key("r", "s", 10)


def test_every_part_matters() -> None:
    keys = {
        derive_key("r", "s", 0),
        derive_key("r2", "s", 0),
        derive_key("r", "s2", 0),
        derive_key("r", "s", 1),
    }
    assert len(keys) == 4


def test_compensation_key_differs_from_original_and_is_stable() -> None:
    original = derive_key("r", "s", 0)
    assert compensation_key(original) == compensation_key(original)
    assert compensation_key(original) != original


@given(
    st.tuples(st.text(), st.text(), st.integers(0, 10**6)),
    st.tuples(st.text(), st.text(), st.integers(0, 10**6)),
)
def test_distinct_triples_give_distinct_keys(
    a: tuple[str, str, int], b: tuple[str, str, int]
) -> None:
    if a != b:
        assert derive_key(*a) != derive_key(*b)
