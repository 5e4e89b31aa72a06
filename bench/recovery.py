"""Recovery after ``kill -9``: effects held by a dead deliverer, delivered again, no duplicates.

Two ``outbox deliver --lease 10`` processes (the victim and a peer) run a
sink that takes 0.5 s (idempotent; it logs each key when called,
:func:`bench.sinks.slow`); a backlog of 192 effects is committed, and the
victim gets SIGKILL mid-call once it holds a batch. The peer's reconciler sees
the victim's session lock gone and puts its attempts back (migration 0012);
the clock runs from the kill until every effect the dead one held has
succeeded again; the sink's log and the attempt log are then checked for
duplicates.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any
from uuid import UUID

from bench.harness import Bench, log, summarize
from bench.processes import DelivererProcess, wait_drained
from bench.sinks import SINK_LOG_ENV, SLOW_KIND, SLOW_SECONDS
from outbox.delivery.settings import DeliverySettings

LEASE = 10.0
BACKLOG = 192
#: DeliverySettings.restart_grace_seconds (its default).
RESTART_GRACE = DeliverySettings().restart_grace_seconds


def held_by(bench: Bench, pid: int) -> list[tuple[UUID, float, str]]:
    """(id, lease expiry epoch, key) of the effects a deliverer process holds in flight."""
    rows = bench.rows(
        "SELECT id, extract(epoch FROM lease_expires_at)::float8, idempotency_key "
        "FROM outbox_effects WHERE status = 'in_flight' AND lease_owner LIKE %s",
        [f"%:{pid}:%"],
    )
    return [(r[0], float(r[1]), str(r[2])) for r in rows]


def registered(bench: Bench, pid: int) -> bool:
    """Whether the deliverer process ``pid`` holds its owner lock (it registered its owner)."""
    return bool(
        bench.value("SELECT count(*) FROM outbox_owners WHERE owner LIKE %s", [f"%:{pid}:%"])
    )


def recovery_rep(bench: Bench, workdir: Path) -> dict[str, Any]:
    bench.reset()
    sink_log = workdir / f"sink-{time.monotonic_ns()}.log"
    env = {SINK_LOG_ENV: str(sink_log)}
    options = ["--lease", str(LEASE)]
    victim = DelivererProcess(bench, workdir, SLOW_KIND, name="victim", options=options, env=env)
    rescuer = DelivererProcess(bench, workdir, SLOW_KIND, name="rescuer", options=options, env=env)
    try:
        deadline = time.monotonic() + 60
        for proc in (victim, rescuer):
            proc.wait_started()
            while not registered(bench, proc.pid):
                proc.check()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{proc.pid} never took its owner lock:\n{proc.tail()}")
                time.sleep(0.01)
        # Just after PostgreSQL starts, every lock is free and no deliverer counts as
        # gone for a few seconds (a restart must not look like deaths): wait past it.
        uptime = bench.value("SELECT extract(epoch FROM now() - pg_postmaster_start_time())")
        time.sleep(max(0.0, RESTART_GRACE + 0.5 - float(uptime)))
        bench.insert_backlog(BACKLOG, SLOW_KIND)
        # Until one of them holds its first batch: that one is the victim. Both poll,
        # so which one claims first is up to the scheduler (on a loaded machine the
        # "rescuer" sometimes took the whole backlog, and a victim waited in vain).
        while not (held_by(bench, victim.pid) or held_by(bench, rescuer.pid)):
            victim.check()
            rescuer.check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"neither deliverer claimed:\n{victim.tail()}")
            time.sleep(0.01)
        if len(held_by(bench, rescuer.pid)) > len(held_by(bench, victim.pid)):
            victim, rescuer = rescuer, victim
        time.sleep(SLOW_SECONDS / 2)  # mid-call
        killed_at = victim.kill9()
        held = held_by(bench, victim.pid)
        if not held:
            raise RuntimeError("the victim held nothing when it was killed")
        ids, held_keys = [h[0] for h in held], {h[2] for h in held}
        expires = max(h[1] for h in held)
        deadline = time.monotonic() + 10 * LEASE + 60
        while True:
            done, redelivered, restarted = bench.rows(
                "SELECT count(*) FILTER (WHERE status = 'succeeded'), "
                "extract(epoch FROM max(completed_at))::float8, "
                "extract(epoch FROM max(attempt_started_at))::float8 "
                "FROM outbox_effects WHERE id = ANY(%s)",
                [ids],
            )[0]
            if done == len(ids):
                break
            rescuer.check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the held effects were not redelivered:\n{rescuer.tail()}")
            time.sleep(0.02)
        wait_drained(bench, [rescuer], timeout=120)
    finally:
        victim.stop()
        rescuer.stop()
    calls = Counter(line.split()[1] for line in sink_log.read_text().splitlines() if line.strip())
    twice = {key for key, count in calls.items() if count > 1}
    keys = {k for (k,) in bench.rows("SELECT idempotency_key FROM outbox_effects")}
    return {
        "kill_to_redelivered_s": redelivered - killed_at,
        "kill_to_last_restart_s": restarted - killed_at,
        "expiry_to_redelivered_s": redelivered - expires,
        "lease_left_at_kill_s": expires - killed_at,
        "held": len(ids),
        "raw_sink_calls": sum(calls.values()),
        "keys_called_twice": len(twice),
        "resent_outside_held": len(twice - held_keys),
        "keys_missing_at_sink": len(keys - set(calls)),
        "effects_succeeded_twice": bench.value(
            "SELECT count(*) FROM (SELECT effect_id FROM outbox_effect_attempts "
            "WHERE outcome = 'succeeded' GROUP BY effect_id HAVING count(*) > 1) AS t"
        ),
        "all_succeeded": bench.counts().get("succeeded") == BACKLOG,
    }


def recovery(bench: Bench, workdir: Path, quick: bool) -> dict[str, Any]:
    got = []
    for rep in range(1 if quick else 3):
        got.append(recovery_rep(bench, workdir))
        log(
            f"recovery rep {rep + 1}: {got[-1]['held']} held, kill -> redelivered "
            f"{got[-1]['kill_to_redelivered_s']:.2f} s"
        )
    out = summarize(got)
    for key in ("effects_succeeded_twice", "resent_outside_held", "keys_missing_at_sink"):
        out[key] = max(g[key] for g in got)  # the worst repetition
    return {**out, "lease_s": LEASE, "backlog": BACKLOG, "sink_seconds": SLOW_SECONDS}
