"""A workload for fault tests: N runs x M steps x K ``http.request`` effects to a real sink.

Every effect's payload carries a unique ``operation`` id derived from (run, step,
index), so the sink can tell a redelivery of one intent (same key, deduplicated)
from a second intent for the same business operation (a real duplicate).

Two drivers produce the same intents:

- a script: plain ``run.transaction`` calls from the test process
  (:func:`drive_script`, or :class:`ScriptThread` to write while faults happen);
- real ``outbox worker`` processes running :func:`workload_agent`, which reads
  M, K and the sink URL from ``run.inputs`` (:class:`outbox.check.processes.Fleet`).
"""

from __future__ import annotations

import hashlib
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from outbox.client import Outbox
from outbox.errors import DatabaseError, RunNotFound
from outbox.runs.run import Run
from outbox.runs.steps import StepTransaction

__all__ = [
    "AGENT",
    "CONFIG",
    "VERSION",
    "ScriptThread",
    "Workload",
    "drive_script",
    "operation_id",
    "run_statuses",
    "start_runs",
    "step_id",
    "workload_agent",
    "write_config",
]

AGENT = "chaos-load"
VERSION = "1"

#: Deliverers config for the workload's sink on loopback: ``http.request`` (the sink
#: dedups) and ``http.blind`` (the same type declared not idempotent).
CONFIG = """
[kinds."http.request"]
allow_private = ["127.0.0.1"]

[kinds."http.blind"]
type = "http.request"
idempotent = false
allow_private = ["127.0.0.1"]
"""


# -- the workload ------------------------------------------------------------------------------


def operation_id(run_id: uuid.UUID | str, step: int, index: int) -> str:
    """The business operation of one effect: unique per (run, step, index)."""
    return f"{run_id}:{step}:{index}"


def step_id(step: int) -> str:
    """The id of the workload's step number ``step``."""
    return f"step-{step:03d}"


@dataclass(frozen=True)
class Workload:
    """N runs x M steps x K effects of ``kind`` posted to ``sink_url``."""

    runs: int
    steps: int
    effects: int
    sink_url: str
    kind: str = "http.request"
    #: Sent as the request's ``timeout`` (seconds); a hanging sink costs this much.
    timeout: float = 10.0
    #: Seconds a worker's handler waits between steps (so kills land mid-run).
    pause: float = 0.0
    #: Every ``blind_every``-th effect (when > 0) uses ``blind_kind`` (a non-idempotent sink).
    blind_every: int = 0
    blind_kind: str = "http.blind"

    @property
    def total(self) -> int:
        """Effects in all."""
        return self.runs * self.steps * self.effects

    def inputs(self) -> dict[str, Any]:
        """The inputs of each run (what :func:`workload_agent` reads)."""
        return {
            "steps": self.steps,
            "effects": self.effects,
            "sink": self.sink_url,
            "kind": self.kind,
            "timeout": self.timeout,
            "pause": self.pause,
            "blind_every": self.blind_every,
            "blind_kind": self.blind_kind,
        }

    def expected_operations(self, run_ids: Iterable[uuid.UUID]) -> set[str]:
        """Every operation these runs must intend."""
        return {
            operation_id(rid, m, k)
            for rid in run_ids
            for m in range(self.steps)
            for k in range(self.effects)
        }


def _intend_step(tx: StepTransaction, run_id: uuid.UUID, m: int, inputs: dict[str, Any]) -> int:
    blind_every = int(inputs.get("blind_every") or 0)
    for k in range(int(inputs["effects"])):
        n = m * int(inputs["effects"]) + k
        blind = blind_every > 0 and n % blind_every == blind_every - 1
        tx.intend(
            inputs["blind_kind"] if blind else inputs["kind"],
            {
                "url": f"{inputs['sink']}/ops/{m}",
                "json": {"operation": operation_id(run_id, m, k), "step": m, "index": k},
                "timeout": inputs["timeout"],
            },
        )
    tx.set_state({"done": m + 1})
    return m


def workload_agent(run: Run) -> Any:
    """The handler ``outbox worker outbox.check.workload:workload_agent`` runs."""
    inputs = run.inputs
    for m in range(int(inputs["steps"])):

        def step(tx: StepTransaction, m: int = m) -> int:
            return _intend_step(tx, run.id, m, inputs)

        run.transaction(step_id(m), step)
        if inputs.get("pause"):
            time.sleep(float(inputs["pause"]))
    return {"steps": inputs["steps"]}


def start_runs(ob: Outbox, workload: Workload) -> list[uuid.UUID]:
    """Start ``workload.runs`` runnable runs (a worker claims them; a script drives them)."""
    return [ob.start_run(AGENT, VERSION, workload.inputs()).id for _ in range(workload.runs)]


def _retrying(action: Any, deadline: float) -> Any:
    """Call ``action`` until it stops raising a database error, up to ``deadline``."""
    delay = 0.05
    while True:
        try:
            return action()
        except (DatabaseError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.5)


def drive_script(
    ob: Outbox,
    workload: Workload,
    run_ids: list[uuid.UUID],
    *,
    retry_seconds: float = 0.0,
    between_steps: float = 0.0,
    stop: threading.Event | None = None,
) -> None:
    """Drive each run through its M steps with plain ``run.transaction`` calls, then complete it.

    With ``retry_seconds``, a step that fails on a database error (a terminated
    connection, a restarting server) is retried on the same run: a step that did
    commit is recorded once, so the retry replays it (G5) and intends nothing new.
    """
    deadline = time.monotonic() + retry_seconds
    inputs = workload.inputs()
    for rid in run_ids:
        run = _retrying(lambda rid=rid: ob.run(rid), deadline)
        for m in range(workload.steps):
            if stop is not None and stop.is_set():
                return

            def one_step(run: Run = run, m: int = m) -> Any:
                return run.transaction(step_id(m), lambda tx: _intend_step(tx, run.id, m, inputs))

            _retrying(one_step, deadline)
            if between_steps:
                time.sleep(between_steps)

        def complete(rid: uuid.UUID = rid) -> None:
            fresh = ob.run(rid)
            if fresh.status.value != "completed":
                fresh.complete({"steps": workload.steps})

        _retrying(complete, deadline)


class ScriptThread:
    """:func:`drive_script` in a background thread (writes while the test injects faults)."""

    def __init__(self, ob: Outbox, workload: Workload, run_ids: list[uuid.UUID], **kw: Any):
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._main, args=(ob, workload, run_ids), kwargs=kw, daemon=True
        )

    def _main(self, ob: Outbox, workload: Workload, run_ids: list[uuid.UUID], **kw: Any) -> None:
        try:
            drive_script(ob, workload, run_ids, stop=self._stop, **kw)
        except BaseException as exc:  # surfaced by join()
            self.error = exc

    def __enter__(self) -> ScriptThread:
        self._thread.start()
        return self

    def join(self, timeout: float = 120) -> None:
        """Wait for the script; raise what it raised."""
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the script did not finish"
        if self.error is not None:
            raise self.error

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)


def run_statuses(ob: Outbox, run_ids: Iterable[uuid.UUID]) -> dict[str, int]:
    """Runs per status (``missing`` for an id not found)."""
    counts: dict[str, int] = {}
    for rid in run_ids:
        try:
            status = ob.run(rid).status.value
        except RunNotFound:
            status = "missing"
        counts[status] = counts.get(status, 0) + 1
    return counts


def write_config(directory: Path, extra: str = "") -> Path:
    """:data:`CONFIG` plus ``extra`` in a file of ``directory``; its path."""
    path = directory / f"deliverers-{hashlib.sha256(extra.encode()).hexdigest()[:8]}.toml"
    path.write_text(CONFIG + extra)
    return path
