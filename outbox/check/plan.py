"""What a check is asked to do (:class:`CheckOptions`), and the trials it plans from a trace.

A *trial* is one scratch database, the agent's runs started in it, real
worker and deliverer processes, some of them armed to die at a crash point,
and at the end the invariant checker. The first trial is uninterrupted and
traced: the points it reached, and where (which step), become the plan.

Worker points are tried as a *chain*: the first worker dies at the point's
first occurrence, the worker that resumes the run dies at the second, and so
on, so one trial crosses every step at that point. A chain that fails is
split into single crashes to find the first one that fails alone.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from outbox.check.crash import (
    DELIVERER_POINTS,
    UPGRADE_POINTS,
    WORKER_POINTS,
    TraceEvent,
    occurrences,
    target,
)
from outbox.storage.dsn import redacted_dsn

__all__ = ["CheckOptions", "Role", "TrialPlan", "handover_target", "plan_trials", "select"]

Role = Literal["baseline", "worker", "deliverer", "handover", "upgrade"]
_PATH = r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$"


class CheckOptions(BaseModel):
    """Everything ``outbox check`` (and the ``outbox_check`` fixture) is asked."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: The agent's handler, ``package.module:function`` (called as ``handler(run)``).
    handler: str = Field(pattern=_PATH)
    agent: str = Field(min_length=1, max_length=200)
    version: str = Field(min_length=1, max_length=200)
    #: The inputs of every run (JSON).
    inputs: Any = Field(default_factory=dict)
    #: Runs started in each trial (they share the worker, and its crashes).
    runs: int = Field(default=1, ge=1, le=50)
    #: ``record``: a recording sink stands in for every kind; ``real``: the deliverers config.
    sink: Literal["record", "real"] = "record"
    #: A server to make scratch databases on (None: a temporary embedded one).
    dsn: str | None = None
    #: The deliverers config: used as is with ``sink="real"``; with ``record`` only
    #: its declarations (``idempotent``, a lookup) are copied onto the stand-ins.
    config: Path | None = None
    #: Signals to send a run that waits for them: name -> payload.
    signals: dict[str, Any] = Field(default_factory=dict)
    upgrade_to: str | None = Field(default=None, min_length=1, max_length=200)
    #: ``module:function`` called with the Outbox by new-version workers (registers the upgrade).
    setup: str | None = Field(default=None, pattern=_PATH)
    #: The new version's handler (default: ``handler``).
    upgrade_handler: str | None = Field(default=None, pattern=_PATH)
    #: Only these trials (ids as a report prints them, e.g. ``step_end@charge``).
    only: tuple[str, ...] = ()
    #: Trials run at once.
    jobs: int = Field(default=4, ge=1, le=32)
    #: Seconds a trial may go with nothing moving (no run, effect or crash point) before
    #: it is reported as stuck.
    timeout: float = Field(default=120.0, gt=0, le=3600)
    #: Two uninterrupted runs of the same inputs may end differently (a result that
    #: legitimately varies, such as a recorded timestamp); results are then not
    #: compared. By default that is a ``nondeterministic_result`` violation.
    allow_nondeterministic_result: bool = False

    @field_validator("inputs", "signals")
    @classmethod
    def _json(cls, value: Any) -> Any:
        try:
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"must be JSON: {exc}") from None
        return value

    def model_post_init(self, context: Any, /) -> None:
        """An upgrade needs both its version and its setup."""
        if (self.upgrade_to is None) != (self.setup is None):
            raise ValueError("--upgrade-to and --setup go together")
        if self.upgrade_to is not None and self.upgrade_to == self.version:
            raise ValueError(f"--upgrade-to {self.upgrade_to!r} is the version being checked")

    def command(self, only: str | None = None) -> str:
        """The ``outbox check`` command line for these options (``only`` one trial)."""
        args = [
            "outbox",
            "check",
            self.handler,
            "--agent",
            self.agent,
            "--version",
            self.version,
            "--inputs",
            json.dumps(self.inputs, separators=(",", ":")),
        ]
        if self.runs != 1:
            args += ["--runs", str(self.runs)]
        if self.sink != "record":
            args += ["--sink", self.sink]
        if self.config is not None:
            args += ["--config", str(self.config)]
        if self.dsn is not None:
            args += ["--dsn", redacted_dsn(self.dsn)]
        for name, payload in self.signals.items():
            args += ["--signal", f"{name}={json.dumps(payload, separators=(',', ':'))}"]
        if self.upgrade_to is not None and self.setup is not None:
            args += ["--upgrade-to", self.upgrade_to, "--setup", self.setup]
        if self.upgrade_handler is not None:
            args += ["--upgrade-handler", self.upgrade_handler]
        if self.allow_nondeterministic_result:
            args.append("--allow-nondeterministic-result")
        for trial in (only,) if only else self.only:
            args += ["--only", trial]
        return shlex.join(args)


@dataclass(frozen=True)
class TrialPlan:
    """One trial: which process dies where."""

    id: str
    role: Role
    point: str | None = None
    #: Worker chains: the places (step ids) to die at, one worker each, in order.
    targets: tuple[str, ...] = ()
    #: Upgrade trials: where the old-version worker dies to hand its runs over.
    handover: str | None = None

    @property
    def chain(self) -> bool:
        """A worker chain of more than one crash."""
        return len(self.targets) > 1

    def singles(self) -> list[TrialPlan]:
        """The chain split into one trial per crash."""
        return [
            TrialPlan(target(self.point or "", where), self.role, self.point, (where,))
            for where in self.targets
        ]


BASELINE = TrialPlan("uninterrupted", "baseline")


def handover_target(events: Sequence[TraceEvent], first_run: str | None) -> str | None:
    """Where an old-version worker hands over: parked in a wait if the agent waits, else mid-run."""
    parked = occurrences(events, "parked", first_run)
    if parked:
        return target("parked", parked[0])
    steps = occurrences(events, "after_step", first_run)
    if not steps:
        return None
    return target("after_step", steps[(len(steps) - 1) // 2])


def plan_trials(
    events: Sequence[TraceEvent], first_run: str | None, options: CheckOptions
) -> list[TrialPlan]:
    """Every trial the uninterrupted trace calls for (points never reached get none)."""
    plans: list[TrialPlan] = []
    for point in WORKER_POINTS:
        wheres = occurrences(events, point.name, first_run)
        if wheres:
            plans.append(TrialPlan(point.name, "worker", point.name, tuple(wheres)))
    for point in DELIVERER_POINTS:
        if any(e.point == point.name for e in events):
            plans.append(TrialPlan(point.name, "deliverer", point.name))
    if options.upgrade_to is not None:
        handover = handover_target(events, first_run)
        if handover is not None:
            plans.append(TrialPlan("handover", "handover", None, (), handover))
            for point in UPGRADE_POINTS:
                plans.append(TrialPlan(point.name, "upgrade", point.name, (), handover))
    return plans


def select(plans: Sequence[TrialPlan], only: Sequence[str]) -> list[TrialPlan]:
    """The plans ``only`` names: a point (its whole chain) or ``point@where`` (one crash)."""
    if not only:
        return list(plans)
    chosen: list[TrialPlan] = []
    for wanted in only:
        for plan in plans:
            if plan.id == wanted:
                chosen.append(plan)
            elif plan.role == "worker" and wanted in {s.id for s in plan.singles()}:
                chosen.append(next(s for s in plan.singles() if s.id == wanted))
    # an upgrade trial needs the hand-over trial as its reference
    if any(p.role == "upgrade" for p in chosen) and not any(p.role == "handover" for p in chosen):
        chosen += [p for p in plans if p.role == "handover"]
    return chosen
