"""The story ``outbox demo`` tells: its processes, its crashes, and what it is waiting for.

Everything here looks at the demo's own runs and their effects only: a
database reused after the quickstart, after a demo stopped with Ctrl-C or
beside a running ``outbox deliver`` holds other work, which the demo neither
waits for nor counts. What it cannot keep out (a deliverer it did not start,
serving ``http.request`` to loopback, delivering some of its effects) it
notices and says.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from outbox.client import Outbox
from outbox.models import TERMINAL_EFFECT_STATUSES, RunStatus

__all__ = ["Demo", "Snapshot"]

#: Run statuses that end each of the demo's stories.
_DONE = {
    "reconcile": {RunStatus.COMPLETED},
    "approval": {RunStatus.COMPLETED},
    "trip": {RunStatus.COMPENSATED, RunStatus.COMPENSATION_FAILED},
}
#: Deliverers the story kills at most, looking for one killed with calls in flight.
MAX_DELIVERER_KILLS = 3


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as handle:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", *args],
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@dataclass(frozen=True)
class Snapshot:
    """One look at the demo's runs and effects."""

    #: Status of each of the demo's runs.
    statuses: dict[uuid.UUID, RunStatus]
    #: The demo's effects by status, attempt-log rows by outcome, successes by worker.
    tally: dict[str, dict[str, int]]
    #: Steps completed by each reconciliation run not yet done.
    steps: dict[uuid.UUID, int]

    @property
    def effects_intended(self) -> int:
        """How many effects the demo's runs intended so far."""
        return sum(self.tally["status"].values())

    @property
    def effects_done(self) -> int:
        """How many of them reached a terminal status."""
        return sum(n for s, n in self.tally["status"].items() if s in TERMINAL_EFFECT_STATUSES)

    @property
    def open_effects(self) -> dict[str, int]:
        """The others, by status."""
        return {s: n for s, n in self.tally["status"].items() if s not in TERMINAL_EFFECT_STATUSES}


@dataclass
class Demo:
    """The demo's processes and the state of its five runs."""

    ob: Outbox
    sink: Any
    workdir: Path
    env: dict[str, str]
    deliver_args: list[str]
    events: list[str] = field(default_factory=list)
    #: Said to the user as it happens (the caller prints and clears them).
    notes: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    deliverers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    agents: dict[uuid.UUID, subprocess.Popen[bytes]] = field(default_factory=dict)
    reconciliations: list[uuid.UUID] = field(default_factory=list)
    months: dict[uuid.UUID, str] = field(default_factory=dict)
    approval: uuid.UUID | None = None
    trip: uuid.UUID | None = None
    worker: subprocess.Popen[bytes] | None = None
    agent_killed: bool = False
    deliverer_killed: bool = False
    deliverer_kills: int = 0
    approved_at: float | None = None
    waiting_since: float | None = None
    cancelled: bool = False
    #: Deliverers the demo did not start: running on its database when it began,
    #: or seen delivering its effects (lease owner → effects it delivered).
    others: dict[str, int] = field(default_factory=dict)

    def spawn(self, args: list[str], name: str) -> subprocess.Popen[bytes]:
        """Start ``python -m ARGS`` in a session of its own, logging to ``NAME.log``."""
        proc = _spawn(args, self.env, self.workdir / f"{name}.log")
        self.procs.append(proc)
        return proc

    def agent(self, run_id: uuid.UUID, name: str) -> None:
        """Start (or start again) the agent process of a reconciliation run."""
        self.agents[run_id] = self.spawn(["outbox.demo.agent", str(run_id), self.sink.url], name)

    @property
    def run_ids(self) -> list[uuid.UUID]:
        """The demo's runs: the only ones it waits for and counts."""
        extra = [r for r in (self.approval, self.trip) if r is not None]
        return [*self.reconciliations, *extra]

    def story_of(self, run_id: uuid.UUID) -> str:
        """Which of the three stories a run tells."""
        if run_id == self.approval:
            return "approval"
        return "trip" if run_id == self.trip else "reconcile"

    def look_for_other_deliverers(self) -> None:
        """Before starting: deliverers already serving this database may take the demo's work."""
        for owner in self.ob.store.deliverers.live_owners():
            self.others.setdefault(owner, 0)
        if self.others:
            pids = ", ".join(_pid(o) for o in self.others)
            self.notes.append(
                f"note: {len(self.others)} deliverer(s) the demo did not start already serve "
                f"this database (pid {pids}); one whose config allows 127.0.0.1 for "
                "http.request will deliver some of the demo's effects, counted apart in the "
                "tally. Stop it for the demo's own story (two deliverers, one killed)."
            )

    def start(self) -> None:
        """Start two deliverers, the agents, the worker and the five runs."""
        from outbox.demo import agent as demo_agent

        self.deliverers = [self.spawn(self.deliver_args, f"deliver-{i}") for i in (1, 2)]
        for month in (8, 9, 10):
            run = self.ob.start_run(
                demo_agent.AGENT, demo_agent.VERSION, {"month": f"2026-{month:02d}"}
            )
            self.reconciliations.append(run.id)
            self.months[run.id] = f"2026-{month:02d}"
            self.agent(run.id, f"agent-{month}")
        # The approval run belongs to a worker: parked while it waits, it holds nothing.
        self.worker = self.spawn(
            [
                "outbox",
                "worker",
                "outbox.demo.agent:pay_vendor",
                "--agent",
                "vendor-payments",
                "--version",
                "1.0.0",
            ],
            "worker",
        )
        self.approval = self.ob.start_run(
            "vendor-payments", "1.0.0", {"vendor": "ACME", "sink": self.sink.url}
        ).id
        trip = self.ob.start_run("trip-booking", "1.0.0", {"to": "LIS"})
        self.trip = trip.id
        demo_agent.book_trip(trip, self.sink.url)

    def look(self) -> Snapshot:
        """The demo's runs and effects now."""
        statuses = {r: self.ob.run(r).status for r in self.run_ids}
        steps = {
            r: len(self.ob.run(r).completed_steps)
            for r in self.reconciliations
            if statuses[r] not in _DONE["reconcile"]
        }
        return Snapshot(statuses, self.ob.store.deliverers.tally(self.run_ids), steps)

    def finished(self, now: Snapshot) -> bool:
        """Every run at the end of its story and every effect of them terminal."""
        runs_done = all(s in _DONE[self.story_of(r)] for r, s in now.statuses.items())
        return runs_done and not now.open_effects

    def waiting_for(self, now: Snapshot) -> tuple[list[str], str]:
        """The runs not done yet (each in a few words), and the open effects by status."""
        from outbox.demo import agent as demo_agent

        runs = []
        for run_id, status in now.statuses.items():
            story = self.story_of(run_id)
            if status in _DONE[story]:
                continue
            if story == "reconcile":
                steps = now.steps.get(run_id, 0)
                runs.append(f"invoices {self.months[run_id]} step {steps}/{demo_agent.STEPS}")
            elif story == "approval":
                runs.append(f"payment {status.value}")
            else:
                runs.append(f"trip {status.value}")
        effects = ", ".join(f"{n} {s}" for s, n in sorted(now.open_effects.items()))
        return runs, effects

    def advance(self, now: Snapshot) -> None:
        """Move every story on: the kills, the approval, the cancellation, other deliverers."""
        self._kill_an_agent()
        self._kill_a_deliverer()
        self._approve(now)
        self._cancel_the_trip()
        self._notice_other_deliverers(now)

    def _kill_an_agent(self) -> None:
        from outbox.demo import agent as demo_agent

        victim = self.reconciliations[1]
        if self.agent_killed or len(self.ob.run(victim).completed_steps) < 5:
            return
        if self.agents[victim].poll() is not None:
            return  # finished already: nothing left to interrupt
        self.agents[victim].send_signal(signal.SIGKILL)
        self.agents[victim].wait()
        steps = len(self.ob.run(victim).completed_steps)
        self.events.append(
            f"agent of run {victim} killed (SIGKILL) after {steps} of {demo_agent.STEPS} "
            "steps; restarted: recorded steps replay, the rest continue"
        )
        self.agent(victim, "agent-resumed")
        self.agent_killed = True

    def _kill_a_deliverer(self) -> None:
        living = [p for p in self.deliverers if p.poll() is None]
        if self.deliverer_killed or self.deliverer_kills >= MAX_DELIVERER_KILLS or not living:
            return
        victim, reads = living[0], self.ob.store.deliverers
        if reads.in_flight_of(f"%:{victim.pid}:%") == 0:
            return
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        self.deliverer_kills += 1
        self.deliverers.append(self.spawn(self.deliver_args, f"deliver-{len(self.deliverers) + 1}"))
        # Counted again now that it can change nothing: its calls take 30 ms, and a kill
        # that landed just after they were recorded left nothing to recover (the story
        # then kills the next deliverer that holds calls).
        held = reads.in_flight_of(f"%:{victim.pid}:%")
        if held == 0:
            return
        self.events.append(
            f"deliverer {victim.pid} killed (SIGKILL) holding {held} calls in "
            "flight; a new deliverer started, expired leases reconciled"
        )
        self.deliverer_killed = True
        # Now, not at the start: the 429s answered to the deliverer just killed
        # died with its unwritten outcomes, and the tally showed no retry.
        from deliverers.testing import Fault

        self.sink.inject(Fault("429", times=4, retry_after="1"))

    def _approve(self, now: Snapshot) -> None:
        assert self.approval is not None
        if self.approved_at is not None or now.statuses[self.approval] != RunStatus.WAITING:
            return
        self.waiting_since = self.waiting_since or time.monotonic()
        if time.monotonic() - self.waiting_since <= 1.0:
            return
        self.ob.signal(
            self.approval, "approval", {"by": "cfo@example.com"}, dedup_key="approval-mail-1"
        )
        self.approved_at = time.monotonic()
        self.events.append(
            "vendor payment parked (status waiting: no lease, no "
            "process) until the CFO's approval signal woke it"
        )

    def _cancel_the_trip(self) -> None:
        assert self.trip is not None
        if self.cancelled:
            return
        bookings = self.ob.effects(run_id=self.trip)
        if len(bookings) != 3 or any(e.status.value != "succeeded" for e in bookings):
            return
        status = self.ob.cancel(self.trip, "customer cancelled the trip")
        self.events.append(
            f"trip booking cancelled after 3 bookings succeeded ({status.value})"
            "; refunds go out newest first"
        )
        self.cancelled = True

    def _notice_other_deliverers(self, now: Snapshot) -> None:
        for owner, delivered in now.tally.get("worker", {}).items():
            if owner is None or self._mine(owner):
                continue
            if not self.others.get(owner):
                self.events.append(
                    f"a deliverer the demo did not start (pid {_pid(owner)}) is delivering "
                    "the demo's effects: it serves http.request on this database"
                )
                self.notes.append(f"note: {self.events[-1]}")
            self.others[owner] = delivered

    def _mine(self, owner: str) -> bool:
        host, _, rest = owner.partition(":")
        pid = rest.partition(":")[0]
        return host == socket.gethostname() and pid in {str(p.pid) for p in self.deliverers}

    def unfinished_stories(self) -> None:
        """Say which crash of the story did not happen (another deliverer took the work, say)."""
        if self.deliverer_killed:
            return
        if self.deliverer_kills:
            self.events.append(
                f"{self.deliverer_kills} deliverer(s) killed, each just after its calls were "
                "recorded: nothing was left to recover"
            )
        else:
            self.events.append(
                "no deliverer was killed: the demo's first deliverer never held a call in "
                "flight (deliverers the demo did not start took the work)"
            )

    def check_processes(self) -> None:
        """A child that died by itself ends the demo with the reason and where its log is."""
        for run_id, proc in self.agents.items():
            if proc.poll() not in (None, 0, -signal.SIGKILL):
                raise click.ClickException(
                    f"agent of run {run_id} exited with {proc.returncode}; logs in {self.workdir}"
                )
        living = [p for p in self.deliverers if p.returncode != -signal.SIGKILL]
        for proc in [*living, *([self.worker] if self.worker else [])]:
            if proc.poll() is not None:
                what = "worker" if proc is self.worker else "deliverer"
                raise click.ClickException(
                    f"{what} {proc.pid} exited with {proc.returncode}; logs in {self.workdir}"
                )

    def stop(self) -> None:
        """Stop every process still running (agents too, after Ctrl-C)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def own_keys(self) -> list[str]:
        """The idempotency keys of the demo's effects."""
        return [
            e.idempotency_key for r in self.run_ids for e in self.ob.effects(run_id=r, limit=10_000)
        ]


def _pid(owner: str) -> str:
    """The process id in a lease owner (``host:pid:suffix``)."""
    return owner.split(":")[1] if owner.count(":") >= 2 else owner
