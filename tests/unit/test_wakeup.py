"""The NOTIFY throttle: a leading NOTIFY inline, then at most one trailing one per window."""

from __future__ import annotations

import threading
import time

from outbox.storage.notify import WakeupThrottle


class Recorder:
    def __init__(self) -> None:
        self.times: list[float] = []
        self.event = threading.Event()

    def __call__(self) -> None:
        self.times.append(time.monotonic())
        self.event.set()


def test_first_commit_notifies_inline_and_the_next_within_the_window_does_not() -> None:
    sent = Recorder()
    throttle = WakeupThrottle(sent, window_s=10)
    assert throttle.inline() is not None
    assert throttle.inline() is None
    throttle.close()


def test_a_suppressed_commit_is_followed_by_one_trailing_notify_after_it() -> None:
    sent = Recorder()
    throttle = WakeupThrottle(sent, window_s=0.5)
    token = throttle.inline()
    assert token is not None
    throttle.committed(token)
    skipped = [throttle.inline() for _ in range(20)]
    assert skipped == [None] * 20
    committed_at = time.monotonic()
    for skip in skipped:
        throttle.committed(skip)
    assert sent.event.wait(5)
    time.sleep(0.6)  # a second trailing NOTIFY, were one owed, would come within a window
    throttle.close()
    assert len(sent.times) == 1, "twenty suppressed commits cost one trailing NOTIFY"
    assert sent.times[0] >= committed_at


def test_commits_outside_the_window_all_notify_inline() -> None:
    sent = Recorder()
    throttle = WakeupThrottle(sent, window_s=0.0)
    assert all(throttle.inline() is not None for _ in range(5))
    throttle.close()
    assert sent.times == []


def test_close_sends_what_is_owed() -> None:
    sent = Recorder()
    throttle = WakeupThrottle(sent, window_s=0.2)
    throttle.inline()
    throttle.committed(throttle.inline())
    throttle.close()
    assert len(sent.times) == 1


def test_a_later_commit_with_its_own_notify_pays_the_debt() -> None:
    sent = Recorder()
    # Timings are in windows with a quarter window of slack on each side, so a
    # loaded machine's late wake-ups do not change the story.
    throttle = WakeupThrottle(sent, window_s=1.0)
    throttle.committed(throttle.inline())  # leading edge at 0, paid by itself
    time.sleep(0.5)
    throttle.committed(throttle.inline())  # suppressed at 0.5: owes one, due at 1.5
    time.sleep(0.75)
    later = throttle.inline()  # at 1.25 the window since the last NOTIFY passed; debt not due

    assert later is not None
    throttle.committed(later)
    time.sleep(1.0)  # past 1.5, when the debt would have been sent
    throttle.close()
    assert sent.times == [], "no extra transaction for a steady writer"


def test_a_notify_that_started_before_the_owing_commit_finished_does_not_pay() -> None:
    sent = Recorder()
    throttle = WakeupThrottle(sent, window_s=0.05)
    early = throttle.inline()  # decided (and maybe committed) before the owing commit ended
    time.sleep(0.06)
    throttle.inline()
    throttle.committed(None)  # owing commit finishes now
    throttle.committed(early)
    assert sent.event.wait(2), "the trailing NOTIFY still goes out"
    throttle.close()


def test_the_trailing_thread_is_woken_once_per_debt_not_once_per_commit() -> None:
    """A writer's every commit waking the thread cost it a thread switch per step."""
    sent = Recorder()
    throttle = WakeupThrottle(sent, window_s=0.5)
    throttle.committed(throttle.inline())
    wakes = 0
    notify = throttle._wake.notify

    def counted(n: int = 1) -> None:
        nonlocal wakes
        wakes += 1
        notify(n)

    throttle._wake.notify = counted  # type: ignore[method-assign]
    for _ in range(20):
        throttle.committed(throttle.inline())
    assert wakes == 1, "twenty owed commits, one debt: one wake-up"
    assert sent.event.wait(5)
    throttle.close()
    assert len(sent.times) == 1


def test_a_notify_commit_under_way_at_the_deadline_pays_the_debt_when_it_ends() -> None:
    sent = Recorder()
    throttle = WakeupThrottle(sent, window_s=1.0)
    throttle.committed(throttle.inline())  # leading edge at 0
    time.sleep(0.5)
    throttle.committed(throttle.inline())  # suppressed at 0.5: owes one, due at 1.5
    time.sleep(0.75)
    paying = throttle.inline()  # at 1.25: this commit will carry a NOTIFY...
    assert paying is not None
    time.sleep(0.5)  # ...but it ends at 1.75, after the debt fell due
    throttle.committed(paying)
    time.sleep(1.0)  # past 2.5, the latest the trailing NOTIFY could have waited
    throttle.close()
    assert sent.times == [], "a steady writer whose commit ended late paid its own debt"


def test_a_notify_commit_that_never_ends_delays_the_trailing_notify_one_window_at_most() -> None:
    sent = Recorder()
    throttle = WakeupThrottle(sent, window_s=1.0)
    throttle.committed(throttle.inline())
    time.sleep(0.25)
    owed_at = time.monotonic()
    throttle.committed(throttle.inline())  # owes one, due one window later
    time.sleep(0.75)
    assert throttle.inline() is not None  # a NOTIFY commit that then fails: never committed
    assert sent.event.wait(5)
    throttle.close()
    assert len(sent.times) == 1
    assert owed_at + 1.0 <= sent.times[0] <= owed_at + 2.5, sent.times[0] - owed_at
