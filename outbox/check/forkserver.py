"""A fork server: one process imports agent-outbox once, then forks ``outbox`` commands on request.

``outbox check`` kills and replaces workers dozens of times; a fresh
``python -m outbox`` costs half a CPU-second of imports, a fork of a process
that already imported them a few milliseconds. Each fork is a real process
running the same command line, killed with a real SIGKILL.

The server (``python -m outbox.check.forkserver``) is single-threaded, so
forking it is safe (the checking process has threads; forking *it* could copy a
lock some thread holds). It speaks JSON lines on its standard streams:

- in: ``{"args", "env", "log", "path", "cwd"}``: fork ``outbox ARGS`` with this
  environment, ``sys.path`` and working directory, its output appended to ``log``;
- out: ``{"pid": N}`` in answer to each request, in order, and ``{"exit": N,
  "code": C}`` when a child ends (``C`` negative: the signal that ended it).

It exits when its standard input closes (the checking process is gone), and
kills the children still running then: a check that was itself killed leaves
no worker behind.

Each child leads a process group of its own, and the group is killed whole
(SIGKILL) as soon as the child ends, however it ends: what the agent's code
forked (a helper that ignores SIGTERM, say) dies with the worker that started
it, as everything in a container dies with it. A SIGTERM or SIGHUP sent to the
server (with the checking process's group, by ``timeout`` or a service manager)
kills every child's group before the server exits. Only a process that starts
a session of its own (``setsid``) escapes.
Unlike ``multiprocessing``'s forkserver it never re-imports the caller's main
module in a child.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import selectors
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

__all__ = ["ForkServer", "ForkedOutbox", "serve"]

#: What the server imports once, before it forks anything.
#: (``outbox.cli`` loads a command's module only when it runs: name the ones a check forks.)
PRELOAD = (
    "outbox",
    "outbox.client",
    "outbox.cli",
    "outbox.cli.deliver",
    "outbox.cli.relay",
    "outbox.cli.worker",
    "outbox.delivery.daemon",
    "deliverers.record",
    "deliverers.http",
)


# -- the server process ----------------------------------------------------------------------


def _child(request: Mapping[str, Any], inherited: list[int]) -> None:
    """In the forked child: become ``outbox ARGS`` (never returns)."""
    code = 1
    try:
        # A group of its own: what it forks is in it, and is killed with it (reap()).
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)
        _die_with_parent()
        for fd in inherited:  # the server's pipes: the child must not hold them open
            with contextlib.suppress(OSError):
                os.close(fd)
        for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        devnull = os.open(os.devnull, os.O_RDONLY)
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(devnull)
        os.close(log)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's own streams)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[:] = request["path"]
        sys.argv = ["outbox", *request["args"]]
        try:
            # exactly what ``python -m outbox ARGS`` runs
            runpy.run_module("outbox", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the server dies, however it dies (even by SIGKILL)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the server died before the call: nobody would tell us
        os._exit(1)


def _kill_group(pgid: int) -> None:
    """SIGKILL every process of group ``pgid`` (nothing if none is left)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def serve() -> None:
    """The server's loop: fork on request, report each child's end, stop at end of input."""
    for module in PRELOAD:
        importlib.import_module(module)
    out = os.fdopen(os.dup(1), "w", buffering=1)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # the wake-up fd is what matters
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C is for the checking process
    children: set[int] = set()

    def stop(signum: int, frame: object) -> None:
        # Signalled with the checking process's group (a `timeout`, a service manager):
        # the children lead groups of their own, so the signal did not reach them.
        for pid in list(children):
            _kill_group(pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ, "request")
    selector.register(wake_r, selectors.EVENT_READ, "child")
    pending = b""

    def reap() -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            children.discard(pid)
            # The child led a group of its own: what it left running dies now. While any
            # member lives the group's id cannot be given to another process, so this
            # reaches the child's own descendants and nothing else.
            _kill_group(pid)
            code = os.waitstatus_to_exitcode(status)
            with contextlib.suppress(OSError):  # the checking process may be gone
                out.write(json.dumps({"exit": pid, "code": code}) + "\n")

    while True:
        for key, _ in selector.select():
            if key.data == "child":
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
                reap()
                continue
            chunk = os.read(0, 1 << 16)
            if not chunk:
                for pid in children:
                    _kill_group(pid)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                for _ in list(children):
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(-1, 0)
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    _child(request, [out.fileno(), wake_r, wake_w])
                # Both sides set the group, so it exists before anyone signals it.
                with contextlib.suppress(OSError):
                    os.setpgid(pid, pid)
                children.add(pid)
                out.write(json.dumps({"pid": pid}) + "\n")


# -- the checking process's side ----------------------------------------------------------------


class ForkServer:
    """A running fork server, shared by the threads of one process (see :meth:`shared`)."""

    _shared: ForkServer | None = None
    _shared_lock = threading.Lock()

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "outbox.check.forkserver"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._stdin: IO[str] = self._proc.stdin
        self._request = threading.Lock()
        self._changed = threading.Condition()
        self._pids: list[int] = []
        self._exits: dict[int, int] = {}
        self._reader = threading.Thread(
            target=self._read, args=(self._proc.stdout,), name="outbox-forkserver", daemon=True
        )
        self._reader.start()

    @classmethod
    def shared(cls) -> ForkServer:
        """The process's fork server, started on first use (again if it died)."""
        with cls._shared_lock:
            if cls._shared is None or cls._shared._proc.poll() is not None:
                cls._shared = cls()
            return cls._shared

    def _read(self, stream: IO[str]) -> None:
        with stream:
            for line in stream:
                message = json.loads(line)
                with self._changed:
                    if "pid" in message:
                        self._pids.append(int(message["pid"]))
                    else:
                        self._exits[int(message["exit"])] = int(message["code"])
                    self._changed.notify_all()
        with self._changed:  # the server is gone: nothing more will be said
            self._changed.notify_all()

    def close(self, timeout: float = 30) -> int:
        """End the server (its children still running are killed); its exit code."""
        with contextlib.suppress(OSError):
            self._stdin.close()
        code = self._proc.wait(timeout=timeout)
        self._reader.join(timeout=timeout)
        return code

    def fork(self, args: list[str], env: Mapping[str, str], log: Path) -> int:
        """Start ``outbox ARGS``; its pid. The log exists when this returns."""
        log.touch()
        request = {
            "args": args,
            "env": dict(env),
            "log": str(log),
            "path": [os.getcwd(), *sys.path],  # as ``python -m outbox`` would have it
            "cwd": os.getcwd(),
        }
        with self._request:
            with self._changed:
                self._pids.clear()
            self._stdin.write(json.dumps(request) + "\n")
            self._stdin.flush()
            with self._changed:
                if not self._changed.wait_for(
                    lambda: self._pids or self._proc.poll() is not None, timeout=60
                ):
                    raise RuntimeError("the fork server did not answer in 60 s")
                if not self._pids:
                    raise RuntimeError(f"the fork server died (exit {self._proc.poll()})")
                return self._pids.pop(0)

    def exit_code(self, pid: int) -> int | None:
        """The child's exit code once it ended (SIGKILL's, when the server is gone)."""
        with self._changed:
            return self._exits.get(pid, self._gone())

    def wait(self, pid: int, timeout: float | None) -> int | None:
        """Wait up to ``timeout`` for the child to end; its exit code, or None."""
        with self._changed:
            self._changed.wait_for(
                lambda: pid in self._exits or self._proc.poll() is not None, timeout=timeout
            )
            return self._exits.get(pid, self._gone())

    def _gone(self) -> int | None:
        # A server that is gone took its children with it: it kills them as it exits,
        # and each dies with it anyway (PR_SET_PDEATHSIG).
        return -signal.SIGKILL if self._proc.poll() is not None else None


class ForkedOutbox:
    """``outbox ARGS`` forked by the :class:`ForkServer`; behaves as ``subprocess.Popen`` does.

    (``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``kill``; a
    negative return code is the signal that ended it.)
    """

    def __init__(self, args: list[str], env: Mapping[str, str], log: Path) -> None:
        self._server = ForkServer.shared()
        self.pid = self._server.fork(args, env, log)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code, or None while it runs."""
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for it to end; ``subprocess.TimeoutExpired`` if it has not in time."""
        if self.returncode is None:
            self.returncode = self._server.wait(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"outbox process {self.pid}", timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Signal it (nothing if it has ended)."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it ended just now
                os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL it and its process group (what it forked)."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
        self.send_signal(signal.SIGKILL)


if __name__ == "__main__":
    serve()
