"""``outbox deliver`` survives losing its connection while it starts (issue 31).

The start-up schema check is held on a lock the test takes, its backend is
terminated (as ``pg_terminate_backend`` of every deliverer connection does in
tests/chaos/test_faults.py, where this flaked), and the lock released: the
deliverer tries again, starts, delivers, and stops with 0.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg

from outbox import EffectStatus, Outbox
from tests.support import lock_waiters, wait_for


def test_a_connection_cut_during_the_start_up_check_is_tried_again(
    ob: Outbox, dsn: str, sub_env: dict[str, str], tmp_path: Path
) -> None:
    config = tmp_path / "deliverers.toml"
    config.write_text(
        '[kinds."k.start"]\ntype = "python.call"\n'
        'function = "bench.sinks:noop"\nidempotent = true\n'
    )
    log = (tmp_path / "deliver.log").open("wb")
    with psycopg.connect(dsn, autocommit=True) as admin:
        locker = psycopg.connect(dsn)
        locker.execute("LOCK TABLE outbox_migrations IN ACCESS EXCLUSIVE MODE")
        proc = subprocess.Popen(
            [sys.executable, "-m", "outbox", "deliver", "--config", str(config)],
            env=sub_env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for(
                lambda: lock_waiters(dsn, "outbox-cli"),
                timeout=60,
                message="the check waits on the lock",
            )
            for pid in lock_waiters(dsn, "outbox-cli"):
                admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            time.sleep(0.3)
            locker.rollback()  # the lock goes; the check tried again passes
            run = ob.start_run("agent", "1")
            run.transaction("s", lambda tx: tx.intend("k.start", {"n": 1}) and None)
            wait_for(
                lambda: [e.status for e in ob.effects()] == [EffectStatus.SUCCEEDED],
                timeout=60,
                message=f"delivered:\n{(tmp_path / 'deliver.log').read_text()[-3000:]}",
            )
            assert proc.poll() is None
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
        finally:
            locker.close()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    assert "the connection was lost" in (tmp_path / "deliver.log").read_text()
