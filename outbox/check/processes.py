"""Real ``outbox worker`` and ``outbox deliver`` processes, each with its own log, armed or not.

A crash point is armed per process (``OUTBOX_TEST_CRASH_AT`` in its
environment, never inherited by the next one), and a trace file can be shared
by all of them (``OUTBOX_TEST_TRACE``).

Two ways to start one: ``python -m outbox ...`` (:func:`spawn_outbox`), or a
fork of a server process that imported the package once
(:class:`~outbox.check.forkserver.ForkedOutbox`). A fork is the same
command in a real process, started in milliseconds instead of half a
CPU-second of imports: ``outbox check`` kills and replaces workers dozens of
times.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from outbox.check.forkserver import ForkedOutbox
from outbox.faults import CRASH_ENV, TRACE_ENV

__all__ = ["Fleet", "Process", "spawn_outbox", "start_deliverer"]


class Process(Protocol):
    """What a fleet needs of a process: ``subprocess.Popen`` and :class:`ForkedOutbox` have it."""

    @property
    def pid(self) -> int:
        """The process id."""
        ...

    @property
    def returncode(self) -> int | None:
        """The exit code once known (negative: the signal that ended it)."""
        ...

    def poll(self) -> int | None:
        """The exit code, or None while it runs."""
        ...

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the end; the exit code."""
        ...

    def send_signal(self, sig: int) -> None:
        """Send ``sig``."""
        ...

    def kill(self) -> None:
        """SIGKILL."""
        ...


#: Leases of checked processes: short, so a killed process's work is taken over soon.
LEASE_SECONDS = "1"


def spawn_outbox(
    args: list[str],
    env: Mapping[str, str],
    log: Path,
    *,
    crash_at: str | None = None,
    trace: Path | None = None,
) -> subprocess.Popen[bytes]:
    """``python -m outbox ARGS`` with its output in ``log``, armed at ``crash_at`` if given."""
    child = _child_env(env, crash_at, trace)
    with log.open("ab") as handle:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "outbox", *args],
            env=child,
            stdout=handle,
            stderr=subprocess.STDOUT,
            # A process group of its own, killed whole (Fleet.close): what it forks dies too.
            process_group=0,
        )


def start_deliverer(
    env: Mapping[str, str], config: Path, log: Path, *extra: str, crash_at: str | None = None
) -> subprocess.Popen[bytes]:
    """``outbox deliver`` with ``config`` (lease 1 s, poll 0.2 s), armed at ``crash_at``."""
    args = ["deliver", "--config", str(config), "--lease", LEASE_SECONDS, "--poll", "0.2"]
    return spawn_outbox([*args, *extra], env, log, crash_at=crash_at)


def _child_env(env: Mapping[str, str], crash_at: str | None, trace: Path | None) -> dict[str, str]:
    child = {k: v for k, v in env.items() if k not in (CRASH_ENV, TRACE_ENV)}
    if crash_at is not None:
        child[CRASH_ENV] = crash_at
    if trace is not None:
        child[TRACE_ENV] = str(trace)
    child.setdefault("PYTHONUNBUFFERED", "1")
    return child


@dataclass
class Fleet:
    """Worker and deliverer processes of one database, each with its own log file.

    Use as a context manager: on exit every process still running is killed
    and every process is waited for (no zombie, no ResourceWarning).
    ``handler``, ``agent`` and ``version`` are the workers' defaults.
    """

    env: dict[str, str]
    logs: Path
    config: Path | None
    handler: str = "outbox.check.workload:workload_agent"
    agent: str = "chaos-load"
    version: str = "1"
    trace: Path | None = None
    #: Seconds of the processes' leases.
    lease: str = LEASE_SECONDS
    #: ``subprocess``: ``python -m outbox``; ``fork``: a fork of the fork server.
    launcher: Literal["subprocess", "fork"] = "subprocess"
    procs: list[Process] = field(default_factory=list)
    names: dict[int, str] = field(default_factory=dict)
    armed: dict[int, str | None] = field(default_factory=dict)

    def _spawn(self, name: str, args: list[str], crash_at: str | None) -> Process:
        log = self.logs / f"{name}-{len(self.procs)}.log"
        proc: Process
        if self.launcher == "fork":
            proc = ForkedOutbox(args, _child_env(self.env, crash_at, self.trace), log)
        else:
            proc = spawn_outbox(args, self.env, log, crash_at=crash_at, trace=self.trace)
        self.procs.append(proc)
        self.names[proc.pid] = str(log)
        self.armed[proc.pid] = crash_at
        return proc

    def deliverer(self, *extra: str, crash_at: str | None = None) -> Process:
        """An ``outbox deliver`` process (lease 1 s, poll 0.2 s)."""
        config = [] if self.config is None else ["--config", str(self.config)]
        args = ["deliver", *config, "--lease", self.lease, "--poll", "0.2", *extra]
        return self._spawn("deliver", args, crash_at)

    def worker(
        self,
        *extra: str,
        crash_at: str | None = None,
        handler: str | None = None,
        agent: str | None = None,
        version: str | None = None,
        setup: str | None = None,
    ) -> Process:
        """An ``outbox worker`` process (lease 1 s) of the fleet's handler unless told otherwise."""
        args = [
            "worker",
            handler or self.handler,
            "--agent",
            agent or self.agent,
            "--version",
            version or self.version,
            "--lease",
            self.lease,
            *(["--setup", setup] if setup else []),
            *extra,
        ]
        return self._spawn("worker", args, crash_at)

    def alive(self, procs: Iterable[Process] | None = None) -> list[Process]:
        """The processes (of ``procs``, default all) still running."""
        return [p for p in (self.procs if procs is None else procs) if p.poll() is None]

    def log_of(self, proc: Process) -> str:
        """Everything the process wrote."""
        return Path(self.names[proc.pid]).read_text(errors="replace")

    def kill9(self, proc: Process) -> None:
        """SIGKILL, and wait for it."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)

    def stop(self, proc: Process, timeout: float = 60) -> int:
        """SIGTERM (SIGCONT first, in case it was stopped); the exit code."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=timeout)

    def __enter__(self) -> Fleet:
        return self

    def close(self) -> None:
        """Kill what still runs, each process's group included; wait for everything."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.send_signal(signal.SIGKILL)
            # Each process leads a group of its own: what it forked (and left running,
            # even after it ended) goes with it. (The fork server does this itself the
            # moment a forked process ends.)
            if isinstance(proc, subprocess.Popen):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)

    def __exit__(self, *exc: object) -> None:
        self.close()

    def tails(self, lines: int = 15) -> str:
        """The last lines of every process's log (for assertion messages)."""
        out = []
        for proc in self.procs:
            text = self.log_of(proc).splitlines()[-lines:]
            out.append(f"--- {self.names[proc.pid]} (exit {proc.poll()})\n" + "\n".join(text))
        return "\n".join(out)
