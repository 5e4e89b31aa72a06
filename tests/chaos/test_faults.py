"""Fault injection under load, each test ending with the invariant checker reporting zeros.

Real processes (``outbox deliver``, ``outbox worker``, ``outbox reconcile``), a
real PostgreSQL, a real HTTP sink (:class:`deliverers.record.RecordingSink`).
Every test states its expected outcome in its docstring; every test ends with
:func:`outbox.check.logs.load` finding no lost intent, no duplicate, no
phantom and no regressed completed row.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from sqlalchemy import text

from deliverers.record import RecordingSink
from deliverers.testing import Fault
from outbox import EffectStatus, Outbox
from outbox.check import invariants, logs
from outbox.check.processes import Fleet, Process
from outbox.check.workload import (
    ScriptThread,
    Workload,
    drive_script,
    run_statuses,
    start_runs,
    write_config,
)
from outbox.storage.admin.embedded import EmbeddedServer
from outbox.storage.engine import make_engine
from outbox.storage.migrate import migrate
from outbox.storage.sql.queue import EFFECT_QUEUE, claim, claim_params
from tests.conftest import TEST_SERVER_SETTINGS
from tests.support import embedded_home, lock_waiters, wait_for

# application_name prefixes of the test process's own connections (spared by the killer)
OURS = ("chaos-%", logs.CHECKER_APP + "%")

ROOT = Path(__file__).resolve().parents[2]


def own_outbox(dsn: str, name: str = "chaos-writer") -> Outbox:
    """An Outbox whose connections say they are ours (spared by the backend killer)."""
    return Outbox(make_engine(dsn, application_name=name))


def admin(dsn: str) -> psycopg.Connection[Any]:
    return psycopg.connect(dsn, autocommit=True, application_name="chaos-admin")


def backends(dsn: str) -> list[tuple[int, str, str, str]]:
    """(pid, application_name, state, query) of every other backend of this database."""
    with admin(dsn) as conn:
        return [
            (r[0], r[1], r[2] or "", r[3] or "")
            for r in conn.execute(
                "SELECT pid, application_name, state, query FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                " AND backend_type = 'client backend'"
            )
        ]


def listeners(dsn: str) -> int:
    return sum(1 for _, _, _, query in backends(dsn) if query.startswith("LISTEN"))


@pytest.fixture
def fleet(sub_env: dict[str, str], tmp_path: Path) -> Iterator[Fleet]:
    with Fleet(sub_env, tmp_path, write_config(tmp_path)) as running:
        yield running


def all_succeeded(report: invariants.Report, total: int, dsn: str, context: str = "") -> None:
    """Every effect ``succeeded``; otherwise show the others with their attempt logs."""
    if report.statuses == {"succeeded": total}:
        return
    with admin(dsn) as conn:
        others = conn.execute(
            "SELECT e.id, e.kind, e.status, e.attempt, e.max_attempts, e.last_error,"
            " (SELECT json_agg(json_build_array(a.attempt, a.outcome, a.worker, a.detail)"
            "  ORDER BY a.id) FROM outbox_effect_attempts a WHERE a.effect_id = e.id)"
            " FROM outbox_effects e WHERE e.status <> 'succeeded'"
        ).fetchall()
    listing = "\n".join(str(row) for row in others)
    raise AssertionError(f"{report.summary()}\n{context}\nnot succeeded:\n{listing}")


# -- kill -9 ----------------------------------------------------------------------------------


def test_kill_9_of_deliverers_and_workers_at_random_points(
    ob: Outbox, dsn: str, fleet: Fleet, tmp_path: Path
) -> None:
    """Expected: every run completes and every intent is delivered exactly once.

    Two ``outbox worker`` and two ``outbox deliver`` processes work on 6 runs x 8
    steps x 3 effects while, eight times, a random one of them is killed with
    SIGKILL after a random delay and replaced (some replacements carry a crash
    point and kill themselves later). A dead worker's run is resumed elsewhere
    from its last recorded step (its intents are not written twice); a dead
    deliverer's attempts are recovered by the reconciler and redelivered with
    the same key (the sink applies each once). The checker finds 0 of everything
    and every effect ``succeeded``.
    """
    seed = int(os.environ.get("CHAOS_SEED") or random.randrange(2**32))  # to replay a failure
    rng = random.Random(seed)
    with RecordingSink(tmp_path / "sink.jsonl", latency=0.05) as sink:
        wl = Workload(runs=6, steps=8, effects=3, sink_url=sink.url, pause=0.3)
        run_ids = start_runs(ob, wl)
        pools: dict[str, list[Process]] = {
            "worker": [fleet.worker("--concurrency", "2") for _ in range(2)],
            "deliverer": [fleet.deliverer("--concurrency", "8") for _ in range(2)],
        }
        crash_points = {
            "worker": [None, None, "after_step:3", "before_step_commit:2"],
            "deliverer": [None, None, "after_claim:4", "after_call:6", "during_completion:3"],
        }
        killed: list[str] = []
        crash_at_of: dict[int, str | None] = {}

        def top_up(final: bool = False) -> None:
            for role, procs in pools.items():
                procs[:] = fleet.alive(procs)
                while len(procs) < 2:
                    crash_at = None if final else rng.choice(crash_points[role])
                    extra = ("--concurrency", "2" if role == "worker" else "8")
                    spawn = fleet.worker if role == "worker" else fleet.deliverer
                    procs.append(spawn(*extra, crash_at=crash_at))
                    crash_at_of[procs[-1].pid] = crash_at

        for _ in range(8):
            time.sleep(rng.uniform(0.4, 1.4))
            role = rng.choice(sorted(pools))
            candidates = fleet.alive(pools[role])
            if candidates:
                victim = rng.choice(candidates)
                fleet.kill9(victim)
                killed.append(role)
            top_up()
        # Processes that carry a crash point go too; plain ones finish the job.
        for procs in pools.values():
            for proc in fleet.alive(procs):
                if crash_at_of.get(proc.pid) is not None:
                    fleet.kill9(proc)
        top_up(final=True)
        context = f"seed {seed}; killed {killed}"
        logs.settle(
            dsn,
            timeout=120,
            sink=sink,
            also=lambda: run_statuses(ob, run_ids) == {"completed": wl.runs},
        )
        survivors = [p for procs in pools.values() for p in procs]
        # A process SIGTERMed while Python was still starting it (a late top-up, the
        # work already done by the others) dies of the signal before any handler of
        # ours is installed, with nothing logged and nothing held: CI saw one. Every
        # process that got as far as logging must stop cleanly, with 0.
        codes = [(fleet.stop(p), fleet.log_of(p)) for p in survivors]
        assert all(
            code == 0 or (code == -signal.SIGTERM and not log.strip()) for code, log in codes
        ), fleet.tails()

    report = logs.load(dsn, sink.log_path, expected_operations=wl.expected_operations(run_ids))
    report.assert_clean(context)
    all_succeeded(report, wl.total, dsn, context)
    assert killed, context


# -- pg_terminate_backend ----------------------------------------------------------------------


def terminate_all_but_ours(dsn: str) -> list[tuple[str, str]]:
    """``pg_terminate_backend`` every backend of the database but the test's own connections."""
    with admin(dsn) as conn:
        rows = conn.execute(
            "SELECT application_name, query, pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            " AND backend_type = 'client backend'"
            " AND application_name NOT LIKE %s AND application_name NOT LIKE %s",
            list(OURS),
        ).fetchall()
    return [(name, query) for name, query, _ in rows]


def test_pg_terminate_backend_of_every_deliverer_connection(
    dsn: str, fleet: Fleet, tmp_path: Path
) -> None:
    """Expected: the deliverers survive losing every connection they have, again and again.

    Two deliverers work through 4 runs x 5 steps x 5 effects written while, ten
    times, every backend of the test database except the test's own is
    terminated (``pg_terminate_backend``): pooled engine connections in and out
    of transactions, and the LISTEN connection when there is one (see
    :func:`test_the_deliver_command_listens_and_listens_again_after_termination`).
    Claims, heartbeats and completion writes that fail are retried; a completion
    whose commit was cut off is recorded once (a replay is logged ``stale``).
    Both deliverers are still running at the end, exit 0 on SIGTERM, and the
    checker finds 0 of everything.
    """
    with RecordingSink(tmp_path / "sink.jsonl", latency=0.15) as sink, own_outbox(dsn) as ob:
        wl = Workload(runs=4, steps=5, effects=5, sink_url=sink.url)
        run_ids = start_runs(ob, wl)
        deliverers = [fleet.deliverer("--concurrency", "4") for _ in range(2)]
        wait_for(
            lambda: sum(b[1] == "outbox-deliver" for b in backends(dsn)) >= 2,
            timeout=60,
            message="both deliverers connected",
        )
        terminated: list[tuple[str, str]] = []
        with ScriptThread(ob, wl, run_ids, between_steps=0.1) as script:
            for _ in range(10):
                time.sleep(0.4)
                terminated += terminate_all_but_ours(dsn)
            script.join()
        assert sum(name == "outbox-deliver" for name, _ in terminated) >= 10, terminated
        logs.settle(dsn, timeout=90, sink=sink)
        assert fleet.alive(deliverers) == deliverers, fleet.tails()
        assert [fleet.stop(p) for p in deliverers] == [0, 0], fleet.tails()
        assert run_statuses(ob, run_ids) == {"completed": wl.runs}

    report = logs.load(dsn, sink.log_path, expected_operations=wl.expected_operations(run_ids))
    report.assert_clean(f"{len(terminated)} backends terminated")
    all_succeeded(report, wl.total, dsn)


def test_the_deliver_command_listens_and_listens_again_after_termination(
    dsn: str, fleet: Fleet, tmp_path: Path
) -> None:
    """Expected: ``outbox deliver`` holds a LISTEN connection, and opens a new one when it is
    terminated; an intent committed afterwards is delivered (the deliverer keeps working)."""
    deliverer = fleet.deliverer()
    wait_for(lambda: listeners(dsn) == 1, timeout=15, message="the deliverer listens")
    terminated = terminate_all_but_ours(dsn)
    assert any(query.startswith("LISTEN") for _, query in terminated), terminated
    wait_for(lambda: listeners(dsn) == 1, timeout=15, message="LISTEN reconnected")
    with RecordingSink(tmp_path / "sink.jsonl") as sink, own_outbox(dsn) as ob:
        wl = Workload(runs=1, steps=1, effects=3, sink_url=sink.url)
        run_ids = start_runs(ob, wl)
        drive_script(ob, wl, run_ids)
        logs.settle(dsn, timeout=30, sink=sink)
        assert fleet.stop(deliverer) == 0, fleet.tails()
    report = logs.load(dsn, sink.log_path, expected_operations=wl.expected_operations(run_ids))
    report.assert_clean()
    all_succeeded(report, wl.total, dsn)


# -- PostgreSQL restart -----------------------------------------------------------------------


@pytest.fixture
def own_server() -> Iterator[tuple[EmbeddedServer, str]]:
    """A PostgreSQL of this test's own (the session's shared one is never restarted).

    ``synchronous_commit`` is on here, unlike the suite's other servers: with it
    off, PostgreSQL acknowledges a commit before its WAL leaves shared memory,
    and an immediate restart may forget it (an intent a deliverer already
    delivered, a completion already reported): durability the suite otherwise
    trades for speed, but the very thing this test is about.
    """
    home = embedded_home("outbox-chaos-pg-")
    server = EmbeddedServer(home, settings={**TEST_SERVER_SETTINGS, "synchronous_commit": "on"})
    try:
        dsn = server.ensure_running()
        engine = make_engine(dsn)
        try:
            migrate(engine)
        finally:
            engine.dispose()
        yield server, dsn
    finally:
        server.stop(mode="immediate")
        shutil.rmtree(home, ignore_errors=True)


@pytest.mark.parametrize("daemon", ["deliver", "worker"])
def test_a_daemon_whose_start_up_check_is_cut_without_a_word_tries_again(
    own_server: tuple[EmbeddedServer, str], sub_env: dict[str, str], tmp_path: Path, daemon: str
) -> None:
    """A server that dies under the start-up check answers nothing (no SQLSTATE):
    the connection it had accepted just closes, as CI saw when a restart came while
    a deliverer was starting. That server was reached, so the check is tried again
    until it is back, as for any lost connection; only a server never reached the
    first time ends the start at once. Here the check's own backend is killed with
    SIGKILL, and PostgreSQL restarts every backend after it. A worker's start
    (connecting its client) is tried again the same way."""
    server, dsn = own_server
    config = tmp_path / "deliverers.toml"
    config.write_text(
        '[kinds."k.start"]\ntype = "python.call"\nfunction = "bench.sinks:noop"\n'
        "idempotent = true\n"
    )
    if daemon == "deliver":
        command, application = ["deliver", "--config", str(config)], "outbox-cli"
    else:
        handler = "tests.fixtures_callables:intends_one"
        command = ["worker", handler, "--agent", "agent", "--version", "1"]
        application = "outbox"
    log_path = tmp_path / f"{daemon}.log"
    locker = psycopg.connect(dsn)
    locker.execute("LOCK TABLE outbox_migrations IN ACCESS EXCLUSIVE MODE")
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "outbox", *command],
            env={**sub_env, "OUTBOX_DSN": dsn},
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    delivery: subprocess.Popen[bytes] | None = None
    try:
        (pid,) = wait_for(
            lambda: lock_waiters(dsn, application),
            timeout=60,
            message="the start-up check waits on the lock",
        )
        os.kill(pid, signal.SIGKILL)
        locker.close()  # PostgreSQL ended every backend, this one's too

        def accepting() -> bool:
            # Only once the crash restart began: a connection made before it (the
            # postmaster had not yet ended every backend) is closed under the test.
            if "all server processes terminated" not in server.logfile.read_text(errors="replace"):
                return False
            try:
                with admin(dsn) as conn:
                    return conn.execute("SELECT true").fetchone() is not None
            except psycopg.OperationalError:  # still in recovery
                return False

        wait_for(accepting, timeout=60, message="PostgreSQL back after the crash")
        with own_outbox(dsn) as ob:
            if daemon == "deliver":
                run = ob.start_run("agent", "1")
                run.transaction("s", lambda tx: tx.intend("k.start", {"n": 1}) and None)
            else:  # the worker's run intends the effect; a deliverer started now delivers it
                ob.start_run("agent", "1")
                delivery = subprocess.Popen(
                    [sys.executable, "-m", "outbox", "deliver", "--config", str(config)],
                    env={**sub_env, "OUTBOX_DSN": dsn},
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            wait_for(
                lambda: [e.status for e in ob.effects()] == [EffectStatus.SUCCEEDED],
                timeout=60,
                message=f"delivered:\n{log_path.read_text()[-3000:]}",
            )
        assert proc.poll() is None, log_path.read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        for process in (proc, delivery):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    text = log_path.read_text()
    assert "the connection was lost" in text and "server closed the connection" in text, text
    server_log = server.logfile.read_text(errors="replace")
    assert "was terminated by signal 9" in server_log, server_log[-2000:]


def test_postgresql_restart_in_the_middle_of_load(
    own_server: tuple[EmbeddedServer, str], sub_env: dict[str, str], tmp_path: Path
) -> None:
    """Expected: after an immediate (crash) restart mid-load, everything still completes.

    Two deliverers deliver 6 runs x 5 steps x 4 effects while a script keeps
    writing steps; PostgreSQL is restarted with ``-m immediate`` (no checkpoint:
    WAL replay on start) while calls are in flight. The script retries its
    failed steps (a step that did commit is replayed, not written twice); the
    deliverers reconnect; attempts whose completion could not be written are
    recovered when their leases run out. Every intent ends ``succeeded``, each
    applied once, and the checker finds 0 of everything.
    """
    server, dsn = own_server
    env = {**sub_env, "OUTBOX_DSN": dsn}
    with (
        RecordingSink(tmp_path / "sink.jsonl", latency=0.1) as sink,
        own_outbox(dsn) as ob,
        Fleet(env, tmp_path, write_config(tmp_path)) as fleet,
    ):
        wl = Workload(runs=6, steps=5, effects=4, sink_url=sink.url)
        run_ids = start_runs(ob, wl)
        deliverers = [fleet.deliverer("--concurrency", "4") for _ in range(2)]
        with ScriptThread(ob, wl, run_ids, retry_seconds=90, between_steps=0.05) as script:
            wait_for(
                lambda: logs.open_counts(dsn).get("succeeded", 0) >= 20,
                timeout=60,
                message="delivery under way",
            )
            before = logs.open_counts(dsn)
            server.restart(mode="immediate")
            script.join(timeout=120)
        ob.engine.dispose()  # pooled connections from before the restart are dead
        after_restart = logs.open_counts(dsn)
        logs.settle(dsn, timeout=90, sink=sink)
        assert fleet.alive(deliverers) == deliverers, fleet.tails()
        assert [fleet.stop(p) for p in deliverers] == [0, 0], fleet.tails()
        assert run_statuses(ob, run_ids) == {"completed": wl.runs}

    server_log = server.logfile.read_text(errors="replace")
    assert "not properly shut down" in server_log or "redo" in server_log, server_log[-2000:]
    report = logs.load(dsn, sink.log_path, expected_operations=wl.expected_operations(run_ids))
    report.assert_clean(f"before restart {before}; just after {after_restart}")
    all_succeeded(report, wl.total, dsn)


# -- a misbehaving sink -----------------------------------------------------------------------


def test_a_sink_that_rate_limits_fails_and_hangs_under_load(
    ob: Outbox, dsn: str, fleet: Fleet, tmp_path: Path
) -> None:
    """Expected: idempotent effects all succeed once; non-idempotent ones succeed or are unknown.

    4 runs x 4 steps x 5 effects (every fifth one to a sink the deliverer may
    not resend to blindly, ``http.blind``) through two deliverers while the sink
    answers, in turn, 429 with ``Retry-After: 1`` (4 times), 500 before applying
    (6), 500 after applying (6), hangs past the request's 1 s timeout (3) and
    drops the connection (3). Idempotent effects are retried with their key:
    each applied once, all ``succeeded``, and a 429's next attempt never starts
    before its ``Retry-After``. A non-idempotent effect whose answer was
    ambiguous (500, timeout, dropped connection) is ``unknown``, never resent;
    the others succeed. The checker finds 0 of everything.
    """
    with RecordingSink(tmp_path / "sink.jsonl", latency=0.05) as sink:
        wl = Workload(runs=4, steps=4, effects=5, sink_url=sink.url, timeout=1.0, blind_every=5)
        run_ids = start_runs(ob, wl)
        drive_script(ob, wl, run_ids)
        for fault in (
            Fault("429", times=4, retry_after="1"),
            Fault("500_before", times=6),
            Fault("500_after", times=6),
            Fault("hang", times=3, hang_seconds=2.5),
            Fault("down", times=3),
        ):
            sink.inject(fault)
        deliverers = [fleet.deliverer("--concurrency", "8") for _ in range(2)]
        logs.settle(dsn, timeout=120, sink=sink)
        assert not sink.state.faults or all(f.times == 0 for f in sink.state.faults)
        assert [fleet.stop(p) for p in deliverers] == [0, 0], fleet.tails()

    report = logs.load(dsn, sink.log_path, expected_operations=wl.expected_operations(run_ids))
    report.assert_clean()
    blind = {e.id for e in ob.effects(kind="http.blind", limit=1000)}
    assert len(blind) == wl.total // 5
    for e in ob.effects(limit=1000):
        allowed = {"succeeded", "unknown"} if e.id in blind else {"succeeded"}
        assert e.status.value in allowed, (e.id, e.kind, e.status, e.last_error)
    with ob.engine.connect() as conn:
        log = conn.execute(
            text(
                "SELECT effect_id, attempt, outcome, started_at, finished_at,"
                " (detail->>'status')::int AS status FROM outbox_effect_attempts ORDER BY id"
            )
        ).all()
    for e in ob.effects(kind="http.blind", status="unknown", limit=1000):
        tried = [r for r in log if r.effect_id == e.id]
        # Never resent: the ambiguous attempt is the effect's last one.
        assert tried and tried[-1].outcome in ("unknown", "expired"), tried
        assert tried[-1].attempt == max(r.attempt for r in tried), tried
    statuses = {row.status for row in log if row.outcome in ("retry", "unknown")}
    assert {429, 500} <= statuses, statuses
    rate_limited = [row for row in log if row.status == 429]
    assert rate_limited, "the 429s were answered"
    for row in rate_limited:
        after = [r for r in log if r.effect_id == row.effect_id and r.attempt == row.attempt + 1]
        assert after and after[0].started_at is not None
        waited = (after[0].started_at - row.finished_at).total_seconds()
        assert waited >= 1.0, f"Retry-After not honoured: next attempt after {waited:.3f}s"


# -- a paused deliverer -----------------------------------------------------------------------


def test_a_paused_deliverer_cannot_overwrite_the_newer_attempt(
    ob: Outbox, dsn: str, fleet: Fleet, tmp_path: Path
) -> None:
    """Expected: the late outcome of a deliverer paused past its lease is logged ``stale``.

    Deliverer A is inside six calls when it is stopped (SIGSTOP) for longer than
    its 1 s lease, outside any transaction. Deliverer B's reconciler finds the
    expired leases, puts the effects back (same key) and B delivers them as
    attempt 2 (the sink replays its stored answers). Then A is continued
    (SIGCONT): its calls return and it writes their outcomes for attempt 1, which
    are logged ``stale`` and change nothing: every effect stays ``succeeded`` at
    attempt 2, recorded by B. The checker finds 0 of everything.
    """
    n = 6
    host = socket.gethostname()
    with RecordingSink(tmp_path / "sink.jsonl", latency=4.0) as sink:
        # A generous request timeout: A's calls must still end in success after the pause.
        wl = Workload(runs=1, steps=1, effects=n, sink_url=sink.url, timeout=60)
        run_ids = start_runs(ob, wl)
        drive_script(ob, wl, run_ids)
        a = fleet.deliverer("--concurrency", str(n))
        for _ in range(50):
            wait_for(lambda: sink.in_progress == n, timeout=60, message="A inside every call")
            a.send_signal(signal.SIGSTOP)
            time.sleep(0.3)  # whatever A had sent reaches its end in the server
            busy = [
                b for b in backends(dsn) if b[1] == "outbox-deliver" and b[2] not in ("idle", "")
            ]
            if not busy:
                break
            a.send_signal(signal.SIGCONT)  # stopped inside a transaction: try again
            time.sleep(0.05)
        else:
            pytest.fail("A could not be stopped outside a transaction")
        sink.latency = 0.0
        try:
            b = fleet.deliverer("--concurrency", str(n))

            def taken_over() -> bool:
                effects = ob.effects(limit=100)
                return all(e.status.value == "succeeded" and e.attempt == 2 for e in effects)

            wait_for(taken_over, timeout=60, message="B delivers attempt 2")
        finally:
            a.send_signal(signal.SIGCONT)

        def stale_logged() -> bool:
            logs = [ob.store.attempts(e.id) for e in ob.effects(limit=100)]
            return all(any(x.outcome == "stale" for x in log) for log in logs)

        wait_for(stale_logged, timeout=60, message="A's late outcomes in the attempt log")
        logs.settle(dsn, timeout=30, sink=sink)
        assert [fleet.stop(a), fleet.stop(b)] == [0, 0], fleet.tails()

    for effect in ob.effects(limit=100):
        assert (effect.status.value, effect.attempt) == ("succeeded", 2)
        log = ob.store.attempts(effect.id)
        mine = [
            (x.attempt, x.outcome) for x in log if (x.worker or "").startswith(f"{host}:{a.pid}:")
        ]
        theirs = [
            (x.attempt, x.outcome) for x in log if (x.worker or "").startswith(f"{host}:{b.pid}:")
        ]
        assert mine == [(1, "stale")], log
        assert theirs == [(2, "succeeded")], log
        assert [x.detail["reported"] for x in log if x.outcome == "stale"] == ["succeeded"]
        assert [
            (x.attempt, x.outcome) for x in log if (x.worker or "").startswith("reconciler:")
        ] == [(1, "expired")], log
    report = logs.load(dsn, sink.log_path, expected_operations=wl.expected_operations(run_ids))
    report.assert_clean()
    assert report.stale == n
    all_succeeded(report, n, dsn)


# -- two reconcilers ---------------------------------------------------------------------------


def test_two_reconcilers_started_together_resolve_each_attempt_once(
    ob: Outbox, dsn: str, sub_env: dict[str, str], fleet: Fleet, tmp_path: Path
) -> None:
    """Expected: each of 120 expired attempts is resolved by exactly one of two reconcilers.

    40 effects each of an idempotent kind, a non-idempotent kind, and a
    non-idempotent kind with a lookup URL (half of those already applied at the
    sink), all claimed by a deliverer that then vanished. Two ``outbox
    reconcile`` processes start at the same moment (the sink holds lookups
    until both are asking, so they do overlap): every attempt is resolved once
    between them (their reports are disjoint and cover all 120; each attempt
    log has one resolution), as its declaration says: redeliver, ``unknown``, or
    by lookup ``succeeded`` / redeliver. A deliverer then finishes what was put
    back; the checker finds 0 of everything (the ``unknown`` ones wait for an
    operator).
    """
    n = 40
    with RecordingSink(tmp_path / "sink.jsonl", lookup_latency=0.05, lookup_barrier=2) as sink:
        config = write_config(
            tmp_path,
            f"""
[kinds."http.lookup"]
type = "http.request"
idempotent = false
allow_private = ["127.0.0.1"]
lookup_url = "{sink.url}/idempotency/{{key}}"
""",
        )
        run = ob.start_run("agent", "1")
        kinds = ("http.request", "http.blind", "http.lookup")

        def step(tx: Any) -> None:
            for kind in kinds:
                for i in range(n):
                    op = f"{kind}:{i}"
                    tx.intend(kind, {"url": f"{sink.url}/x", "json": {"operation": op}})

        run.transaction("s", step)
        with httpx.Client() as client:  # half of the lookup kind did reach the sink
            for e in ob.effects(kind="http.lookup", limit=1000)[: n // 2]:
                response = client.post(
                    e.payload["url"],
                    json=e.payload["json"],
                    headers={"Idempotency-Key": e.idempotency_key},
                )
                assert response.status_code == 200
        with ob.engine.begin() as conn:  # claimed by a deliverer that then died
            for kind in kinds:
                params = claim_params({"kind": kind}, limit=1000, owner="dead", lease_seconds=0)
                assert len(conn.execute(claim(EFFECT_QUEUE), params).all()) == n

        procs = []
        for i in range(2):
            with (tmp_path / f"reconcile-{i}.err").open("wb") as err:
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "outbox",
                            "reconcile",
                            "--config",
                            str(config),
                            "--json",
                        ],
                        env=sub_env,
                        stdout=subprocess.PIPE,
                        stderr=err,
                    )
                )
        outputs = [p.communicate(timeout=120)[0] for p in procs]
        errors = [(tmp_path / f"reconcile-{i}.err").read_text() for i in range(2)]
        assert [p.returncode for p in procs] == [0, 0], errors
        reports = [json.loads(out) for out in outputs]
        items = [[(i["effect_id"], i["attempt"], i["action"]) for i in r["items"]] for r in reports]
        resolved = [{(eid, attempt) for eid, attempt, _ in mine} for mine in items]
        assert not resolved[0] & resolved[1], "an attempt resolved twice"
        assert len(resolved[0]) + len(resolved[1]) == 3 * n
        assert len(items[0]) + len(items[1]) == 3 * n
        assert len(sink.lookup_peers) >= 2, "the two did not overlap"
        assert all(mine for mine in items), [len(x) for x in items]
        actions: dict[str, int] = {}
        for _, _, action in items[0] + items[1]:
            actions[action] = actions.get(action, 0) + 1
        assert actions == {
            "redeliver": n,
            "unknown": n,
            "looked_up_succeeded": n // 2,
            "looked_up_redeliver": n // 2,
        }, actions
        for e in ob.effects(limit=1000):
            log = [(x.attempt, x.outcome) for x in ob.store.attempts(e.id)]
            resolution = "looked_up" if e.kind == "http.lookup" else "expired"
            assert log == [(1, resolution)], (e.kind, log)

        fleet.config = config
        deliverer = fleet.deliverer("--concurrency", "8")
        logs.settle(dsn, timeout=60, sink=sink)
        assert fleet.stop(deliverer) == 0, fleet.tails()

    expected = [f"{kind}:{i}" for kind in kinds for i in range(n)]
    report = logs.load(dsn, sink.log_path, expected_operations=expected)
    report.assert_clean()
    ambiguous = [
        (e.kind, e.attempt, e.last_error)
        for e in ob.effects(status="unknown", limit=1000)
        if e.kind != "http.blind"
    ]
    assert report.statuses == {"succeeded": 2 * n, "unknown": n}, f"{ambiguous}"
