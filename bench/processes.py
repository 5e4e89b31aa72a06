"""``outbox deliver`` (and ``outbox relay``) subprocesses, watched through the database.

The sections that measure real deliverer processes start them here and time
them by what the database records (``attempt_started_at``, ``completed_at``),
never by their logs; a process's log is read only to know it started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from bench.harness import Bench, RssSampler, cpu_of, spawn_python
from bench.sinks import deliverers_config

#: Whether any effect is still open (pending, in flight, or dispatched in stream
#: mode; open until it succeeded or failed), each state looked up through its own
#: partial index, in that index's order (scalar subqueries: PostgreSQL drops
#: the ORDER BY of an EXISTS and then chose a sequential scan). The count this
#: replaces read the whole table, 0.3 s at a million rows, and polled twice a
#: second it took a CPU from the deliverer being measured; this takes 1 ms.
ANY_OPEN = (
    "SELECT (SELECT 1 FROM outbox_effects WHERE status = 'pending' "
    "ORDER BY kind, priority, fairness_key, available_at, seq LIMIT 1) IS NOT NULL "
    "OR (SELECT 1 FROM outbox_effects WHERE status = 'in_flight' "
    "ORDER BY lease_expires_at LIMIT 1) IS NOT NULL "
    "OR (SELECT 1 FROM outbox_effects WHERE status = 'dispatched' "
    "ORDER BY lease_expires_at LIMIT 1) IS NOT NULL"
)


class DelivererProcess:
    """One ``python -m outbox COMMAND`` subprocess (``deliver`` by default), logging to a file."""

    def __init__(
        self,
        bench: Bench,
        workdir: Path,
        kind: str,
        *,
        name: str,
        options: Sequence[str] = (),
        command: str = "deliver",
        env: dict[str, str] | None = None,
        sample_rss: bool = False,
    ) -> None:
        config = deliverers_config(workdir / "deliverers.toml")
        self.log_path = workdir / f"{name}-{uuid.uuid4().hex[:4]}.log"
        self._log = self.log_path.open("ab")
        args = ["-m", "outbox", command, "--config", str(config), "--kind", kind, *options]
        environ = {"OUTBOX_DSN": bench.dsn, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.process = spawn_python(args, env=environ, stdout=self._log, stderr=subprocess.STDOUT)
        self.pid = self.process.pid
        self.rss = RssSampler(self.pid) if sample_rss else None

    def cpu_seconds(self) -> float:
        return cpu_of([self.pid])

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill9(self) -> float:
        """SIGKILL; returns ``time.time()`` just before the signal."""
        when = time.time()
        os.kill(self.pid, signal.SIGKILL)
        self.process.wait(10)
        return when

    def stop(self) -> None:
        if self.rss is not None:
            self.rss.stop()
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(40)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()

    def tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def wait_started(self, timeout: float = 60.0) -> DelivererProcess:
        """Wait until the process logged its start banner (it then claims at once)."""
        deadline = time.monotonic() + timeout
        while "delivering kinds" not in self.tail(50) and "relaying kinds" not in self.tail(50):
            self.check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.pid} did not start within {timeout:.0f} s")
            time.sleep(0.05)
        return self

    def check(self) -> None:
        if not self.alive():
            raise RuntimeError(f"deliverer {self.pid} exited:\n{self.tail()}")


def start(
    bench: Bench, workdir: Path, kind: str, count: int, options: Sequence[str] = ()
) -> list[DelivererProcess]:
    """Start ``count`` deliverer processes and wait until each one is delivering."""
    procs: list[DelivererProcess] = []
    try:
        for i in range(count):
            procs.append(
                DelivererProcess(bench, workdir, kind, name=f"deliver-{i}", options=options)
            )
        for proc in procs:
            proc.wait_started()
    except BaseException:
        stop_all(procs)
        raise
    return procs


def stop_all(procs: Sequence[DelivererProcess]) -> None:
    for proc in procs:
        proc.stop()


def wait_drained(
    bench: Bench, procs: Sequence[DelivererProcess], timeout: float, poll: float = 0.1
) -> float:
    """Wait until no effect is open; return the last ``completed_at`` (epoch seconds)."""
    deadline = time.monotonic() + timeout
    while bench.value(ANY_OPEN):
        for proc in procs:
            proc.check()
        if time.monotonic() > deadline:
            raise RuntimeError(f"not drained within {timeout:.0f} s")
        time.sleep(poll)
    last, failed = bench.rows(
        "SELECT extract(epoch FROM max(completed_at))::float8, "
        "count(*) FILTER (WHERE status <> 'succeeded') FROM outbox_effects"
    )[0]
    if failed:
        raise RuntimeError(f"{failed} effects did not succeed: {bench.counts()}")
    return float(last)


def first_start(bench: Bench) -> float:
    """The first ``attempt_started_at`` (epoch seconds)."""
    return float(
        bench.value(
            "SELECT extract(epoch FROM min(attempt_started_at))::float8 FROM outbox_effects"
        )
    )
