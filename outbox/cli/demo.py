"""``outbox demo``: real agents, real deliverers, real crashes, and a tally at the end.

On the embedded default, with no set-up: a local HTTP sink that honours
``Idempotency-Key`` (and says 429 a few times), two ``outbox deliver``
processes, three invoice-reconciliation runs each in its own agent process.
One agent is killed with SIGKILL mid-run and started again; one deliverer is
killed with SIGKILL while it holds calls in flight, and a new one takes its
place. The tally compares what was intended with what the sink applied.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from sqlalchemy import func, select

from outbox.cli._common import CliContext, console, emit, json_option, pass_cli, table
from outbox.client import Outbox
from outbox.schema import effect_attempts, effects

__all__ = ["COMMANDS"]

RUNS = 3


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    handle = log.open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", *args],
        env=env,
        stdout=handle,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _owner_in_flight(ob: Outbox, pid: int) -> int:
    with ob.engine.connect() as conn:
        return int(
            conn.execute(
                select(func.count())
                .select_from(effects)
                .where(effects.c.status == "in_flight", effects.c.lease_owner.like(f"%:{pid}:%"))
            ).scalar_one()
        )


def _tally(ob: Outbox, run_ids: list[Any]) -> dict[str, int]:
    mine = effects.c.run_id.in_(run_ids)
    with ob.engine.connect() as conn:
        by_status: dict[str, int] = dict(
            conn.execute(
                select(effects.c.status, func.count()).where(mine).group_by(effects.c.status)
            ).all()
        )
        outcomes: dict[str, int] = dict(
            conn.execute(
                select(effect_attempts.c.outcome, func.count())
                .join(effects, effects.c.id == effect_attempts.c.effect_id)
                .where(mine)
                .group_by(effect_attempts.c.outcome)
            ).all()
        )
    return {
        **{f"status:{k}": v for k, v in by_status.items()},
        **{f"outcome:{k}": v for k, v in outcomes.items()},
    }


@click.command("demo")
@click.option("--keep-logs", is_flag=True, help="Keep the child processes' logs and say where.")
@json_option
@pass_cli
def demo(cli: CliContext, keep_logs: bool, as_json: bool) -> None:
    """Three agent runs, two deliverers, two kill -9s: nothing lost, nothing duplicated."""
    from deliverers.testing import Fault, IdempotentHttpSink
    from outbox import demo_agent

    ob = cli.outbox
    dsn = ob.engine.url.render_as_string(hide_password=False)
    workdir = Path(tempfile.mkdtemp(prefix="outbox-demo-"))
    config = workdir / "deliverers.toml"
    config.write_text('[kinds."http.request"]\nallow_private = ["127.0.0.1"]\n')
    env = {**os.environ, "OUTBOX_DSN": dsn, "PYTHONUNBUFFERED": "1"}
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
    events: list[str] = []
    procs: list[subprocess.Popen[bytes]] = []

    with IdempotentHttpSink(latency=0.03) as sink:
        sink.inject(Fault("429", times=4, retry_after="1"))
        deliverers = [_spawn(deliver_args, env, workdir / f"deliver-{i}.log") for i in (1, 2)]
        procs += deliverers
        runs = [
            ob.start_run(demo_agent.AGENT, demo_agent.VERSION, {"month": f"2026-{m:02d}"})
            for m in (8, 9, 10)
        ]
        run_ids = [r.id for r in runs]
        agents = {
            r.id: _spawn(
                ["outbox.demo_agent", str(r.id), sink.url], env, workdir / f"agent-{i}.log"
            )
            for i, r in enumerate(runs)
        }
        procs += agents.values()
        victim_run = runs[1].id
        agent_killed = deliverer_killed = False
        progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            disable=as_json,
        )
        with progress:
            steps_task = progress.add_task("steps recorded", total=RUNS * demo_agent.STEPS)
            effects_task = progress.add_task("effects delivered", total=None)
            while True:
                time.sleep(0.05)
                recorded = [len(ob.run(r).completed_steps) for r in run_ids]
                progress.update(steps_task, completed=sum(recorded))
                tally = _tally(ob, run_ids)
                intended = sum(v for k, v in tally.items() if k.startswith("status:"))
                progress.update(
                    effects_task, total=max(intended, 1), completed=tally.get("status:succeeded", 0)
                )
                if not agent_killed and recorded[1] >= 5:
                    agents[victim_run].send_signal(signal.SIGKILL)
                    agents[victim_run].wait()
                    events.append(
                        f"agent of run {str(victim_run)[:8]} killed (SIGKILL) "
                        f"after {recorded[1]} of {demo_agent.STEPS} steps"
                    )
                    agents[victim_run] = _spawn(
                        ["outbox.demo_agent", str(victim_run), sink.url],
                        env,
                        workdir / "agent-1-resumed.log",
                    )
                    procs.append(agents[victim_run])
                    events.append("agent restarted: recorded steps replay, the rest continue")
                    agent_killed = True
                if not deliverer_killed and _owner_in_flight(ob, deliverers[0].pid) > 0:
                    deliverers[0].send_signal(signal.SIGKILL)
                    deliverers[0].wait()
                    held = "with calls in flight"
                    events.append(f"deliverer pid {deliverers[0].pid} killed (SIGKILL) {held}")
                    deliverers.append(_spawn(deliver_args, env, workdir / "deliver-3.log"))
                    procs.append(deliverers[-1])
                    events.append("a new deliverer started; expired leases are reconciled")
                    deliverer_killed = True
                done = all(ob.run(r).status.value == "completed" for r in run_ids)
                open_effects = sum(
                    tally.get(f"status:{s}", 0) for s in ("pending", "in_flight", "unknown")
                )
                if done and agent_killed and deliverer_killed and open_effects == 0:
                    break
                if time.monotonic() - started > 120:
                    raise click.ClickException(f"demo did not finish in 120s; logs in {workdir}")
                for r, proc in agents.items():
                    if proc.poll() not in (None, 0, -signal.SIGKILL):
                        raise click.ClickException(
                            f"agent of run {r} exited with {proc.returncode}; logs in {workdir}"
                        )
        for proc in deliverers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(timeout=30)
        stats = sink.stats()

    tally = _tally(ob, run_ids)
    intended = sum(v for k, v in tally.items() if k.startswith("status:"))
    delivered = tally.get("status:succeeded", 0)
    applied_keys = stats["keys_applied"]
    summary = {
        "runs_completed": sum(ob.run(r).status.value == "completed" for r in run_ids),
        "runs": RUNS,
        "effects_intended": intended,
        "effects_delivered": delivered,
        "attempts_retried": tally.get("outcome:retry", 0),
        "attempts_recovered_after_crash": tally.get("outcome:expired", 0),
        "redeliveries_seen_by_sink": stats["redeliveries"],
        "duplicates_applied_at_sink": len(stats["duplicate_keys_applied"])
        + len(stats["duplicate_operations"]),
        "lost": intended - delivered + max(0, intended - applied_keys),
        "phantom": max(0, applied_keys - intended),
        "seconds": round(time.monotonic() - started, 1),
        "events": events,
    }
    if not keep_logs:
        for path in workdir.iterdir():
            path.unlink()
        workdir.rmdir()

    def render() -> None:
        for event in events:
            console.print(f"  • {event}")
        table(
            "demo summary",
            ["", "count"],
            [
                ("runs completed", f"{summary['runs_completed']} / {RUNS}"),
                ("effects intended", intended),
                ("effects delivered", delivered),
                ("attempts retried (429 from the sink)", summary["attempts_retried"]),
                (
                    "attempts recovered after the deliverer was killed",
                    summary["attempts_recovered_after_crash"],
                ),
                ("redeliveries the sink deduplicated", summary["redeliveries_seen_by_sink"]),
                ("duplicates applied at the sink", summary["duplicates_applied_at_sink"]),
                ("lost", summary["lost"]),
                ("seconds", summary["seconds"]),
            ],
        )
        if keep_logs:
            console.print(f"logs: {workdir}")

    emit(summary, as_json, render)
    if summary["duplicates_applied_at_sink"] or summary["lost"] or summary["phantom"]:
        raise SystemExit(1)


COMMANDS = [demo]
