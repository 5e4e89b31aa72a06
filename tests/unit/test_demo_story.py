"""The demo's deliverer kill: a kill that left nothing to recover does not count.

The demo's sink answers in 30 ms, so a deliverer seen holding calls may have
recorded them all by the time its SIGKILL lands: the demo then showed no
recovery (``attempts_recovered_after_crash == 0``, an intermittent failure of
``test_outbox_demo_on_a_fresh_home`` on a loaded machine). Expected: the
story counts the dead deliverer's calls again once it can change nothing, and
if there are none it kills the next deliverer seen holding calls.
"""

from __future__ import annotations

import signal
import subprocess
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from outbox.cli.demo_story import Demo


class Reads:
    """``in_flight_of`` answers, per deliverer pid, in the order asked."""

    def __init__(self, answers: dict[int, list[int]]) -> None:
        self.answers = {pid: deque(counts) for pid, counts in answers.items()}

    def in_flight_of(self, pattern: str) -> int:
        pid = int(pattern.split(":")[1])
        return self.answers[pid].popleft()


def test_a_kill_that_lands_after_the_calls_were_recorded_is_tried_again(tmp_path: Path) -> None:
    first, second = sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    injected: list[Any] = []
    story = Demo(
        ob=cast(
            Any,
            SimpleNamespace(
                store=SimpleNamespace(deliverers=Reads({first.pid: [16, 0], second.pid: [5, 5]}))
            ),
        ),
        sink=SimpleNamespace(inject=injected.append),
        workdir=tmp_path,
        env={},
        deliver_args=["this_module_exits_at_once"],
        deliverers=list(sleepers),
    )
    try:
        story._kill_a_deliverer()
        assert first.returncode == -signal.SIGKILL
        assert (story.deliverer_killed, story.events, injected) == (False, [], [])
        story._kill_a_deliverer()
        assert second.returncode == -signal.SIGKILL
        assert story.deliverer_killed and story.deliverer_kills == 2
        assert story.events == [
            f"deliverer {second.pid} killed (SIGKILL) holding 5 calls in flight; "
            "a new deliverer started, expired leases reconciled"
        ]
        assert len(injected) == 1, "the 429s come once, after the kill that counted"
        assert len(story.deliverers) == 4, "a new deliverer for each one killed"
    finally:
        for proc in [*sleepers, *story.procs]:
            proc.kill()
            proc.wait()
