"""The NOTIFY throttle: a leading NOTIFY inline, then at most one trailing one per window."""

from __future__ import annotations

import threading
import time

from outbox.wakeup import WakeupThrottle


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
    assert throttle.inline() is True
    assert throttle.inline() is False
    throttle.close()


def test_a_suppressed_commit_is_followed_by_one_trailing_notify_after_it() -> None:
    sent = Recorder()
    throttle = WakeupThrottle(sent, window_s=0.05)
    assert throttle.inline()
    throttle.committed(True)
    skipped = [throttle.inline() for _ in range(20)]
    assert not any(skipped)
    committed_at = time.monotonic()
    for _ in skipped:
        throttle.committed(False)
    assert sent.event.wait(5)
    time.sleep(0.15)
    throttle.close()
    assert len(sent.times) == 1, "twenty suppressed commits cost one trailing NOTIFY"
    assert sent.times[0] >= committed_at


def test_commits_outside_the_window_all_notify_inline() -> None:
    sent = Recorder()
    throttle = WakeupThrottle(sent, window_s=0.0)
    assert all(throttle.inline() for _ in range(5))
    throttle.close()
    assert sent.times == []


def test_close_sends_what_is_owed() -> None:
    sent = Recorder()
    throttle = WakeupThrottle(sent, window_s=0.2)
    throttle.inline()
    throttle.inline()
    throttle.committed(False)
    throttle.close()
    assert len(sent.times) == 1
