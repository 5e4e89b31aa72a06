"""The pure parts of ``outbox check``: operations, masks, references, plans, options and reports.

The kit end to end (real workers killed) is in ``tests/chaos/test_check.py``.
"""

from __future__ import annotations

import shlex
from collections import Counter
from pathlib import Path

import pydantic
import pytest

from outbox.check.compare import (
    Reference,
    RunOutcome,
    differences,
    disagreements,
    expectations,
    masker,
    tag_operations,
)
from outbox.check.crash import TraceEvent
from outbox.check.invariants import (
    Applied,
    AttemptRecord,
    Intent,
    check,
    operation_of,
    replay_violations,
)
from outbox.check.plan import CheckOptions, TrialPlan, handover_target, plan_trials, select
from outbox.check.report import CheckReport, explain
from outbox.check.trial import Crash, TrialResult

RUN_A = "0190a0a0-0000-7000-8000-00000000000a"
RUN_B = "0190b0b0-0000-7000-8000-00000000000b"
KEY = "ab" * 32


def options(**changes: object) -> CheckOptions:
    base: dict[str, object] = {"handler": "pkg.mod:agent", "agent": "a", "version": "1"}
    return CheckOptions(**(base | changes))


def ev(
    point: str, where: str | None, run: str | None = RUN_A, pid: int = 1, t: float = 0.0
) -> TraceEvent:
    return TraceEvent(point, where, run, pid, t)


# -- business operations and masks -----------------------------------------------------------


def test_an_operation_is_named_by_the_payload_or_by_a_digest_of_it() -> None:
    assert operation_of("k", {"operation": "op-1", "x": 1}) == "op-1"
    assert operation_of("http.request", {"url": "u", "json": {"operation": "op-2"}}) == "op-2"
    digest = operation_of("email.send", {"to": "a@example.com"})
    assert digest.startswith("email.send#")
    assert digest == operation_of("email.send", {"to": "a@example.com"})
    assert digest != operation_of("email.send", {"to": "b@example.com"})
    assert digest != operation_of("sms.send", {"to": "a@example.com"})


def test_the_mask_hides_what_two_runs_of_the_same_inputs_cannot_share() -> None:
    mask = masker("http://127.0.0.1:4321")
    text = f"{RUN_A}:charge at http://127.0.0.1:4321/x key {KEY}"
    assert mask(text) == "<id>:charge at <sink>/x key <key>"
    one = operation_of("k", {"run": RUN_A, "url": "http://127.0.0.1:4321/x"}, mask)
    other = operation_of("k", {"run": RUN_B, "url": "http://127.0.0.1:4321/x"}, mask)
    assert one == other


def test_operations_are_tagged_with_their_run() -> None:
    intents = [Intent("e1", "k1", "k", "succeeded", 1, "<id>:charge", run=RUN_A)]
    applied = [
        Applied("k1", "<id>:charge", "/record/k", f'{{"run_id": "{RUN_A}"}}'),
        Applied(None, "POST /emails#1", "/emails", '{"to": "a"}'),
    ]
    tagged_intents, tagged_applied = tag_operations(intents, applied, [RUN_A, RUN_B])
    assert tagged_intents[0].operation == f"{RUN_A}|<id>:charge"
    assert [a.operation for a in tagged_applied] == [f"{RUN_A}|<id>:charge", "*|POST /emails#1"]


def test_a_run_less_intent_belongs_to_the_run_its_payload_names() -> None:
    intents = [
        Intent("e1", "k1", "k", "succeeded", 1, "<id>:charge", payload=f'{{"op": "{RUN_B}"}}'),
        Intent("e2", "k2", "k", "succeeded", 1, "nightly", payload='{"op": "nightly"}'),
    ]
    applied = [Applied("k1", "<id>:charge", "/record/k", f'{{"op": "{RUN_B}"}}')]
    tagged_intents, tagged_applied = tag_operations(intents, applied, [RUN_A, RUN_B])
    assert [i.operation for i in tagged_intents] == [f"{RUN_B}|<id>:charge", "*|nightly"]
    assert tagged_applied[0].operation == tagged_intents[0].operation


# -- the checker with expectations -----------------------------------------------------------


def test_expected_counts_allow_what_an_uninterrupted_run_does_and_no_more() -> None:
    intents = [Intent(f"e{n}", f"k{n}", "k", "succeeded", 1, "op-twice") for n in (1, 2)]
    attempts_ok: list[AttemptRecord] = []
    applied = [Applied("k1", "op-twice"), Applied("k2", "op-twice")]
    report = check(intents, attempts_ok, applied, expected_counts={"op-twice": 2})
    assert report.duplicate_intents == [] and report.duplicate_operations == []
    more = check(intents, [], applied, expected_counts={"op-twice": 1})
    assert more.duplicate_intents == ["op-twice"] and more.duplicate_operations == ["op-twice"]
    fewer = check(intents[:1], [], applied[:1], expected_counts={"op-twice": 2})
    assert fewer.lost == ["operation op-twice: intended 1x, 2x expected"]


def test_a_keyless_call_is_a_phantom_unless_an_uninterrupted_run_makes_it_too() -> None:
    applied = [Applied(None, "email")]
    assert check([], [], applied).phantoms == ["operation email: applied without a key or intent"]
    allowed = check([], [], applied, expected_counts={"email": 1}, keyless_allowed=["email"])
    assert allowed.clean, allowed.summary()
    twice = check([], [], applied * 2, expected_counts={"email": 1}, keyless_allowed=["email"])
    assert twice.duplicate_operations == ["email"] and twice.phantoms == []


def test_a_step_function_run_after_its_commit_is_a_violation() -> None:
    events = [
        ev("step_start", "s1", pid=1),
        ev("step_start", "s1", pid=2),  # the first never committed: expected after a crash
        ev("after_commit", "s1", pid=2),
        ev("step_start", "s2", pid=2),
        ev("after_commit", "s2", pid=2),
        ev("step_start", "s2", pid=3),  # replay should have returned the recorded result
    ]
    reran, started = replay_violations(events)
    assert len(reran) == 1 and "'s2'" in reran[0] and "pid 3" in reran[0]
    assert started == {(RUN_A, "s1"): 2, (RUN_A, "s2"): 2}


# -- the reference ---------------------------------------------------------------------------


def outcome(**changes: object) -> RunOutcome:
    base: dict[str, object] = {
        "status": "completed",
        "version": "1",
        "result": {"n": 1},
        "error": None,
        "state": {},
        "steps": ("a", "b"),
        "upgrades": 0,
    }
    return RunOutcome(**(base | changes))  # type: ignore[arg-type]


def test_differences_name_each_field_that_differs() -> None:
    assert differences(outcome(), outcome()) == []
    found = differences(outcome(), outcome(result={"n": 2}, steps=("a", "b", "c")))
    assert found[0].startswith('result: {"n": 2} (uninterrupted: {"n": 1})')
    assert "extra ['c']" in found[1]


def test_a_reference_counts_per_run_and_scales_to_a_trials_runs() -> None:
    intents = [
        Intent("e1", "k1", "k", "succeeded", 1, f"{RUN_A}|charge", run=RUN_A),
        Intent("e2", "k2", "k", "succeeded", 1, f"{RUN_B}|charge", run=RUN_B),
    ]
    applied = [
        Applied("k1", f"{RUN_A}|charge"),
        Applied("k2", f"{RUN_B}|charge"),
        Applied(None, "*|ping"),
        Applied(None, "*|ping"),
    ]
    ref = Reference.build(intents, applied, {RUN_A: outcome(), RUN_B: outcome()})
    assert ref.per_run == Counter({"charge": 1}) and ref.global_ops == Counter({"ping": 2})
    assert ref.keyless == {"ping"} and ref.outcome == outcome() and ref.warnings == []
    trial_run = "0190c0c0-0000-7000-8000-00000000000c"
    wanted = expectations(ref, [trial_run])
    assert wanted.counts == {f"{trial_run}|charge": 1, "*|ping": 1}
    assert wanted.keyless == frozenset({"*|ping"})


def test_runs_that_disagree_are_named_with_each_field_that_differs() -> None:
    assert disagreements({RUN_A: outcome(), RUN_B: outcome()}) == []
    assert disagreements({RUN_A: outcome()}) == []
    (line,) = disagreements({RUN_A: outcome(), RUN_B: outcome(result={"n": 2}, steps=("a",))})
    assert line == (
        f"run 2 ({RUN_B}) ended otherwise than run 1 ({RUN_A}): "
        'result: {"n": 2} (run 1: {"n": 1}); steps: 1 recorded (run 1: 2); missing [\'b\']'
    )


def test_a_reference_whose_runs_were_allowed_to_disagree_compares_no_result_and_says_so() -> None:
    ref = Reference.build([], [], {RUN_A: outcome(), RUN_B: outcome(result={"n": 2})})
    assert ref.outcome is None
    assert "result: " in ref.warnings[0]
    assert "results are not compared (--allow-nondeterministic-result)" in ref.warnings[0]


# -- plans and options -------------------------------------------------------------------------


def baseline_trace() -> list[TraceEvent]:
    events = []
    for step in ("load", "pay"):
        for point in ("step_start", "step_end", "before_step_commit", "after_commit", "after_step"):
            events.append(ev(point, step))
    events += [ev("step_start", "load", run=RUN_B), ev("after_claim", None, run=None)]
    return events


def test_the_plan_has_a_chain_per_reached_point_and_a_trial_per_deliverer_point() -> None:
    plans = plan_trials(baseline_trace(), RUN_A, options())
    assert [p.id for p in plans] == [
        "step_start",
        "step_end",
        "before_step_commit",
        "after_commit",
        "after_step",
        "after_claim",
    ]
    assert plans[0].targets == ("load", "pay") and plans[0].chain
    assert [s.id for s in plans[0].singles()] == ["step_start@load", "step_start@pay"]


def test_a_deliverer_that_notes_or_sends_in_a_transaction_gets_a_trial_at_each() -> None:
    events = [*baseline_trace(), ev("after_note", None, run=None), ev("after_send", None, run=None)]
    deliverer = [p.id for p in plan_trials(events, RUN_A, options()) if p.role == "deliverer"]
    assert deliverer == ["after_claim", "after_note", "after_send"]
    # reached by no deliverer (a recording sink neither notes nor sends): no trial
    assert "after_note" not in [p.id for p in plan_trials(baseline_trace(), RUN_A, options())]


def test_an_upgrade_hands_over_while_parked_if_the_agent_waits_else_mid_run() -> None:
    events = baseline_trace()
    assert handover_target(events, RUN_A) == "after_step@load"
    assert handover_target([*events, ev("parked", "approval")], RUN_A) == "parked@approval"
    upgrade = options(upgrade_to="2", setup="pkg.mod:shim")
    ids = [p.id for p in plan_trials(events, RUN_A, upgrade)]
    assert ids[-3:] == ["handover", "during_upgrade", "after_upgrade"]


def test_only_picks_chains_single_crashes_and_the_handover_an_upgrade_needs() -> None:
    plans = plan_trials(baseline_trace(), RUN_A, options(upgrade_to="2", setup="p.m:f"))
    assert [p.id for p in select(plans, ["step_end@pay"])] == ["step_end@pay"]
    assert [p.id for p in select(plans, ["after_step"])] == ["after_step"]
    assert [p.id for p in select(plans, ["after_upgrade"])] == ["after_upgrade", "handover"]
    assert select(plans, ["nowhere@x"]) == []


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"handler": "no_colon"}, "handler"),
        ({"runs": 0}, "runs"),
        ({"sink": "fake"}, "sink"),
        ({"upgrade_to": "2"}, "go together"),
        ({"upgrade_to": "1", "setup": "a.b:c"}, "is the version being checked"),
        ({"inputs": {"when": object()}}, "must be JSON"),
    ],
)
def test_bad_options_are_refused_naming_the_field(changes: dict[str, object], message: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=message):
        options(**changes)


def test_the_reproduce_command_says_everything_and_hides_a_password() -> None:
    opts = options(
        inputs={"month": "2026-10"},
        runs=2,
        dsn="postgresql://me:secret@db/app",
        signals={"approved": {"by": "cfo"}},
        config=Path("deliverers.toml"),
    )
    line = opts.command(only="step_end@pay")
    assert "secret" not in line
    assert shlex.split(line) == [
        "outbox", "check", "pkg.mod:agent", "--agent", "a", "--version", "1",
        "--inputs", '{"month":"2026-10"}', "--runs", "2", "--config", "deliverers.toml",
        "--dsn", "postgresql://me:***@db/app", "--signal", 'approved={"by":"cfo"}',
        "--only", "step_end@pay",
    ]  # fmt: skip
    allowing = options(allow_nondeterministic_result=True).command()
    assert shlex.split(allowing)[-1] == "--allow-nondeterministic-result"


# -- the report --------------------------------------------------------------------------------


def result(plan: TrialPlan, **changes: object) -> TrialResult:
    found = TrialResult(plan)
    for name, value in changes.items():
        setattr(found, name, value)
    return found


def test_rows_follow_the_catalogue_and_the_first_violation_is_a_single_crash() -> None:
    opts = options()
    planned = plan_trials(baseline_trace(), RUN_A, opts)
    by_id = {p.id: p for p in planned}
    chain = result(by_id["step_end"])
    chain.report.duplicate_operations = [f"{RUN_A}|<id>:email"]
    ok_single = result(TrialPlan("step_end@load", "worker", "step_end", ("load",)))
    ok_single.crashes = [Crash("step_end", "load", 11, RUN_A)]
    bad_single = result(TrialPlan("step_end@pay", "worker", "step_end", ("pay",)))
    bad_single.crashes = [Crash("step_end", "pay", 12, RUN_A)]
    bad_single.report.duplicate_operations = [f"{RUN_A}|<id>:email"]
    bad_single.applied = [Applied(None, f"{RUN_A}|<id>:email", t=5.0)] * 2
    after_step = result(by_id["after_step"])
    after_step.crashes = [Crash("after_step", "load", 13, RUN_A)]
    report = CheckReport(
        opts,
        baseline=result(TrialPlan("uninterrupted", "baseline")),
        planned=planned,
        results=[chain, ok_single, bad_single, after_step],
    )
    rows = {(r.point, r.where): r for r in report.rows()}
    assert rows[("step_end", "load")].outcome == "ok"
    assert rows[("step_end", "pay")].outcome == "VIOLATION"
    assert "<id>:email (run 0190a0a0): intended 0x, applied 2x" in rows[("step_end", "pay")].detail
    assert rows[("step_start", "2 step(s)")].outcome == "skipped"
    assert rows[("after_step", "load")].outcome == "ok"
    assert rows[("after_step", "pay")].outcome == "not reached"
    assert rows[("parked", "-")].detail == "the agent never waits"
    assert rows[("after_claim", "first time")].outcome == "skipped"
    assert rows[("after_call", "-")].outcome == "not reached"
    first = report.first_violation()
    assert first is not None and first.trial == "step_end@pay"
    assert first.reproduce.endswith("--only step_end@pay")
    assert not report.ok and report.as_dict()["first_violation"]["kind"] == "duplicate_operations"


def test_the_explanation_tells_a_call_inside_a_step_from_plain_code() -> None:
    plan = TrialPlan("step_end@charge", "worker", "step_end", ("charge",))
    inside = result(plan, applied=[Applied(None, "op", t=2.0)])
    inside.events = [ev("step_start", "charge", t=1.0), ev("step_end", "charge", t=3.0)]
    assert "recorded step 'charge'" in explain("duplicate_operations", "op", inside)
    outside = result(plan, applied=[Applied(None, "op", t=4.0)])
    outside.events = inside.events
    assert "outside tx.intend" in explain("duplicate_operations", "op", outside)
    killed = result(plan, applied=[Applied(None, "op", t=2.0)])
    killed.events = [ev("step_start", "charge", t=1.0), ev("step_end", "charge", t=2.5)]
    killed.events += [ev("step_start", "other", pid=2, t=9.0)]  # killed there: a zero-length span
    assert "'charge'" in explain("duplicate_operations", "op", killed)


def test_the_explanation_tells_an_intent_made_outside_the_steps_from_a_changing_step_id() -> None:
    plan = TrialPlan("step_start@mark", "worker", "step_start", ("mark",))
    twice = [Intent(f"e{n}", f"k{n}", "k", "succeeded", 1, "op") for n in (1, 2)]
    run_less = result(plan, intents=twice, applied=[Applied(f"k{n}", "op") for n in (1, 2)])
    for kind in ("duplicate_operations", "duplicate_intents"):
        assert "outside the run's steps" in explain(kind, "op", run_less)
    in_steps = [Intent(f"e{n}", f"k{n}", "k", "succeeded", 1, "op", run=RUN_A) for n in (1, 2)]
    changing = result(plan, intents=in_steps)
    assert "Keep step ids stable" in explain("duplicate_intents", "op", changing)


def test_an_uninterrupted_trial_whose_runs_disagree_is_the_first_violation_explained() -> None:
    baseline = result(TrialPlan("uninterrupted", "baseline"))
    baseline.report.nondeterministic_result = disagreements(
        {RUN_A: outcome(), RUN_B: outcome(result={"n": 2})}
    )
    report = CheckReport(options(), baseline=baseline)
    first = report.first_violation()
    assert first is not None and not report.ok
    assert (first.trial, first.kind) == ("uninterrupted", "nondeterministic_result")
    assert 'result: {"n": 2}' in first.detail and "killed: nothing" in first.detail
    assert "reads the clock" in first.explanation
    assert "--allow-nondeterministic-result" in first.explanation
    assert "--only" not in first.reproduce  # the uninterrupted trial is the whole check
    assert report.as_dict()["violations"] == {"uninterrupted": {"nondeterministic_result": 1}}


# -- the command line ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["a:b", "--agent", "a"], "Missing option '--version'"),
        (["a:b", "--agent", "a", "--version", "1", "--inputs", "{bad"], "--inputs: not JSON"),
        (["a:b", "--agent", "a", "--version", "1", "--signal", "go"], "expected NAME=JSON"),
        (["a:b", "--agent", "a", "--version", "1", "--upgrade-to", "2"], "go together"),
        (["no_colon", "--agent", "a", "--version", "1"], "handler='no_colon'"),
    ],
)
def test_bad_command_lines_are_one_clear_line_and_exit_2(args: list[str], message: str) -> None:
    from click.testing import CliRunner

    from outbox.cli import cli

    result = CliRunner().invoke(cli, ["check", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
