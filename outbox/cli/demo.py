"""``outbox demo``: real agents, real deliverers, real crashes, and a tally at the end.

On the embedded default, with no set-up: a local HTTP sink that honours
``Idempotency-Key`` (and answers 429 a few times), two ``outbox deliver``
processes, and five runs:

- three invoice reconciliations, each in its own agent process; one agent is
  killed with SIGKILL mid-run and started again; one deliverer is killed with
  SIGKILL while it holds calls in flight, and a new one takes its place;
- a vendor payment that waits for the CFO's approval (a signal), at zero
  compute, then pays;
- a trip booking that is cancelled after its bookings went through: the
  bookings are compensated (refunded) in reverse order.

The tally compares what was intended with what the sink applied.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from outbox.cli._common import CliContext, console, emit, json_option, pass_cli, table
from outbox.cli.reports import DemoReport
from outbox.client import Outbox
from outbox.models import TERMINAL_EFFECT_STATUSES, RunStatus

__all__ = ["COMMANDS"]

TIME_LIMIT = 120.0


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as handle:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", *args],
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@dataclass
class _Demo:
    ob: Outbox
    sink: Any
    workdir: Path
    env: dict[str, str]
    deliver_args: list[str]
    events: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    deliverers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    agents: dict[uuid.UUID, subprocess.Popen[bytes]] = field(default_factory=dict)
    reconciliations: list[uuid.UUID] = field(default_factory=list)
    approval: uuid.UUID | None = None
    trip: uuid.UUID | None = None
    worker: subprocess.Popen[bytes] | None = None
    agent_killed: bool = False
    deliverer_killed: bool = False
    approved_at: float | None = None
    waiting_since: float | None = None
    cancelled: bool = False

    def spawn(self, args: list[str], name: str) -> subprocess.Popen[bytes]:
        proc = _spawn(args, self.env, self.workdir / f"{name}.log")
        self.procs.append(proc)
        return proc

    def agent(self, run_id: uuid.UUID, name: str) -> None:
        self.agents[run_id] = self.spawn(["outbox.demo.agent", str(run_id), self.sink.url], name)

    @property
    def run_ids(self) -> list[uuid.UUID]:
        extra = [r for r in (self.approval, self.trip) if r is not None]
        return [*self.reconciliations, *extra]

    def start(self) -> None:
        from outbox.demo import agent as demo_agent

        self.deliverers = [self.spawn(self.deliver_args, f"deliver-{i}") for i in (1, 2)]
        for month in (8, 9, 10):
            run = self.ob.start_run(
                demo_agent.AGENT, demo_agent.VERSION, {"month": f"2026-{month:02d}"}
            )
            self.reconciliations.append(run.id)
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

    def in_flight_of(self, pid: int) -> int:
        return self.ob.store.in_flight_of(f"%:{pid}:%")

    def tick(self) -> bool:
        """Move every story on; True when all are done."""
        from outbox.demo import agent as demo_agent

        victim = self.reconciliations[1]
        if not self.agent_killed and len(self.ob.run(victim).completed_steps) >= 5:
            self.agents[victim].send_signal(signal.SIGKILL)
            self.agents[victim].wait()
            steps = len(self.ob.run(victim).completed_steps)
            self.events.append(
                f"agent of run {str(victim)[:8]} killed (SIGKILL) after "
                f"{steps} of {demo_agent.STEPS} steps; restarted: recorded "
                "steps replay, the rest continue"
            )
            self.agent(victim, "agent-resumed")
            self.agent_killed = True
        first = self.deliverers[0]
        if not self.deliverer_killed and self.in_flight_of(first.pid) > 0:
            held = self.in_flight_of(first.pid)
            first.send_signal(signal.SIGKILL)
            first.wait()
            self.events.append(
                f"deliverer {first.pid} killed (SIGKILL) holding {held} calls in "
                "flight; a new deliverer started, expired leases reconciled"
            )
            self.deliverers.append(self.spawn(self.deliver_args, "deliver-3"))
            self.deliverer_killed = True
            # Now, not at the start: the 429s answered to the deliverer just killed
            # died with its unwritten outcomes, and the tally showed no retry.
            from deliverers.testing import Fault

            self.sink.inject(Fault("429", times=4, retry_after="1"))
        assert self.approval is not None and self.trip is not None
        approval = self.ob.run(self.approval)
        if self.approved_at is None and approval.status == RunStatus.WAITING:
            self.waiting_since = self.waiting_since or time.monotonic()
            if time.monotonic() - self.waiting_since > 1.0:
                self.ob.signal(
                    self.approval,
                    "approval",
                    {"by": "cfo@example.com"},
                    dedup_key="approval-mail-1",
                )
                self.approved_at = time.monotonic()
                self.events.append(
                    "vendor payment parked (status waiting: no lease, no "
                    "process) until the CFO's approval signal woke it"
                )
        if not self.cancelled and self._bookings_done():
            status = self.ob.cancel(self.trip, "customer cancelled the trip")
            self.events.append(
                f"trip booking cancelled after 3 bookings succeeded ({status.value})"
                "; refunds go out newest first"
            )
            self.cancelled = True
        finished = all(
            self.ob.run(r).status == RunStatus.COMPLETED
            for r in [*self.reconciliations, self.approval]
        ) and self.ob.run(self.trip).status in (
            RunStatus.COMPENSATED,
            RunStatus.COMPENSATION_FAILED,
        )
        open_effects = self.ob.effects(status="pending", limit=1) + self.ob.effects(
            status="in_flight", limit=1
        )
        return finished and self.agent_killed and self.deliverer_killed and not open_effects

    def _bookings_done(self) -> bool:
        assert self.trip is not None
        bookings = self.ob.effects(run_id=self.trip)
        return len(bookings) == 3 and all(e.status.value == "succeeded" for e in bookings)

    def check_agents(self) -> None:
        for run_id, proc in self.agents.items():
            if proc.poll() not in (None, 0, -signal.SIGKILL):
                raise click.ClickException(
                    f"agent of run {run_id} exited with {proc.returncode}; logs in {self.workdir}"
                )

    def stop(self) -> None:
        for proc in [*self.deliverers, *([self.worker] if self.worker else [])]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()

    def tally(self) -> dict[str, int]:
        counts = self.ob.store.tally(self.run_ids)
        return {
            **{f"status:{k}": v for k, v in counts["status"].items()},
            **{f"outcome:{k}": v for k, v in counts["outcome"].items()},
        }


@click.command("demo")
@click.option("--keep-logs", is_flag=True, help="Keep the child processes' logs and say where.")
@json_option(DemoReport)
@pass_cli
def demo(cli: CliContext, keep_logs: bool, as_json: bool) -> None:
    """Five agent runs, two deliverers, two kill -9s: nothing lost, nothing duplicated."""
    from deliverers.testing import IdempotentHttpSink

    ob = cli.outbox
    workdir = Path(tempfile.mkdtemp(prefix="outbox-demo-"))
    config = workdir / "deliverers.toml"
    config.write_text('[kinds."http.request"]\nallow_private = ["127.0.0.1"]\n')
    env = {
        **os.environ,
        "OUTBOX_DSN": ob.engine.url.render_as_string(hide_password=False),
        "PYTHONUNBUFFERED": "1",
    }
    deliver_args = [
        "outbox",
        "deliver",
        "--config",
        str(config),
        "--concurrency",
        "16",
        "--lease",
        "2",
        "--poll",
        "0.5",
        "--grace",
        "5",
    ]
    started = time.monotonic()
    with IdempotentHttpSink(latency=0.03) as sink:
        story = _Demo(ob, sink, workdir, env, deliver_args)
        progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            disable=as_json,
        )
        try:
            with progress:
                story.start()
                runs_task = progress.add_task("runs finished", total=len(story.run_ids))
                effects_task = progress.add_task("effects delivered", total=None)
                while not story.tick():
                    tally = story.tally()
                    intended = sum(v for k, v in tally.items() if k.startswith("status:"))
                    done = sum(
                        v
                        for k, v in tally.items()
                        if k.removeprefix("status:") in TERMINAL_EFFECT_STATUSES
                    )
                    progress.update(effects_task, total=max(intended, 1), completed=done)
                    progress.update(
                        runs_task,
                        completed=sum(
                            ob.run(r).status.value in ("completed", "compensated")
                            for r in story.run_ids
                        ),
                    )
                    story.check_agents()
                    if time.monotonic() - started > TIME_LIMIT:
                        raise click.ClickException(
                            f"demo did not finish in {TIME_LIMIT:.0f}s; logs in {workdir}"
                        )
                    time.sleep(0.05)
                progress.update(runs_task, completed=len(story.run_ids))
                progress.update(effects_task, completed=progress.tasks[effects_task].total)
        finally:
            story.stop()
        stats = sink.stats()
    summary = _summary(story, stats, time.monotonic() - started)
    if not keep_logs:
        for path in workdir.iterdir():
            path.unlink()
        workdir.rmdir()
    emit(summary, as_json, lambda: _render(summary, workdir if keep_logs else None))
    if summary.duplicates_applied_at_sink or summary.lost or summary.phantom:
        raise SystemExit(1)


def _summary(story: _Demo, stats: dict[str, Any], seconds: float) -> DemoReport:
    tally = story.tally()
    intended = sum(v for k, v in tally.items() if k.startswith("status:"))
    # compensated effects were applied, then undone by their refunds
    applied = tally.get("status:succeeded", 0) + tally.get("status:compensated", 0)
    statuses = {r: story.ob.run(r).status.value for r in story.run_ids}
    return DemoReport(
        runs=len(story.run_ids),
        runs_completed=sum(s == "completed" for s in statuses.values()),
        runs_compensated=sum(s == "compensated" for s in statuses.values()),
        effects_intended=intended,
        effects_delivered=applied,
        attempts_retried=tally.get("outcome:retry", 0),
        attempts_recovered_after_crash=tally.get("outcome:expired", 0),
        redeliveries_seen_by_sink=stats["redeliveries"],
        duplicates_applied_at_sink=len(stats["duplicate_keys_applied"])
        + len(stats["duplicate_operations"]),
        lost=(intended - applied) + max(0, applied - stats["keys_applied"]),
        phantom=max(0, stats["keys_applied"] - applied),
        seconds=round(seconds, 1),
        events=story.events,
    )


def _render(summary: DemoReport, logs: Path | None) -> None:
    for event in summary.events:
        console.print(f"  • {event}")
    table(
        "demo summary",
        ["", "count"],
        [
            ("runs completed", f"{summary.runs_completed} / {summary.runs}"),
            ("runs cancelled and compensated", summary.runs_compensated),
            ("effects intended", summary.effects_intended),
            ("effects delivered", summary.effects_delivered),
            ("attempts retried (429 from the sink)", summary.attempts_retried),
            (
                "attempts recovered after the deliverer was killed",
                summary.attempts_recovered_after_crash,
            ),
            ("redeliveries the sink deduplicated", summary.redeliveries_seen_by_sink),
            ("duplicates applied at the sink", summary.duplicates_applied_at_sink),
            ("lost", summary.lost),
            ("seconds", summary.seconds),
        ],
    )
    if logs is not None:
        console.print(f"logs: {logs}")


COMMANDS = [demo]
