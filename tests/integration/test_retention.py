"""`outbox gc`: finished history older than the horizon goes, in short batches; live rows stay."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner
from sqlalchemy import func, select, update

from outbox import Outbox
from outbox.cli import cli
from outbox.storage.schema import blobs, effect_attempts, effects, runs, steps


def count(ob: Outbox, table) -> int:  # type: ignore[no-untyped-def]
    with ob.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(table)).scalar_one())


def test_gc_deletes_old_finished_history_and_keeps_the_rest(
    ob: Outbox, dsn: str, tmp_path: Path
) -> None:
    old_done = ob.start_run("a", "1")
    old_done.transaction("s", lambda tx: tx.intend("k.x", {"n": 1}) and None)
    old_done.complete()
    old_done_too = ob.start_run("a", "1")
    old_done_too.complete()
    old_open = ob.start_run("a", "1")  # finished, but one of its effects is still pending
    old_open.transaction("s", lambda tx: tx.intend("k.x", {"n": 2}) and None)
    old_open.complete()
    recent = ob.start_run("a", "1")
    recent.complete()
    live = ob.start_run("a", "1")
    with ob.transaction() as tx:
        tx.intend("k.x", {"n": 3}, key="runless-old")
        tx.intend("k.x", {"n": 4}, key="runless-old-too")
    with ob.engine.begin() as conn:
        conn.execute(
            update(effects)
            .where(effects.c.run_id == old_done.id)
            .values(status="succeeded", completed_at=func.now() - func.make_interval(0, 0, 0, 40))
        )
        conn.execute(
            update(effects)
            .where(effects.c.run_id.is_(None))
            .values(status="succeeded", completed_at=func.now() - func.make_interval(0, 0, 0, 40))
        )
        conn.execute(
            update(runs)
            .where(runs.c.id.in_([old_done.id, old_done_too.id, old_open.id]))
            .values(updated_at=func.now() - func.make_interval(0, 0, 0, 40))
        )
    archive = tmp_path / "archive.jsonl"
    result = CliRunner().invoke(
        cli,
        [
            "--dsn",
            dsn,
            "gc",
            "--older-than",
            "30d",
            "--batch",
            "1",
            "--archive",
            str(archive),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["deleted"]["outbox_runs"] == 2
    assert report["deleted"]["outbox_effects"] == 2
    # --batch 1: one row per transaction, then one finding nothing, for runs and for
    # effects; then one statement each for consumed keys and webhook replays, and for
    # blob references and blobs (none here).
    assert report["batches"] == 3 + 3 + 2 + 2, "one row per transaction"
    remaining = {r.id for r in ob.runs()}
    assert remaining == {old_open.id, recent.id, live.id}
    assert count(ob, steps) == 1 and count(ob, effects) == 1  # old_open's step and effect
    assert count(ob, effect_attempts) == 0
    archived = [json.loads(line) for line in archive.read_text().splitlines()]
    assert sorted(a["table"] for a in archived) == ["outbox_effects"] * 2 + ["outbox_runs"] * 2
    assert {a["row"]["id"] for a in archived if a["table"] == "outbox_runs"} == {
        str(old_done.id),
        str(old_done_too.id),
    }


def test_gc_deletes_the_large_values_nothing_uses_any_more(ob: Outbox, dsn: str) -> None:
    big = {"transcript": "x" * 100_000}
    other = {"transcript": "y" * 100_000}
    shared = {"transcript": "z" * 100_000}
    old = ob.start_run("a", "1", big)

    def step(tx):  # type: ignore[no-untyped-def]
        tx.set_state(shared)
        tx.intend("k.x", other)

    old.transaction("s", step)
    old.complete()
    live = ob.start_run("a", "1", shared)  # the same value as old's state: one blob, two owners
    with ob.transaction() as tx:
        tx.intend("k.x", {"runless": "w" * 100_000}, key="old-runless")
    with ob.engine.begin() as conn:
        conn.execute(
            update(effects).values(
                status="succeeded", completed_at=func.now() - func.make_interval(0, 0, 0, 40)
            )
        )
        conn.execute(
            update(runs)
            .where(runs.c.id == old.id)
            .values(updated_at=func.now() - func.make_interval(0, 0, 0, 40))
        )
    assert count(ob, blobs) == 4
    result = CliRunner().invoke(cli, ["--dsn", dsn, "gc", "--older-than", "30d", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["deleted"]["outbox_blobs"] == 3
    assert report["deleted"]["outbox_blob_refs"] == 4  # old's three and the run-less effect's
    assert count(ob, blobs) == 1
    assert ob.run(live.id).inputs == shared, "a blob another run uses stays"
