"""What an uninterrupted run did, and how a crashed run's evidence is compared with it.

Two runs of the same inputs differ in what they cannot help: their ids, the
keys derived from them, the port of the sink they post to. :func:`masker`
masks those, so business operations and results can be compared across runs.
A :class:`Reference` holds, per run of the uninterrupted trial, how often
each operation was intended and applied, which reached the sink without a key,
and how the run ended; :func:`expectations` turns it into the counts a trial
with its own run ids must match.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from outbox.check.invariants import Applied, Intent, Normalize
from outbox.models import TERMINAL_RUN_STATUSES
from outbox.runs.run import Run

__all__ = [
    "GLOBAL",
    "Expectations",
    "Reference",
    "RunOutcome",
    "differences",
    "disagreements",
    "expectations",
    "masker",
    "outcome_of",
    "split",
    "tag_operations",
]

_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_KEY = re.compile(r"\b[0-9a-f]{64}\b")
#: The tag of an operation that names no run of the trial.
GLOBAL = "*"


def masker(sink_url: str | None = None) -> Normalize:
    """Mask ids (``<id>``), derived keys (``<key>``) and the sink's address (``<sink>``)."""

    def normalize(text: str) -> str:
        if sink_url:
            text = text.replace(sink_url, "<sink>")
        return _KEY.sub("<key>", _UUID.sub("<id>", text))

    return normalize


def _mask(value: Any, normalize: Normalize) -> Any:
    return json.loads(normalize(json.dumps(value, sort_keys=True, default=str)))


@dataclass(frozen=True)
class RunOutcome:
    """How a run ended, masked for comparison."""

    status: str
    version: str
    result: Any
    error: Any
    state: Any
    steps: tuple[str, ...]
    upgrades: int

    def as_dict(self) -> dict[str, Any]:
        """JSON-able."""
        return {
            "status": self.status,
            "version": self.version,
            "result": self.result,
            "error": self.error,
            "state": self.state,
            "steps": list(self.steps),
            "upgrades": self.upgrades,
        }


def outcome_of(run: Run, normalize: Normalize) -> RunOutcome:
    """The masked outcome of ``run`` as it stands."""
    record = run.record
    error = record.error
    if isinstance(error, dict):  # a traceback differs in line numbers and addresses
        error = {k: v for k, v in error.items() if k in ("step", "type", "message")}
    return RunOutcome(
        status=record.status.value,
        version=record.agent_version,
        result=_mask(record.result, normalize),
        error=_mask(error, normalize),
        state=_mask(record.state, normalize),
        steps=tuple(normalize(s) for s in run.completed_steps),
        upgrades=len(record.upgrades),
    )


def _short(value: Any, width: int = 120) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= width else text[: width - 1] + "…"


def differences(
    expected: RunOutcome, actual: RunOutcome, expected_as: str = "uninterrupted"
) -> list[str]:
    """What differs, one line per field (``expected_as`` names the expected side)."""
    found = []
    for name in ("status", "version", "result", "error", "state", "steps", "upgrades"):
        want, got = getattr(expected, name), getattr(actual, name)
        if want != got:
            if name == "steps":
                missing = [s for s in want if s not in got]
                extra = [s for s in got if s not in want]
                found.append(
                    f"steps: {len(got)} recorded ({expected_as}: {len(want)})"
                    + (f"; missing {missing[:5]}" if missing else "")
                    + (f"; extra {extra[:5]}" if extra else "")
                    + ("; in another order" if not missing and not extra else "")
                )
            else:
                found.append(f"{name}: {_short(got)} ({expected_as}: {_short(want)})")
    return found


def _key(outcome: RunOutcome) -> str:
    return json.dumps(outcome.as_dict(), sort_keys=True, default=str)


def disagreements(outcomes: Mapping[str, RunOutcome]) -> list[str]:
    """How runs of the same inputs that should end alike differ from the first of them.

    One line per run that ended otherwise, naming both runs (by their place:
    ids started in the same millisecond share their first 12 digits) and every
    field that differs. Empty when they all ended alike (or there is one run).
    """
    if len(outcomes) < 2:
        return []
    (first_id, first), *others = outcomes.items()
    return [
        f"run {place} ({run_id}) ended otherwise than run 1 ({first_id}): "
        + "; ".join(differences(first, outcome, expected_as="run 1"))
        for place, (run_id, outcome) in enumerate(others, start=2)
        if _key(outcome) != _key(first)
    ]


_ENDED = frozenset(s.value for s in TERMINAL_RUN_STATUSES)


def failed_references(outcomes: Mapping[str, RunOutcome]) -> list[str]:
    """Runs of a reference trial that ended otherwise than ``completed``, with their error.

    A reference that fails is nothing to compare a crashed run with: a check of
    it would pass whatever the crashes did.
    """
    found = []
    for run_id, outcome in outcomes.items():
        if outcome.status in _ENDED and outcome.status != "completed":
            error = outcome.error
            if isinstance(error, dict):
                error = ": ".join(str(error[k]) for k in ("type", "message") if error.get(k))
            said = f": {_short(error, 300)}" if error else ""
            found.append(f"run {run_id} ended {outcome.status}{said}")
    return found


def unstable_step_ids(steps: Mapping[str, Sequence[str]], sink_url: str | None = None) -> list[str]:
    """Where runs of the same inputs, side by side, recorded different step ids.

    Each run's own id is masked (a step id may name its run), nothing else: a
    random or time-dependent part, masked for the results' comparison, is
    exactly what makes a step id change between attempts.
    """
    if len(steps) < 2:
        return []

    def shown(run_id: str, ids: Sequence[str]) -> list[str]:
        out = [s.replace(run_id, "<run>") for s in ids]
        return [s.replace(sink_url, "<sink>") for s in out] if sink_url else out

    (first_id, first_steps), *others = steps.items()
    expected = shown(first_id, first_steps)
    found = []
    for place, (run_id, ids) in enumerate(others, start=2):
        actual = shown(run_id, ids)
        if actual == expected:
            continue
        at = next(
            (i for i, (a, b) in enumerate(zip(expected, actual, strict=False)) if a != b),
            min(len(expected), len(actual)),
        )
        theirs = actual[at] if at < len(actual) else "(no step)"
        ours = expected[at] if at < len(expected) else "(no step)"
        found.append(
            f"step {at + 1}: run {place} ({run_id}) recorded {theirs!r} where run 1 "
            f"({first_id}) recorded {ours!r}"
        )
    return found


def _tag(text: str | None, run_ids: Sequence[str]) -> str:
    if text:
        for run_id in run_ids:
            if run_id in text:
                return run_id
    return GLOBAL


def tag_operations(
    intents: Iterable[Intent], applied: Iterable[Applied], run_ids: Sequence[str]
) -> tuple[list[Intent], list[Applied]]:
    """Prefix each operation with the run it belongs to (``<run id>|op``, or ``*|op``).

    An intent belongs to its run; a run-less one (``Outbox.transaction``), like a
    request at the sink, to the run its payload names, if any: an agent that
    intends outside its steps is then compared run by run, as its sink sees it.
    """
    tagged_intents = [
        replace(
            i,
            operation=f"{i.run if i.run in run_ids else _tag(i.payload, run_ids)}|{i.operation}",
        )
        for i in intents
    ]
    tagged_applied = [
        replace(a, operation=f"{_tag(a.body, run_ids)}|{a.operation}") for a in applied
    ]
    return tagged_intents, tagged_applied


def split(operation: str) -> tuple[str, str]:
    """(run tag, masked operation) of a tagged operation."""
    tag, _, rest = operation.partition("|")
    return tag, rest


@dataclass
class Reference:
    """What the uninterrupted trial did, per run."""

    runs: int
    #: Per run of the uninterrupted trial: intents and applications of each operation.
    per_run: Counter[str] = field(default_factory=Counter)
    #: Operations that name no run, over the whole trial.
    global_ops: Counter[str] = field(default_factory=Counter)
    #: Operations that reached the sink without a key (an agent's own calls).
    keyless: set[str] = field(default_factory=set)
    outcome: RunOutcome | None = None
    warnings: list[str] = field(default_factory=list)

    @classmethod
    def build(
        cls,
        intents: Sequence[Intent],
        applied: Sequence[Applied],
        outcomes: Mapping[str, RunOutcome],
    ) -> Reference:
        """From a trial's tagged evidence and its runs' outcomes."""
        run_ids = list(outcomes)
        ref = cls(runs=len(run_ids))
        counters: dict[str, Counter[str]] = {r: Counter() for r in run_ids}
        intended: Counter[str] = Counter(i.operation for i in intents if i.operation)
        applied_ops: Counter[str] = Counter(a.operation for a in applied if a.operation)
        for op in set(intended) | set(applied_ops):
            tag, masked = split(op)
            n = max(intended[op], applied_ops[op])
            if tag == GLOBAL:
                ref.global_ops[masked] += n
            else:
                counters.setdefault(tag, Counter())[masked] = n
        for a in applied:
            if a.key is None and a.operation:
                ref.keyless.add(split(a.operation)[1])
        for counter in counters.values():
            for masked, n in counter.items():
                ref.per_run[masked] = max(ref.per_run[masked], n)
        if len({tuple(sorted(c.items())) for c in counters.values()}) > 1:
            ref.warnings.append(
                "two uninterrupted runs of the same inputs intended different operations: "
                "counts are compared with the larger of the two"
            )
        disagree = disagreements(outcomes)
        if outcomes and not disagree:
            ref.outcome = next(iter(outcomes.values()))
        elif disagree:
            # Reached only when the check was told results may vary (else the reference
            # trial has failed with a ``nondeterministic_result`` violation already).
            ref.warnings.append(
                f"uninterrupted runs of the same inputs ended differently ({disagree[0]}): "
                "results are not compared (--allow-nondeterministic-result)"
            )
        return ref


@dataclass(frozen=True)
class Expectations:
    """What a trial with these run ids must show (tagged operations)."""

    counts: dict[str, int]
    keyless: frozenset[str]


def expectations(ref: Reference, run_ids: Sequence[str]) -> Expectations:
    """The reference's counts, for a trial's own runs."""
    counts: dict[str, int] = {}
    keyless: set[str] = set()
    for run_id in run_ids:
        for masked, n in ref.per_run.items():
            counts[f"{run_id}|{masked}"] = n
            if masked in ref.keyless:
                keyless.add(f"{run_id}|{masked}")
    for masked, n in ref.global_ops.items():
        counts[f"{GLOBAL}|{masked}"] = max(1, round(n * len(run_ids) / max(ref.runs, 1)))
        if masked in ref.keyless:
            keyless.add(f"{GLOBAL}|{masked}")
    return Expectations(counts, frozenset(keyless))
