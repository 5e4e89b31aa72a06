"""The invariant checker is itself tested: each violation, made by hand, is detected.

Pure inputs (one test per violation, and a clean history with every legitimate
twist: retries, a reconciled expiry, stale late answers, ``unknown``). The real
loaders are tested in ``tests/integration/test_invariant_loaders.py``.
"""

from __future__ import annotations

import pytest

from outbox.check.invariants import Applied, AttemptRecord, Intent, check


def intent(
    n: int, status: str = "succeeded", attempt: int = 1, kind: str = "http.request"
) -> Intent:
    return Intent(f"e{n}", f"k{n}", kind, status, attempt, f"op{n}")


def log(*entries: tuple[str, int, str]) -> list[AttemptRecord]:
    return [
        AttemptRecord(seq, effect_id, attempt, outcome)
        for seq, (effect_id, attempt, outcome) in enumerate(entries, start=1)
    ]


def applied(*ns: int) -> list[Applied]:
    return [Applied(f"k{n}", f"op{n}") for n in ns]


def test_a_clean_history_with_every_legitimate_twist_has_no_violation() -> None:
    intents = [
        intent(1),  # plain success
        intent(2, attempt=3),  # retry, expired (reconciled), success; a stale late answer
        intent(3, "unknown", kind="http.blind"),  # visible, for an operator: not a violation
        intent(4, "failed", attempt=2),  # gave up: terminal, never applied
    ]
    attempts = log(
        ("e1", 1, "succeeded"),
        ("e2", 1, "retry"),
        ("e2", 2, "expired"),
        ("e2", 3, "succeeded"),
        ("e2", 2, "stale"),
        ("e3", 1, "expired"),
        ("e4", 1, "retry"),
        ("e4", 2, "failed"),
    )
    report = check(
        intents, attempts, applied(1, 2), expected_operations=["op1", "op2", "op3", "op4"]
    )
    assert report.counts() == dict.fromkeys(report.VIOLATIONS, 0), report.summary()
    assert report.clean and report.stale == 1
    assert report.statuses == {"succeeded": 2, "unknown": 1, "failed": 1}
    report.assert_clean()


@pytest.mark.parametrize("status", ["pending", "in_flight", "dispatched"])
def test_an_open_intent_is_lost(status: str) -> None:
    report = check([intent(1), intent(2, status)], log(("e1", 1, "succeeded")), applied(1))
    assert report.counts()["lost"] == 1 and "e2" in report.lost[0]
    with pytest.raises(AssertionError, match="lost"):
        report.assert_clean()


def test_a_committed_operation_without_an_intent_is_lost() -> None:
    report = check(
        [intent(1)], log(("e1", 1, "succeeded")), applied(1), expected_operations=["op1", "op9"]
    )
    assert report.lost == ["operation op9: no intent"]


def test_a_key_applied_twice_is_a_duplicate() -> None:
    report = check([intent(1)], log(("e1", 1, "succeeded")), applied(1, 1))
    assert report.duplicate_keys == ["k1"] and report.duplicate_operations == ["op1"]


def test_one_operation_under_two_keys_is_a_duplicate() -> None:
    twins = [Intent("e1", "k1", "http.request", "succeeded", 1, "op1")]
    twins.append(Intent("e2", "k2", "http.request", "succeeded", 1, "op1"))
    report = check(
        twins,
        log(("e1", 1, "succeeded"), ("e2", 1, "succeeded")),
        [Applied("k1", "op1"), Applied("k2", "op1")],
    )
    assert report.duplicate_keys == []
    assert report.duplicate_operations == ["op1"]
    assert report.duplicate_intents == ["op1"]


def test_applied_with_no_intent_is_a_phantom() -> None:
    report = check(
        [intent(1)],
        log(("e1", 1, "succeeded")),
        [
            *applied(1),
            Applied("k-nobody", "op-x"),  # a key no intent has
            Applied(None, "op-y"),  # no key at all
            Applied("k1", "op-z"),  # an intent's key with another operation
            Applied("k1", None),  # an intent's key with a body that is not its intent's
        ],
    )
    assert report.counts()["phantoms"] == 4, report.phantoms


def test_a_success_followed_by_a_non_stale_change_is_a_regression() -> None:
    report = check(
        [intent(1, attempt=2)],
        log(("e1", 1, "succeeded"), ("e1", 2, "succeeded")),
        applied(1),
    )
    assert report.counts()["regressed"] == 1
    assert "then succeeded@2" in report.regressed[0]


def test_a_success_then_an_expiry_is_a_regression_even_if_it_ends_succeeded() -> None:
    report = check([intent(1)], log(("e1", 1, "succeeded"), ("e1", 1, "expired")), applied(1))
    assert report.counts()["regressed"] == 1


def test_a_logged_success_whose_row_moved_back_is_a_regression() -> None:
    report = check([intent(1, "failed")], log(("e1", 1, "succeeded")), applied(1))
    assert report.counts()["regressed"] == 1 and "now failed" in report.regressed[0]


def test_succeeded_but_never_applied_at_the_sink_is_a_regression() -> None:
    report = check([intent(1)], log(("e1", 1, "succeeded")), [])
    assert report.counts()["regressed"] == 1 and "never applied" in report.regressed[0]
    other_sink = check([intent(1)], log(("e1", 1, "succeeded")), [], sink_kinds=["other"])
    assert other_sink.clean


def test_succeeded_with_nothing_in_the_attempt_log_is_a_regression() -> None:
    report = check([intent(1)], [], applied(1))
    assert report.counts()["regressed"] == 1


def test_lookup_and_operator_successes_count_as_successes() -> None:
    looked = AttemptRecord(1, "e1", 1, "looked_up", detail={"lookup": "applied"})
    resolved = AttemptRecord(2, "e2", 1, "resolved", detail={"as": "succeeded"})
    report = check([intent(1), intent(2)], [looked, resolved], applied(1, 2))
    assert report.clean, report.summary()
    later = AttemptRecord(3, "e1", 2, "retry")
    assert check([intent(1)], [looked, later], applied(1)).counts()["regressed"] == 1
