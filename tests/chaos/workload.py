"""A workload for the fault tests: N runs x M steps x K ``http.request`` effects to a real sink.

Every effect's payload carries a unique ``operation`` id derived from (run, step,
index), so the sink can tell a redelivery of one intent (same key, deduplicated)
from a second intent for the same business operation (a real duplicate).

Two drivers produce the same intents:

- a script: plain ``run.transaction`` calls from the test process
  (:func:`drive_script`, or :class:`ScriptThread` to write while faults happen);
- real ``outbox worker`` processes running :func:`workload_agent`, which reads
  M, K and the sink URL from ``run.inputs`` (:func:`start_worker`).

:class:`LoggingSink` is the real :class:`IdempotentHttpSink` with one addition
to its JSON-lines request log: an ``applied`` line each time a request takes
effect, which is what the invariant checker counts.
"""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deliverers.testing import IdempotentHttpSink
from outbox import Outbox, Run, StepTransaction
from outbox.errors import DatabaseError, RunNotFound
from tests.chaos.deliverer_process import CONFIG

AGENT = "chaos-load"
VERSION = "1"


# -- the sink --------------------------------------------------------------------------------


class LoggingSink(IdempotentHttpSink):
    """An :class:`IdempotentHttpSink` whose log also records every application.

    The base class logs each request as it arrives (``{"t", "path", "key",
    "effect_id", "attempt", "body"}``), before it knows whether it will be
    applied, refused by a fault or replayed from the stored result. This
    subclass appends ``{"event": "applied", "key", "operation", ...}`` when a
    request actually takes effect, under its own lock so the before/after
    comparison is exact.
    """

    def __init__(
        self,
        log_path: Path,
        *,
        lookup_latency: float = 0.0,
        lookup_barrier: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(log_path=log_path, **kwargs)
        self.log_path = log_path
        log_path.touch()
        #: Seconds every lookup (``GET /idempotency/KEY``) takes.
        self.lookup_latency = lookup_latency
        #: Lookups wait until this many client connections have asked (at most 60 s):
        #: proof that that many processes were looking up at the same time.
        self.lookup_barrier = lookup_barrier
        self.lookup_peers: set[Any] = set()
        self._peers_changed = threading.Condition()
        self._apply_lock = threading.Lock()

    def _get(self, handler: Any) -> None:
        if handler.path.startswith("/idempotency/"):
            with self._peers_changed:
                self.lookup_peers.add(handler.client_address)
                self._peers_changed.notify_all()
                self._peers_changed.wait_for(
                    lambda: len(self.lookup_peers) >= self.lookup_barrier, timeout=60
                )
            time.sleep(self.lookup_latency)
        super()._get(handler)

    def _apply(self, key: str | None, raw: bytes, path: str) -> tuple[int, Any]:
        with self._apply_lock:
            before = sum(self.state.applied_count.values()) + sum(self.state.operations.values())
            status, response = super()._apply(key, raw, path)
            after = sum(self.state.applied_count.values()) + sum(self.state.operations.values())
        if after > before:
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = None
            operation = body.get("operation") if isinstance(body, dict) else None
            self._log(
                {
                    "event": "applied",
                    "t": time.time(),
                    "path": path,
                    "key": key,
                    "operation": operation,
                    "seq": response.get("seq") if isinstance(response, dict) else None,
                }
            )
        return status, response


# -- the workload ------------------------------------------------------------------------------


def operation_id(run_id: uuid.UUID | str, step: int, index: int) -> str:
    """The business operation of one effect: unique per (run, step, index)."""
    return f"{run_id}:{step}:{index}"


def step_id(step: int) -> str:
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
        return self.runs * self.steps * self.effects

    def inputs(self) -> dict[str, Any]:
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
    """The handler ``outbox worker tests.chaos.workload:workload_agent`` runs."""
    inputs = run.inputs
    for m in range(int(inputs["steps"])):
        run.transaction(step_id(m), lambda tx, m=m: _intend_step(tx, run.id, m, inputs))
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
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the script did not finish"
        if self.error is not None:
            raise self.error

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)


def run_statuses(ob: Outbox, run_ids: Iterable[uuid.UUID]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for rid in run_ids:
        try:
            status = ob.run(rid).status.value
        except RunNotFound:
            status = "missing"
        counts[status] = counts.get(status, 0) + 1
    return counts


# -- processes -----------------------------------------------------------------------------------


def write_config(directory: Path, extra: str = "") -> Path:
    path = directory / f"deliverers-{hashlib.sha256(extra.encode()).hexdigest()[:8]}.toml"
    path.write_text(CONFIG + extra)
    return path


@dataclass
class Fleet:
    """Real ``outbox deliver`` / ``outbox worker`` processes, each with its own log file.

    Use as a context manager: on exit every process still running is killed
    and every process is waited for (no zombie, no ResourceWarning).
    """

    env: dict[str, str]
    logs: Path
    config: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    names: dict[int, str] = field(default_factory=dict)

    def _spawn(self, name: str, args: list[str], crash_at: str | None) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in self.env.items() if k != "OUTBOX_TEST_CRASH_AT"}
        if crash_at is not None:
            env["OUTBOX_TEST_CRASH_AT"] = crash_at
        log = self.logs / f"{name}-{len(self.procs)}.log"
        with log.open("ab") as handle:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen(
                [sys.executable, "-m", "outbox", *args],
                env=env,
                stdout=handle,
                stderr=subprocess.STDOUT,
            )
        self.procs.append(proc)
        self.names[proc.pid] = str(log)
        return proc

    def deliverer(self, *extra: str, crash_at: str | None = None) -> subprocess.Popen[bytes]:
        args = ["deliver", "--config", str(self.config), "--lease", "1", "--poll", "0.2"]
        return self._spawn("deliver", [*args, *extra], crash_at)

    def worker(self, *extra: str, crash_at: str | None = None) -> subprocess.Popen[bytes]:
        args = [
            "worker",
            "tests.chaos.workload:workload_agent",
            "--agent",
            AGENT,
            "--version",
            VERSION,
            "--lease",
            "1",
        ]
        return self._spawn("worker", [*args, *extra], crash_at)

    def alive(self, procs: Iterable[subprocess.Popen[bytes]] | None = None) -> list[Any]:
        return [p for p in (self.procs if procs is None else procs) if p.poll() is None]

    def log_of(self, proc: subprocess.Popen[bytes]) -> str:
        return Path(self.names[proc.pid]).read_text(errors="replace")

    def kill9(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)

    def stop(self, proc: subprocess.Popen[bytes], timeout: float = 60) -> int:
        """SIGTERM (SIGCONT first, in case it was stopped); the exit code."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=timeout)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)

    def tails(self, lines: int = 15) -> str:
        """The last lines of every process's log (for assertion messages)."""
        out = []
        for proc in self.procs:
            text = self.log_of(proc).splitlines()[-lines:]
            out.append(f"--- {self.names[proc.pid]} (exit {proc.poll()})\n" + "\n".join(text))
        return "\n".join(out)
