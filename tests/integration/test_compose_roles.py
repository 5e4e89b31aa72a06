"""Issue 27, item 11: compose.yaml's services run as the `outbox roles` roles, for real.

What compose.yaml does, done here against a real PostgreSQL (and, for stream
mode, a real Kafka-protocol broker), with the commands, logins and passwords read
from compose.yaml itself: the one-shot bootstrap (psql, as the superuser, twice:
it is idempotent), `outbox migrate` and `outbox roles` as the owner, then the
deliverers and the relay as their logins, none of them a superuser.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy.engine import make_url

from deliverers.testing import IdempotentHttpSink, TansuBroker
from outbox import Outbox
from outbox.storage.admin.embedded import _bin
from outbox.storage.dsn import libpq_dsn
from tests.support import wait_for
from tests.unit.test_compose import BOOTSTRAP, dsn_login, load_compose

ROOT = Path(__file__).resolve().parents[2]


def as_login(dsn: str, service_dsn: str) -> str:
    """The test database's DSN with the login (user and password) of a compose service."""
    user, password = dsn_login(service_dsn)
    url = make_url(dsn).set(username=user, password=password)
    return url.render_as_string(hide_password=False)


def outbox(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "outbox", *args],
        env={**os.environ, "OUTBOX_DSN": dsn, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    return done


def spawn(dsn: str, log: Path, *args: str) -> subprocess.Popen[bytes]:
    """``outbox ARGS`` as the login of ``dsn``, its output in ``log``."""
    with log.open("wb") as handle:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "outbox", *args],
            env={**os.environ, "OUTBOX_DSN": dsn, "PYTHONUNBUFFERED": "1"},
            stdout=handle,
            stderr=subprocess.STDOUT,
        )


def bootstrap(compose: dict[str, Any], dsn: str) -> None:
    """The bootstrap service's psql command, on the test database, as the superuser."""
    command = list(compose["services"]["bootstrap"]["command"])
    assert command[-2:] == ["-f", "/bootstrap.sql"]
    command[-1] = str(BOOTSTRAP)
    done = subprocess.run(
        [str(_bin("psql")), *command[1:], "-d", libpq_dsn(dsn)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture
def deployed(empty_dsn: str) -> Iterator[dict[str, str]]:
    """compose.yaml's one-shot services, run on a fresh database: DSN per service."""
    compose = load_compose()
    for _ in range(2):
        bootstrap(compose, empty_dsn)
    services = compose["services"]
    dsns = {
        name: as_login(empty_dsn, services[name]["environment"]["OUTBOX_DSN"])
        for name in ("migrate", "roles", "relay", "deliver-1")
    }
    outbox(dsns["migrate"], *services["migrate"]["command"][1:])
    outbox(dsns["roles"], *services["roles"]["command"][1:])
    yield dsns


def test_the_logins_are_not_superusers_and_the_owner_owns_the_tables(
    deployed: dict[str, str], empty_dsn: str
) -> None:
    with psycopg.connect(libpq_dsn(empty_dsn)) as conn:
        flags: dict[str, bool] = dict(
            conn.execute(
                "SELECT rolname, rolsuper OR rolcreaterole OR rolcreatedb OR rolbypassrls"
                " FROM pg_roles WHERE rolname IN ('outbox_owner', 'outbox_relay', 'outbox_deliver')"
            ).fetchall()
        )
        owners = {
            row[0]
            for row in conn.execute(
                "SELECT tableowner FROM pg_tables WHERE tablename LIKE 'outbox\\_%'"
            )
        }
    assert flags == {"outbox_owner": False, "outbox_relay": False, "outbox_deliver": False}
    assert owners == {"outbox_owner"}
    # A deliverer's login cannot intend (it is in outbox_deliverer, not outbox_agent).
    with psycopg.connect(libpq_dsn(deployed["deliver-1"])) as conn, pytest.raises(psycopg.Error):
        conn.execute(
            "INSERT INTO outbox_effects (id, kind, payload, payload_hash, idempotency_key)"
            " VALUES (gen_random_uuid(), 'k', '{}', 'h', 'k')"
        )


def test_a_deliverer_as_its_compose_login_delivers(
    deployed: dict[str, str], empty_dsn: str, tmp_path: Path
) -> None:
    config = tmp_path / "deliverers.toml"
    config.write_text('[kinds."http.request"]\nallow_private = ["127.0.0.1"]\n')
    with IdempotentHttpSink() as sink, Outbox.connect(empty_dsn) as ob:
        run = ob.start_run("agent", "1")
        run.transaction(
            "s", lambda tx: tx.intend("http.request", {"url": f"{sink.url}/ledger"}) and None
        )
        proc = spawn(
            deployed["deliver-1"],
            tmp_path / "deliver.log",
            *("deliver", "--config", str(config), "--poll", "0.1"),
        )
        try:
            wait_for(
                lambda: [e.status.value for e in ob.effects()] == ["succeeded"],
                timeout=30,
                message=f"delivery: {(tmp_path / 'deliver.log').read_text()[-2000:]}",
            )
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        assert sink.stats()["keys_applied"] == 1


@pytest.mark.kafka
@pytest.mark.slow
def test_the_relay_and_a_stream_deliverer_as_their_compose_logins(
    deployed: dict[str, str], empty_dsn: str, tmp_path: Path, kafka_broker: TansuBroker
) -> None:
    from deliverers.testing import TANSU_CONSUMER_TUNING

    config = tmp_path / "deliverers.toml"
    config.write_text('[kinds."http.request"]\nallow_private = ["127.0.0.1"]\n')
    kafka_broker.create_topic("outbox.http.request", partitions=2)
    tuning = [a for k, v in TANSU_CONSUMER_TUNING.items() for a in ("--kafka-option", f"{k}={v}")]
    with IdempotentHttpSink() as sink, Outbox.connect(empty_dsn) as ob:
        run = ob.start_run("agent", "1")
        run.transaction(
            "s",
            lambda tx: (
                [
                    tx.intend("http.request", {"url": f"{sink.url}/ledger", "json": {"n": i}})
                    for i in range(5)
                ]
                and None
            ),
        )
        procs = []
        for name, args in (
            ("relay", ["relay", "--kafka", kafka_broker.bootstrap, "--config", str(config)]),
            (
                "deliver-1",
                [
                    "deliver",
                    "--from-kafka",
                    kafka_broker.bootstrap,
                    "--group",
                    "compose-roles",
                    "--config",
                    str(config),
                    *tuning,
                ],
            ),
        ):
            procs.append(spawn(deployed[name], tmp_path / f"{name}.log", *args))
        try:
            wait_for(
                lambda: [e.status.value for e in ob.effects()] == ["succeeded"] * 5,
                timeout=90,
                message="stream delivery: "
                + " | ".join(p.read_text()[-1500:] for p in sorted(tmp_path.glob("*.log"))),
            )
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(timeout=60)
        stats = sink.stats()
        assert stats["keys_applied"] == 5 and stats["duplicate_keys_applied"] == []
