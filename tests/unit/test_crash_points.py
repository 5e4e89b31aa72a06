"""Crash points: aimed by name, count or place; traced; and the catalogue the kit reports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox import faults
from outbox.check.crash import CRASH_POINTS, occurrences, read_trace, target
from outbox.faults import CRASH_ENV, POINTS, TRACE_ENV, crash_point, parse_target


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("after_step", ("after_step", None, 1)),
        ("after_step:3", ("after_step", None, 3)),
        ("step_end@match-03", ("step_end", "match-03", 1)),
        ("parked@await:0190-ab:cd", ("parked", "await:0190-ab:cd", 1)),
    ],
)
def test_a_target_names_a_point_and_a_count_or_a_place(
    raw: str, expected: tuple[str, str | None, int]
) -> None:
    assert parse_target(raw) == expected


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("nowhere", "no crash point 'nowhere'"),
        ("after_step:0", "at least 1"),
        ("after_step@", "nothing after '@'"),
    ],
)
def test_a_bad_target_is_refused_with_its_value(raw: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_target(raw)


def test_every_catalogued_point_exists_in_the_code_and_has_words() -> None:
    assert set(CRASH_POINTS) <= POINTS
    assert set(faults.WORKER_POINTS) >= {
        p for p, c in CRASH_POINTS.items() if c.role != "deliverer"
    }
    for point in CRASH_POINTS.values():
        assert point.when and point.expected, point.name


@pytest.fixture(autouse=True)
def fresh_config() -> Iterator[None]:
    faults.reset()
    yield
    faults.reset()


def test_an_unarmed_point_traces_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(CRASH_ENV, raising=False)
    monkeypatch.delenv(TRACE_ENV, raising=False)
    crash_point("after_step", "a")  # neither variable: nothing happens, nothing is written
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv(TRACE_ENV, str(trace))
    crash_point("after_step", "b")  # read once: still off until reset
    assert not trace.exists()
    faults.reset()
    crash_point("step_start", "fetch", run="r1")
    crash_point("step_end", "fetch", run="r1")
    crash_point("step_start", "fetch", run="r2")
    events = read_trace(trace)
    assert [(e.point, e.where, e.run, e.crash) for e in events] == [
        ("step_start", "fetch", "r1", False),
        ("step_end", "fetch", "r1", False),
        ("step_start", "fetch", "r2", False),
    ]
    assert {e.pid for e in events} == {os.getpid()}
    assert occurrences(events, "step_start") == ["fetch"]
    assert occurrences(events, "step_start", run="r9") == []


def test_a_point_aimed_at_one_place_kills_there_and_says_so_in_the_trace(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    code = (
        "from outbox.faults import crash_point\n"
        "for step in ('a', 'b', 'c'):\n"
        "    crash_point('step_end', step, run='r')\n"
    )
    env = {**os.environ, CRASH_ENV: target("step_end", "b"), TRACE_ENV: str(trace)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, timeout=60, check=False)
    assert proc.returncode == -signal.SIGKILL
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [(e["where"], e.get("crash", False)) for e in lines] == [("a", False), ("b", True)]


def test_a_torn_last_line_of_a_trace_is_skipped(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"point": "after_step", "where": "a", "pid": 1, "t": 1.0}\n{"point": "af')
    assert [e.where for e in read_trace(trace)] == ["a"]
    assert read_trace(tmp_path / "missing.jsonl") == []
