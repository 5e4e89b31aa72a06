"""The supervisor of one trial: its processes, its runs' signals, and whether it is done.

:class:`Supervisor` starts workers and deliverers (armed or not) for a trial,
serves effect kinds as they appear (record mode), sends the runs the signals
they wait for, notices a process that failed, and tells when every run has
ended and no effect is on its way, or that nothing has moved for too long.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from outbox.check.plan import CheckOptions
from outbox.check.processes import Fleet, Process
from outbox.client import Outbox
from outbox.models import TERMINAL_RUN_STATUSES, RunRecord, RunStatus
from outbox.storage.admin.scratch import ScratchDatabases

__all__ = ["TERMINAL", "Supervisor", "TrialContext", "TrialError"]

TERMINAL = {s.value for s in TERMINAL_RUN_STATUSES}
_OPEN_EFFECTS = ("pending", "in_flight", "dispatched")
_TICK = 0.1
_QUIET = 0.3


class TrialError(Exception):
    """The trial could not be carried out (a process failed, or nothing finished in time)."""


@dataclass
class TrialContext:
    """What every trial of one check shares."""

    options: CheckOptions
    databases: ScratchDatabases
    workdir: Path
    #: Record mode: the kinds known so far, each with (idempotent, has a lookup).
    kinds: dict[str, tuple[bool, bool]] = field(default_factory=dict)
    #: Set when the check is interrupted: every trial stops at its next look around.
    cancelled: threading.Event = field(default_factory=threading.Event)
    #: Record mode: the declarations of the user's deliverers config.
    declarations: dict[str, tuple[bool, bool]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def env(self, dsn: str, sink_url: str | None) -> dict[str, str]:
        """The environment of this trial's processes."""
        env = dict(os.environ)
        env["OUTBOX_DSN"] = dsn
        env["OUTBOX_HOME"] = str(self.workdir / "no-embedded-server")
        # The agent's module must import in the children as it does here.
        paths = [os.getcwd(), *[p for p in sys.path if p and Path(p).is_dir()]]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        if sink_url is not None:
            env["OUTBOX_CHECK_SINK"] = sink_url
            env.pop("OUTBOX_DELIVERERS_CONFIG", None)
        return env

    def learn_kinds(self, kinds: list[str]) -> bool:
        """Add kinds; True when there was a new one."""
        with self.lock:
            new = [k for k in kinds if k not in self.kinds]
            for kind in new:
                self.kinds[kind] = self.declarations.get(kind, (True, False))
            return bool(new)

    def record_config(self, path: Path, sink_url: str, only: set[str] | None = None) -> Path:
        """A deliverers config serving known kinds (``only`` these) with stand-ins for the sink."""
        with self.lock:
            kinds = {k: v for k, v in self.kinds.items() if only is None or k in only}
        lines = []
        for kind, (idempotent, lookup) in sorted(kinds.items()):
            lines += [
                f"[kinds.{json.dumps(kind)}]",
                'type = "testing.record"',
                f"url = {json.dumps(sink_url)}",
                f"idempotent = {str(idempotent).lower()}",
                f"lookup = {str(lookup).lower()}",
                "",
            ]
        path.write_text("\n".join(lines))
        return path


class Supervisor:
    """Keeps one trial's processes, runs and signals moving; knows when it is done."""

    def __init__(
        self,
        ctx: TrialContext,
        ob: Outbox,
        fleet: Fleet,
        run_ids: list[str],
        sink_url: str | None,
        logs: Path,
    ) -> None:
        self.ctx = ctx
        self.ob = ob
        self.fleet = fleet
        self.run_ids = run_ids
        self.sink_url = sink_url
        self.logs = logs
        self.deadline = time.monotonic() + ctx.options.timeout
        self.deliverer: Process | None = None
        self._deliverer_armed: str | None = None
        self._deliverer_wanted = False
        self._served: set[str] = set()
        self._seen: object = None
        self._configs = 0

    # -- processes ---------------------------------------------------------------------

    def _progress(self) -> None:
        """The trial is moving: its time limit starts again."""
        self.deadline = time.monotonic() + self.ctx.options.timeout

    def _config(self, only: set[str] | None = None) -> None:
        if self.sink_url is None:
            return
        self._configs += 1
        path = self.logs / f"deliverers-{self._configs}.toml"
        self.fleet.config = self.ctx.record_config(path, self.sink_url, only)

    def start_deliverer(self, crash_at: str | None = None) -> Process | None:
        """A deliverer; in record mode not before a kind is known (None until then).

        A config with no kind would make ``outbox deliver`` serve every installed
        type with its defaults: real HTTP calls, which a recorded check never makes.
        """
        self._deliverer_armed = crash_at
        self._deliverer_wanted = True
        if self.sink_url is not None and not self.ctx.kinds:
            return None
        self._progress()
        self._config()
        self._served = set(self.ctx.kinds)
        self.deliverer = self.fleet.deliverer("--grace", "2", crash_at=crash_at)
        return self.deliverer

    def disarm_deliverer(self) -> None:
        """Deliverers started from now on (for new kinds) carry no crash point."""
        self._deliverer_armed = None

    def _serve_new_kinds(self) -> None:
        """Record mode: a kind no deliverer here serves appeared; start one for it."""
        new = set(self.ctx.kinds) - self._served
        if not new or not self._deliverer_wanted:
            return
        if self.deliverer is None:
            self.start_deliverer(self._deliverer_armed)
            return
        self._progress()
        self._config(only=new)
        self._served |= new
        self.fleet.deliverer("--grace", "2")

    def worker(self, *, crash_at: str | None = None, new_version: bool = False) -> Process:
        """A worker of the checked version (or of the new one, with its setup)."""
        opts = self.ctx.options
        self._progress()
        if new_version:
            return self.fleet.worker(
                "--concurrency",
                str(max(4, opts.runs)),
                crash_at=crash_at,
                handler=opts.upgrade_handler or opts.handler,
                version=opts.upgrade_to,
                setup=opts.setup,
            )
        return self.fleet.worker("--concurrency", str(max(4, opts.runs)), crash_at=crash_at)

    # -- one look around ---------------------------------------------------------------

    def _records(self) -> list[RunRecord]:
        return [r for r in self.ob.store.list_runs(limit=10_000) if str(r.id) in self.run_ids]

    def tick(self) -> bool:
        """Signal waiting runs, serve new kinds, notice failed processes; True when all is done."""
        if self.ctx.cancelled.is_set():
            raise TrialError("the check was interrupted")
        records = self._records()
        for record in records:
            name = record.wait_signal
            if record.status == RunStatus.WAITING and name in self.ctx.options.signals:
                self.ob.signal(
                    record.id,
                    name,
                    self.ctx.options.signals[name],
                    dedup_key=f"outbox-check:{name}:{record.updated_at.isoformat()}",
                )
        if self.sink_url is not None:
            self.ctx.learn_kinds(self.ob.store.effect_kinds())
            self._serve_new_kinds()
        for proc in self.fleet.procs:
            code = proc.poll()
            if code not in (None, 0, -signal.SIGKILL) and code != -signal.SIGTERM:
                raise TrialError(
                    f"a process exited with status {code}:\n{self.fleet.log_of(proc)[-3000:]}"
                )
        finished = all(r.status.value in TERMINAL for r in records)
        self._never_signalled(records)
        counts = self.ob.store.effect_counts()
        # Anything that moved (a run, an effect, a point reached, a line a process
        # wrote: one starting up on a busy machine) is progress.
        seen = (
            tuple((r.status, r.current_step, r.attempt) for r in records),
            tuple(sorted(counts.items())),
            sum(f.stat().st_size for f in self.logs.iterdir() if f.suffix in (".log", ".jsonl")),
        )
        if seen != self._seen:
            self._seen = seen
            self._progress()
        return finished and not any(counts.get(s, 0) for s in _OPEN_EFFECTS)

    def _never_signalled(self, records: list[RunRecord]) -> None:
        """A run parked for a signal the check cannot send, and no timeout soon: stuck."""
        patience = timedelta(seconds=self.ctx.options.timeout)
        for record in records:
            name = record.wait_signal
            if (
                record.status == RunStatus.WAITING
                and name is not None
                and name not in self.ctx.options.signals
                and (record.wake_at is None or record.wake_at > datetime.now(UTC) + patience)
            ):
                raise TrialError(
                    f"run {str(record.id)[:8]} waits for signal {name!r}, which the check "
                    f"does not send: pass --signal {name}=JSON (outbox_check(..., "
                    f"signals={{{name!r}: ...}}))"
                )

    def _late(self) -> None:
        if time.monotonic() > self.deadline:
            raise TrialError(
                f"nothing moved for {self.ctx.options.timeout:g} s: {self.explain_stuck()}"
            )

    def wait_for_exit(self, proc: Process) -> bool:
        """Until ``proc`` exits (True) or every run ended and every effect settled (False).

        A process killed at its crash point is known dead: its leases are ended
        at once, rather than waited out, so the next process takes over now
        (the usual rescue and reconciliation do it, as after a lease ran out).
        """
        while True:
            if proc.poll() is not None:
                if proc.returncode == -signal.SIGKILL:
                    self.ob.store.expire_leases_of(f"%:{proc.pid}:%")
                return True
            if self.tick():
                return proc.poll() is not None
            self._late()
            time.sleep(_TICK)

    def wait_until_done(self) -> None:
        """Until every run ended and every effect settled, for a quiet moment."""
        quiet_since: float | None = None
        while True:
            if self.tick():
                quiet_since = quiet_since or time.monotonic()
                if time.monotonic() - quiet_since >= _QUIET:
                    return
            else:
                quiet_since = None
            self._late()
            time.sleep(_TICK)

    def stop_all(self) -> list[str]:
        """SIGTERM everything still running; notes on anything that did not exit cleanly."""
        notes = []
        for proc in self.fleet.alive():
            proc.send_signal(signal.SIGTERM)
        for proc in self.fleet.procs:
            try:
                code = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait(timeout=30)
                notes.append(f"process {proc.pid} ignored SIGTERM for 30 s")
            if code not in (0, -signal.SIGKILL, -signal.SIGTERM):
                notes.append(f"process {proc.pid} exited with {code}")
        return notes

    def explain_stuck(self) -> str:
        """Why the runs have not finished, in a person's words."""
        parts = []
        try:
            records = self._records()
            counts = self.ob.store.effect_counts()
        except Exception as exc:  # the explanation must not hide the timeout
            return f"(could not read the runs: {exc})"
        for record in records:
            where = f"run {str(record.id)[:8]} is {record.status.value}"
            if record.status == RunStatus.WAITING and record.wait_signal:
                hint = (
                    ""
                    if record.wait_signal in self.ctx.options.signals
                    else f" (pass --signal {record.wait_signal}=JSON)"
                )
                where += f", waiting for signal {record.wait_signal!r}{hint}"
            elif record.status == RunStatus.WAITING and record.wait_effect:
                where += f", waiting for effect {record.wait_effect}"
            elif record.status == RunStatus.WAITING and record.wake_at:
                where += f", sleeping until {record.wake_at.isoformat()}"
            elif record.current_step:
                where += f" after step {record.current_step!r}"
            parts.append(where)
        open_effects = {s: n for s, n in counts.items() if s in _OPEN_EFFECTS and n}
        if open_effects:
            parts.append(f"effects still open: {open_effects}")
        return "; ".join(parts)
