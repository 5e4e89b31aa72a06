"""`outbox gc`: finished history older than the horizon goes, in short batches; live rows stay.

With ``--archive``, every deleted row of every table is in the archive, exactly
as it was in the database, and on disk before its batch's delete commits.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import Table, event, func, select, text, update

from deliverers.testing import RecordingDeliverer
from outbox import Outbox
from outbox.cli import cli
from outbox.ids import uuid7
from outbox.shards import on_shard, shard_of
from outbox.storage.admin.archive import ArchiveWriter, read_archive, summarize_archive
from outbox.storage.admin.retention import GC_TABLES, collect_garbage, parse_horizon
from outbox.storage.schema import (
    blobs,
    budget_ledger,
    consumed_keys,
    effect_attempts,
    effects,
    metadata,
    runs,
    signals,
    steps,
    webhook_replays,
)
from outbox.storage.store import mark_consumed
from tests.support import DaemonThread, wait_for

OLD = func.now() - func.make_interval(0, 0, 0, 40)
KEYS: dict[str, tuple[str, ...]] = {
    "outbox_runs": ("id",),
    "outbox_steps": ("run_id", "step_id"),
    "outbox_effects": ("id",),
    "outbox_effect_attempts": ("id",),
    "outbox_signals": ("id",),
    "outbox_budget_ledger": ("id",),
    "outbox_run_keys": ("namespace", "key", "shard"),
    "outbox_effect_keys": ("namespace", "key", "shard"),
    "outbox_consumed_keys": ("consumer_group", "idempotency_key"),
    "outbox_webhook_replays": ("signature",),
    "outbox_blob_refs": ("owner", "sha256"),
    "outbox_blobs": ("sha256",),
}


def count(ob: Outbox, table: Table) -> int:
    with ob.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(table)).scalar_one())


def snapshot(ob: Outbox) -> dict[str, dict[tuple[Any, ...], dict[str, Any]]]:
    """Every row of every table gc touches, by primary key."""
    out: dict[str, dict[tuple[Any, ...], dict[str, Any]]] = {}
    with ob.engine.connect() as conn:
        for name in GC_TABLES:
            rows = conn.execute(select(metadata.tables[name])).mappings().all()
            out[name] = {tuple(r[k] for k in KEYS[name]): dict(r) for r in rows}
    return out


def build_history(ob: Outbox, dsn: str) -> dict[str, Any]:
    """A run graph touching every table, aged past the horizon, next to rows that must stay."""
    sink = RecordingDeliverer("k.x")
    # its notes go by reference (outbox_blobs, outbox_blob_refs)
    old = ob.start_run("a", "1", {"order": 7, "notes": "n" * 20_000}, budget=100, key="order-7")
    ob.signal(old.id, "approve", {"by": "ops"}, request_id="sig-old")

    def step(tx: Any) -> str:
        tx.spend(2.5, "llm")
        tx.intend("k.x", {"n": 1, "text": "héllo"}, cost=3)
        tx.intend("k.x", {"n": 2}, key="caller-key-1", compensate=("k.x", {"undo": 2}))
        return "done"

    old.transaction("s1", step)
    assert old.wait_signal("w1", name="approve") == {"by": "ops"}
    old_open = ob.start_run("a", "1")  # finished, but one of its effects is still pending
    recent = ob.start_run("a", "1")
    live = ob.start_run("a", "1")
    with ob.transaction() as tx:
        tx.intend("k.x", {"n": 3}, key="runless-old")
        tx.intend("k.x", {"n": 4}, key="runless-old-too")
    with DaemonThread(dsn, {"k.x": sink}, poll_seconds=0.05):
        wait_for(lambda: len(sink.deliveries) == 4, message="four deliveries")
        wait_for(lambda: all(e.status == "succeeded" for e in ob.effects()), message="completions")
    old_open.transaction("s", lambda tx: tx.intend("k.x", {"n": 5}) and None)
    for run in (old, old_open, recent):
        run.complete({"ok": True})
    with ob.engine.begin() as conn:
        mark_consumed(conn, "group-a", "old-key")
        mark_consumed(conn, "group-a", "new-key")
        conn.execute(
            update(effects)
            .where(effects.c.completed_at.is_not(None))
            .values(completed_at=OLD, updated_at=OLD)
        )
        conn.execute(
            update(runs).where(runs.c.id.in_([old.id, old_open.id])).values(updated_at=OLD)
        )
        conn.execute(
            update(consumed_keys)
            .where(consumed_keys.c.idempotency_key == "old-key")
            .values(consumed_at=OLD)
        )
        conn.execute(update(webhook_replays).values(seen_at=OLD))
    ob.signal(live.id, "later", request_id="sig-new")
    return {"old": old, "old_open": old_open, "recent": recent, "live": live}


def open_transactions(ob: Outbox) -> int:
    with ob.engine.connect() as conn:
        return int(
            conn.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND state LIKE 'idle in transaction%'"
                )
            ).scalar_one()
        )


@pytest.fixture
def history(ob: Outbox, dsn: str) -> dict[str, Any]:
    return build_history(ob, dsn)


def gc(dsn: str, *args: str) -> dict[str, Any]:
    result = CliRunner().invoke(cli, ["--dsn", dsn, "gc", "--older-than", "30d", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)  # type: ignore[no-any-return]


def test_the_archive_holds_every_deleted_row_of_every_table_exactly(
    ob: Outbox, dsn: str, tmp_path: Path, history: dict[str, Any]
) -> None:
    archive_holds_every_deleted_row(ob, dsn, tmp_path, history)


def archive_holds_every_deleted_row(
    ob: Outbox, dsn: str, tmp_path: Path, history: dict[str, Any]
) -> None:
    """``gc --archive`` of :func:`build_history`: what went, what stayed, what was archived.

    ``ob`` reads the tables; ``dsn`` is what gc runs against (also on Citus).
    """
    before = snapshot(ob)
    for name in GC_TABLES:
        assert before[name], f"the history must touch {name}"
    archive = tmp_path / "archive.jsonl"
    report = gc(dsn, "--batch", "1", "--archive", str(archive))

    after = snapshot(ob)
    archived: dict[str, dict[tuple[Any, ...], dict[str, Any]]] = {n: {} for n in GC_TABLES}
    for entry in read_archive(archive):
        archived[entry.table][tuple(entry.row[k] for k in KEYS[entry.table])] = entry.row
    for name in GC_TABLES:
        gone = {k: v for k, v in before[name].items() if k not in after[name]}
        # Every deleted row is archived with every column as it was; nothing kept is.
        assert archived[name] == gone, name
        assert report["deleted"][name] == len(gone), name
    assert set(report["deleted"]) == set(GC_TABLES)
    assert {r[0] for r in after["outbox_runs"]} == {
        history["old_open"].id,
        history["recent"].id,
        history["live"].id,
    }
    assert report["deleted"]["outbox_runs"] == 1 and report["deleted"]["outbox_effects"] == 4
    assert report["deleted"]["outbox_effect_attempts"] == 4
    assert report["deleted"]["outbox_steps"] == 2  # the transaction and the wait
    assert report["deleted"]["outbox_consumed_keys"] == 1
    assert report["deleted"]["outbox_webhook_replays"] == 1
    assert report["deleted"]["outbox_budget_ledger"] >= 3  # spend, reserve, commit
    # the old run's notes went by reference: its reference, and the blob nothing else uses
    assert report["deleted"]["outbox_blob_refs"] == 1
    assert report["deleted"]["outbox_blobs"] == 1
    # the callers' keys: the old run's, its effect's and the two run-less effects'
    assert report["deleted"]["outbox_run_keys"] == 1
    gone_keys = {row["key"] for row in archived["outbox_effect_keys"].values()}
    assert gone_keys == {"caller-key-1", "runless-old", "runless-old-too"}
    # The effect of the unfinished run, and rows younger than the horizon, stay.
    assert count(ob, effects) == 1 and count(ob, steps) == 1
    assert count(ob, signals) == 1 and count(ob, webhook_replays) == 1

    # Payloads, keys and results are all there, typed back.
    old_effects = [r for r in archived["outbox_effects"].values() if r["run_id"]]
    assert {e["idempotency_key"] for e in old_effects} >= {"caller-key-1"}
    assert {json.dumps(e["payload"], sort_keys=True) for e in old_effects} == {
        '{"n": 1, "text": "h\\u00e9llo"}',
        '{"n": 2}',
    }
    assert all(e["result"] == {"recorded": e["result"]["recorded"]} for e in old_effects)

    assert stat.S_IMODE(archive.stat().st_mode) == 0o600
    summary = summarize_archive(archive)
    assert len(summary.headers) == 1 and summary.headers[0]["older_than_seconds"] == 30 * 86400
    assert summary.rows == {k: v for k, v in report["deleted"].items() if v}


def test_archive_read_shows_one_run_through_the_cli(
    ob: Outbox, dsn: str, tmp_path: Path, history: dict[str, Any]
) -> None:
    archive = tmp_path / "archive.jsonl"
    report = gc(dsn, "--archive", str(archive))
    runner = CliRunner()
    summary = runner.invoke(cli, ["archive", "read", str(archive), "--json"])
    assert summary.exit_code == 0, summary.output
    data = json.loads(summary.output)
    assert data["rows"] == {k: v for k, v in report["deleted"].items() if v}
    assert len(data["gc_runs"]) == 1

    one_run = runner.invoke(cli, ["archive", "read", str(archive), "--run", str(history["old"].id)])
    assert one_run.exit_code == 0, one_run.output
    lines = [json.loads(line) for line in one_run.output.splitlines()]
    tables = [line["table"] for line in lines]
    # The run first, its attempts after their effects; run-less rows and keys are left out.
    assert tables[0] == "outbox_runs"
    assert tables.count("outbox_effects") == 2 and tables.count("outbox_effect_attempts") == 2
    assert tables.index("outbox_effect_attempts") > tables.index("outbox_effects")
    assert "outbox_consumed_keys" not in tables and "outbox_webhook_replays" not in tables
    assert {"outbox_steps", "outbox_signals", "outbox_budget_ledger"} <= set(tables)

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"table": "outbox_runs", "row": {}}\nnot json\n{"table": "x", "row": {}}\n')
    refused = runner.invoke(cli, ["archive", "read", str(bad)])
    assert refused.exit_code != 0 and "line 2" in str(refused.exception or refused.output)


def test_gc_without_archive_deletes_in_batches_and_keeps_the_rest(
    ob: Outbox, dsn: str, history: dict[str, Any]
) -> None:
    report = gc(dsn, "--batch", "1")
    assert report["deleted"]["outbox_runs"] == 1 and report["deleted"]["outbox_effects"] == 4
    # --batch 1: one run per transaction then one finding nothing; two run-less
    # effects then one finding nothing; one consumed key and one replay mark,
    # each followed by a batch finding nothing; no reference left without its
    # owner; the old run's large input, then a batch finding nothing.
    assert report["batches"] == 2 + 3 + 2 + 2 + 1 + 2
    assert {r.id for r in ob.runs()} == {
        history["old_open"].id,
        history["recent"].id,
        history["live"].id,
    }
    assert count(ob, effect_attempts) == 0  # the only open effect was never attempted
    assert count(ob, budget_ledger) == 0  # the old run's ledger went with it


def test_dry_run_deletes_and_archives_nothing(
    ob: Outbox, dsn: str, tmp_path: Path, history: dict[str, Any]
) -> None:
    before = snapshot(ob)
    archive = tmp_path / "archive.jsonl"
    report = gc(dsn, "--dry-run", "--archive", str(archive))
    assert report["dry_run"] is True and report["deleted"]["outbox_runs"] == 1
    assert snapshot(ob) == before
    assert not archive.exists()


def test_the_archive_is_on_disk_before_the_delete_commits(
    ob: Outbox, dsn: str, tmp_path: Path, history: dict[str, Any]
) -> None:
    """A gc killed after archiving a batch, before its commit, loses nothing; the rerun finishes."""
    before = snapshot(ob)
    archive = tmp_path / "archive.jsonl"
    env = {**os.environ, "OUTBOX_DSN": dsn, "OUTBOX_TEST_CRASH_AT": "gc_archived"}
    crashed = subprocess.run(
        [sys.executable, "-m", "outbox", "gc", "--older-than", "30d", "--archive", str(archive)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert crashed.returncode == -9, crashed.stderr
    assert snapshot(ob) == before, "the killed batch did not commit"
    wait_for(lambda: not open_transactions(ob), message="the killed session to end")
    first = list(read_archive(archive))
    assert {e.table for e in first} >= {"outbox_runs", "outbox_effects", "outbox_steps"}

    report = gc(dsn, "--archive", str(archive))
    after = snapshot(ob)
    rows: dict[str, set[tuple[Any, ...]]] = {n: set() for n in GC_TABLES}
    for entry in read_archive(archive):
        rows[entry.table].add(tuple(entry.row[k] for k in KEYS[entry.table]))
    for name in GC_TABLES:
        gone = set(before[name]) - set(after[name])
        assert gone <= rows[name], name
        assert report["deleted"][name] == len(gone), name
    assert len(summarize_archive(archive).headers) == 2


def test_each_batch_is_fsynced_before_it_commits(
    ob: Outbox, tmp_path: Path, history: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        events.append("fsync-dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync-file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)  # as the archive module calls it
    event.listen(ob.engine, "commit", lambda conn: events.append("commit"))
    path = tmp_path / "new" / "archive.jsonl"
    path.parent.mkdir()
    with ArchiveWriter.open(path) as writer:
        report = collect_garbage(ob.engine, parse_horizon("30d"), batch=1, archive=writer)
    assert report.deleted["outbox_runs"] == 1
    assert "fsync-dir" in events and events.index("fsync-dir") < events.index("commit")
    # Every batch's commit follows an fsync of the file made after the previous commit.
    commits = 0
    since_commit: list[str] = []
    for item in events:
        if item == "commit":
            assert "fsync-file" in since_commit, events
            commits += 1
            since_commit = []
        else:
            since_commit.append(item)
    assert commits == report.batches


@pytest.mark.parametrize("text", ["99999999999d", "1e9w", "abc", "-1d"])
def test_absurd_horizons_are_one_clear_error(text: str) -> None:
    from outbox import ValidationError

    with pytest.raises(ValidationError, match="older_than"):
        parse_horizon(text)


def test_bad_gc_input_is_one_line(dsn: str, tmp_path: Path) -> None:
    env = {**os.environ, "OUTBOX_DSN": dsn}
    for args in (
        ["--older-than", "99999999999d"],
        ["--older-than", "30d", "--archive", str(tmp_path / "missing" / "a.jsonl")],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "outbox", "gc", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 1, done.stderr
        assert done.stderr.count("\n") == 1 and "ValidationError" in done.stderr, done.stderr


def test_a_batch_holds_runs_with_at_most_batch_effects_between_them(ob: Outbox) -> None:
    for _ in range(4):
        run = ob.start_run("a", "1")
        run.transaction("s", lambda tx: [tx.intend("k.x", {"i": i}) for i in range(2)] and None)
        run.complete()
    with ob.engine.begin() as conn:
        conn.execute(update(effects).values(status="succeeded", completed_at=OLD, updated_at=OLD))
        conn.execute(update(runs).values(updated_at=OLD))
    sizes: list[int] = []

    def progress(phase: str, picked: int) -> None:
        if phase == "outbox_runs":
            sizes.append(count(ob, effects))

    report = collect_garbage(ob.engine, parse_horizon("30d"), batch=3, progress=progress)
    assert report.deleted["outbox_runs"] == 4 and report.deleted["outbox_effects"] == 8
    # 3 runs fit the batch, but 2 + 2 effects do not: one run (2 effects) per transaction.
    assert sizes == [6, 4, 2, 0]


def test_a_key_whose_run_or_effect_gc_deleted_names_a_new_one(ob: Outbox, dsn: str) -> None:
    """Past the horizon a caller's key is forgotten with its owner: using it again starts anew.

    Before, the registration outlived its run: starting with the key again failed
    for good ("started concurrently by another transaction"), and so did an intent.
    """
    old = ob.start_run("a", "1", {"x": 1}, key="order-8")
    old.transaction("s", lambda tx: tx.intend("k.x", {"n": 1}, key="mail-8") and None)
    old.complete()
    with ob.engine.begin() as conn:
        conn.execute(update(effects).values(status="succeeded", completed_at=OLD, updated_at=OLD))
        conn.execute(update(runs).values(updated_at=OLD))
    report = gc(dsn)
    assert report["deleted"]["outbox_run_keys"] == 1
    assert report["deleted"]["outbox_effect_keys"] >= 1
    again = ob.start_run("a", "1", {"x": 1}, key="order-8")
    assert again.id != old.id and ob.run(again.id).status == "runnable"
    effect_id = again.transaction("s", lambda tx: str(tx.intend("k.x", {"n": 1}, key="mail-8").id))
    assert ob.effect(effect_id).run_id == again.id
    assert ob.start_run("a", "1", {"x": 1}, key="order-8").id == again.id, "held again"


def test_gc_deletes_the_large_values_nothing_uses_any_more(ob: Outbox, dsn: str) -> None:
    big = {"transcript": "x" * 100_000}
    other = {"transcript": "y" * 100_000}
    shared = {"transcript": "z" * 100_000}
    old = ob.start_run("a", "1", big)

    def step(tx: Any) -> None:
        tx.set_state(shared)
        tx.intend("k.x", other)

    old.transaction("s", step)
    old.complete()
    # the same value as old's state, on old's shard (a blob is stored once per shard):
    # one blob, two owners
    live = ob.start_run("a", "1", shared, run_id=on_shard(uuid7(), shard_of(old.id)))
    with ob.transaction() as tx:
        tx.intend("k.x", {"runless": "w" * 100_000}, key="old-runless")
    with ob.engine.begin() as conn:
        conn.execute(update(effects).values(status="succeeded", completed_at=OLD, updated_at=OLD))
        conn.execute(update(runs).where(runs.c.id == old.id).values(updated_at=OLD))
    assert count(ob, blobs) == 4
    report = gc(dsn)
    assert report["deleted"]["outbox_blob_refs"] == 4  # old's three and the run-less effect's
    assert report["deleted"]["outbox_blobs"] == 3
    assert count(ob, blobs) == 1
    assert ob.run(live.id).inputs == shared, "a blob another run uses stays"


def test_an_effect_resolved_just_now_keeps_the_run_that_ended_long_ago(
    ob: Outbox, dsn: str
) -> None:
    """Issue 27 item 10: a run is old only when its effects' last changes are old too."""
    run = ob.start_run("a", "1")
    effect_id = run.transaction("s", lambda tx: str(tx.intend("k.x", {"n": 1}).id))
    run.complete({"ok": True})
    with ob.engine.begin() as conn:  # long ago: the run ended, its effect went unknown
        conn.execute(update(effects).values(status="unknown", attempt=1, updated_at=OLD))
        conn.execute(update(runs).values(updated_at=OLD))
    ob.resolve_effect(effect_id, outcome="failed", note="the bank never got it", operator="al")
    kept = gc(dsn)
    assert kept["deleted"].get("outbox_runs", 0) == 0
    assert kept["deleted"].get("outbox_effects", 0) == 0
    assert [a.outcome for a in ob.store.attempts(ob.effect(effect_id).id)][-1] == "resolved"
    with ob.engine.begin() as conn:  # and once that change is old too, it all goes
        conn.execute(update(effects).values(updated_at=OLD, completed_at=OLD))
    gone = gc(dsn)
    assert gone["deleted"]["outbox_runs"] == 1 and gone["deleted"]["outbox_effects"] == 1
