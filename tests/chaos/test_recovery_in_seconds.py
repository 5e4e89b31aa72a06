"""``kill -9`` of a deliverer holding both kinds: idempotent attempts back at once, no blind resend.

Two real ``outbox deliver`` processes and the real HTTP sink. The victim claims
every intent (idempotent ``http.request`` and non-idempotent ``http.blind``)
and is killed while its calls are in flight; a peer is running. Expected:

- the idempotent attempts are put back by the peer's reconciler as soon as the
  victim's session lock is gone, long before their lease, and delivered again
  with the same key (the sink applies each once);
- the non-idempotent attempts are not touched before their lease runs out, and
  then become ``unknown``: the sink sees each of them once, never twice;
- nothing is applied twice.

How fast (the ≤ 2 s target) is measured by ``python -m bench --only recovery``.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest

from deliverers.testing import IdempotentHttpSink
from outbox import Outbox
from outbox.check.processes import start_deliverer
from outbox.check.workload import write_config
from outbox.storage.dsn import libpq_dsn
from tests.chaos.test_deliverer_crash import intend_both_kinds
from tests.support import wait_for

LEASE = 15.0
N = 10
FIRST_CALL_SECONDS = 25.0


@pytest.fixture
def sink() -> Iterator[IdempotentHttpSink]:
    # Slow enough that every first call is still in flight when the victim is
    # killed, however long the peer takes to start; quick after the kill.
    with IdempotentHttpSink(latency=FIRST_CALL_SECONDS) as running:
        yield running


def rows(dsn: str, sql: str, params: Any = ()) -> list[tuple[Any, ...]]:
    with psycopg.connect(libpq_dsn(dsn), autocommit=True) as conn:
        return conn.execute(sql, params).fetchall()


def owners_of(dsn: str) -> set[str]:
    return {
        r[0]
        for r in rows(
            dsn, "SELECT DISTINCT lease_owner FROM outbox_effects WHERE lease_owner IS NOT NULL"
        )
    }


def test_kill_9_idempotent_back_at_once_blind_waits_for_lease(
    ob: Outbox, dsn: str, sub_env: dict[str, str], tmp_path: Path, sink: IdempotentHttpSink
) -> None:
    intend_both_kinds(ob, sink.url, N)
    config = write_config(tmp_path)
    lease = ("--lease", str(LEASE))
    victim = start_deliverer(sub_env, config, tmp_path / "victim.log", *lease)
    peer: subprocess.Popen[bytes] | None = None
    try:
        # The victim holds every intent, mid-call.
        wait_for(
            lambda: (
                rows(dsn, "SELECT count(*) FROM outbox_effects WHERE status = 'in_flight'")[0][0]
                == 2 * N
                and sink.stats()["requests"] == 2 * N
            ),
            timeout=60,
            message="the victim to claim and call everything",
        )
        (victim_owner,) = owners_of(dsn)
        registered = {r[0] for r in rows(dsn, "SELECT owner FROM outbox_owners")}
        assert victim_owner in registered, "the victim registered the owner whose lock it holds"
        peer = start_deliverer(sub_env, config, tmp_path / "peer.log", *lease)
        wait_for(
            lambda: len(rows(dsn, "SELECT owner FROM outbox_owners")) == 2,
            timeout=60,
            message="the peer to take its owner lock",
        )
        lease_ends = {
            r[0]: r[1]
            for r in rows(
                dsn, "SELECT id, lease_expires_at FROM outbox_effects WHERE status = 'in_flight'"
            )
        }
        # Just after PostgreSQL starts no deliverer counts as gone (every lock is
        # free after a restart): this test's server may be that young.
        uptime = rows(dsn, "SELECT extract(epoch FROM now() - pg_postmaster_start_time())")
        time.sleep(max(0.0, 5.5 - float(uptime[0][0])))
        sink.latency = 0.2  # the redeliveries are quick; the calls in flight keep sleeping
        victim.send_signal(signal.SIGKILL)
        assert victim.wait(timeout=10) == -signal.SIGKILL
        killed = time.time()

        def idempotent_done() -> bool:
            got = rows(
                dsn,
                "SELECT count(*) FROM outbox_effects "
                "WHERE kind = 'http.request' AND status = 'succeeded'",
            )
            return int(got[0][0]) == N

        wait_for(idempotent_done, timeout=LEASE, message="idempotent effects redelivered")
        back = rows(
            dsn,
            "SELECT e.id, e.attempt, e.attempt_started_at, e.lease_owner, a.worker, a.detail "
            "FROM outbox_effects e JOIN outbox_effect_attempts a "
            "ON a.effect_id = e.id AND a.outcome = 'expired' WHERE e.kind = 'http.request'",
        )
        assert len(back) == N, "each idempotent attempt was put back once, by the reconciler"
        for effect_id, attempt, started, _, worker, detail in back:
            assert attempt == 2 and worker.startswith("reconciler:")
            assert "is gone" in detail["note"] and detail["resolution"] == "redeliver"
            started_at: datetime = started
            assert started_at < lease_ends[effect_id], "redelivered before the lease ran out"
        seconds = max(r[2].timestamp() for r in back) - killed
        put_back = rows(
            dsn,
            "SELECT max(a.finished_at) FROM outbox_effect_attempts a "
            "JOIN outbox_effects e ON e.id = a.effect_id "
            "WHERE e.kind = 'http.request' AND a.outcome = 'expired'",
        )[0][0]
        print(f"kill -9 -> put back: {put_back.timestamp() - killed:.2f} s")
        print(f"kill -9 -> last idempotent redelivery started: {seconds:.2f} s (lease {LEASE} s)")

        # Meanwhile the blind ones are still the dead victim's: not resent, not expired.
        blind = rows(
            dsn,
            "SELECT status, lease_owner, attempt FROM outbox_effects WHERE kind = 'http.blind'",
        )
        if time.time() < min(lease_ends.values()).timestamp():
            assert {(s, o, a) for s, o, a in blind} == {("in_flight", victim_owner, 1)}

        wait_for(
            lambda: (
                rows(
                    dsn,
                    "SELECT count(*) FROM outbox_effects "
                    "WHERE kind = 'http.blind' AND status = 'unknown'",
                )[0][0]
                == N
            ),
            timeout=LEASE + 30,
            message="blind effects to become unknown after their lease",
        )
        expired = rows(
            dsn,
            "SELECT a.finished_at, e.id FROM outbox_effect_attempts a "
            "JOIN outbox_effects e ON e.id = a.effect_id "
            "WHERE e.kind = 'http.blind' AND a.outcome = 'expired'",
        )
        assert len(expired) == N
        assert all(finished >= lease_ends[i] for finished, i in expired), "none before its lease"
    finally:
        for process in (victim, peer):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                assert process.wait(timeout=60) == 0

    # The victim's blind calls land when their long sleep ends.
    wait_for(lambda: sink.stats()["operations_applied"] == 2 * N, timeout=FIRST_CALL_SECONDS)
    stats = sink.stats()
    assert stats["duplicate_keys_applied"] == [] and stats["duplicate_operations"] == []
    blind_keys = {
        r[0]
        for r in rows(dsn, "SELECT idempotency_key FROM outbox_effects WHERE kind = 'http.blind'")
    }
    assert all(sink.state.received[k] == 1 for k in blind_keys), "no blind effect was sent twice"
    assert all(sink.state.received[k] == 2 for k in sink.state.received if k not in blind_keys)
