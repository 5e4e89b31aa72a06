"""The embedded server: started on demand, shared by every process, managed by `outbox db`."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from subprocess import CompletedProcess

import psycopg
import pytest

from outbox import Outbox
from outbox.errors import EmbeddedServerError
from outbox.storage.admin.embedded import EmbeddedServer
from tests.support import embedded_home


def _outbox(
    *args: str, home: Path, env_extra: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "OUTBOX_DSN"}
    env["OUTBOX_HOME"] = str(home)
    env.update(env_extra or {})
    done = subprocess.run(
        [sys.executable, "-m", "outbox", *args],
        env=env,
        text=True,
        capture_output=True,
        timeout=120,
    )
    if check:
        assert done.returncode == 0, done.stderr
    return done


@pytest.fixture
def home() -> Iterator[Path]:
    base = embedded_home()
    path = base / ".outbox"
    yield path
    EmbeddedServer(path).stop(mode="immediate")
    shutil.rmtree(base, ignore_errors=True)


def test_processes_share_one_server_and_the_cli_manages_it(home: Path) -> None:
    status = json.loads(_outbox("db", "status", "--json", home=home).stdout)
    assert status["initialized"] is False and status["running"] is False

    started = json.loads(_outbox("db", "start", "--json", home=home).stdout)
    assert started["running"] is True and started["pid"]

    # A second process (and this one) attach to the same server instead of starting another.
    listed = _outbox("runs", "list", "--json", home=home)
    assert json.loads(listed.stdout) == []
    assert json.loads(_outbox("db", "status", "--json", home=home).stdout)["pid"] == started["pid"]
    with Outbox.connect(home=home) as ob:
        ob.start_run("a", "1")
    assert EmbeddedServer(home).status().pid == started["pid"]
    assert len(json.loads(_outbox("runs", "list", "--json", home=home).stdout)) == 1

    stopped = json.loads(_outbox("db", "stop", "--json", home=home).stdout)
    assert stopped == {"stopped": True}
    assert json.loads(_outbox("db", "status", "--json", home=home).stdout)["running"] is False
    # Data survives a stop; the next command starts the server again, and on a
    # terminal says so while it does.
    shown = _on_a_terminal("runs", "list", home=home)
    assert "starting the embedded PostgreSQL in" in shown and "runs (1, newest first)" in shown
    assert len(json.loads(_outbox("runs", "list", "--json", home=home).stdout)) == 1


def _on_a_terminal(*args: str, home: Path) -> str:
    """What ``outbox ARGS`` shows on a terminal (stdout and stderr on a pseudo-terminal)."""
    import pty

    env = {k: v for k, v in os.environ.items() if k != "OUTBOX_DSN"}
    env["OUTBOX_HOME"] = str(home)
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "outbox", *args],
        env=env,
        stdin=follower,
        stdout=follower,
        stderr=follower,
    )
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the child closed its side
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    assert proc.wait(timeout=120) == 0, shown
    return shown.decode("utf-8", "replace")


def test_with_outbox_dsn_set_nothing_is_started(home: Path, dsn: str) -> None:
    listed = _outbox("runs", "list", "--json", home=home, env_extra={"OUTBOX_DSN": dsn})
    assert json.loads(listed.stdout) == []
    assert not home.exists()
    refused = _outbox("db", "start", home=home, env_extra={"OUTBOX_DSN": dsn}, check=False)
    assert refused.returncode != 0 and "OUTBOX_DSN is set" in refused.stderr


def test_concurrent_first_starts_make_one_server(home: Path) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "outbox", "db", "start", "--json"],
            env={
                **{k: v for k, v in os.environ.items() if k != "OUTBOX_DSN"},
                "OUTBOX_HOME": str(home),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    pids = set()
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        pids.add(json.loads(out)["pid"])
    assert len(pids) == 1


# -- who can connect (H4) -----------------------------------------------------------------

AS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not AS_ROOT, reason="switching OS users needs root")
TRUST_HBA = "local all all trust\nhost all all 127.0.0.1/32 trust\n"


def _modes(paths: list[Path]) -> dict[Path, int]:
    return {p: stat.S_IMODE(p.stat().st_mode) for p in paths}


def _allows_trust(server: EmbeddedServer) -> bool:
    for line in (server.pgdata / "pg_hba.conf").read_text().splitlines():
        if "trust" in line.split("#", 1)[0].split():
            return True
    return False


def _server_uid(server: EmbeddedServer) -> int:
    return pwd.getpwnam(server.run_as).pw_uid if server.run_as else os.geteuid()


def _psql(
    server: EmbeddedServer, user: str | None, role: str = "postgres"
) -> CompletedProcess[str]:
    """``SELECT 1`` through the server's socket, as OS ``user`` (None: this process)."""
    args = [str(server.bin("psql")), "-X", "-w", "-h", str(server.socket_dir)]
    args += ["-U", role, "-d", "outbox", "-c", "SELECT 1"]
    if user is not None:
        args = ["runuser", "-u", user, "--", *args]
    return subprocess.run(args, capture_output=True, text=True, timeout=60)


def _assert_private(server: EmbeddedServer) -> None:
    for directory in {server.socket_dir, server.pgdata}:
        info = directory.stat()
        assert stat.S_IMODE(info.st_mode) == 0o700, directory
        assert info.st_uid == _server_uid(server), directory
    assert not _allows_trust(server)


@pytest.fixture
def long_home() -> Iterator[Path]:
    base = embedded_home()
    path = base / ("d" * 90) / ".outbox"
    yield path
    EmbeddedServer(path).stop(mode="immediate")
    shutil.rmtree(EmbeddedServer(path).socket_dir, ignore_errors=True)
    shutil.rmtree(base, ignore_errors=True)


def test_a_long_data_path_keeps_the_socket_private_and_logins_authenticated(
    long_home: Path,
) -> None:
    above = [p for p in long_home.parents if p.exists()]
    before = _modes(above)
    server = EmbeddedServer(long_home)
    assert len(str(server.pgdata)) >= 86
    dsn = server.ensure_running()
    assert server.socket_dir != server.pgdata, "too long for a socket in the data directory"
    _assert_private(server)
    assert _modes(above) == before, "no directory above the data changed its mode"
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT current_user").fetchone() == ("postgres",)
    assert _psql(server, None).returncode == 0
    if not AS_ROOT:
        return
    # Another local user reaches neither the socket...
    refused = _psql(server, "nobody")
    assert refused.returncode != 0 and "Permission denied" in refused.stderr, refused.stderr
    # ...nor, with the directory opened on purpose, a login without a password.
    socket = server.socket_dir / ".s.PGSQL.5432"
    server.socket_dir.chmod(0o755)
    socket.chmod(0o777)
    try:
        as_superuser = _psql(server, "nobody")
        assert "Peer authentication failed" in as_superuser.stderr, as_superuser.stderr
        as_other_role = _psql(server, "nobody", role="nobody")
        assert as_other_role.returncode != 0
        assert "no password supplied" in as_other_role.stderr, as_other_role.stderr
    finally:
        socket.chmod(0o700)
    # The next attach puts the directory back to private.
    EmbeddedServer(long_home).ensure_running()
    _assert_private(server)


@pytest.mark.slow
def test_a_server_of_an_older_version_is_locked_down_on_the_next_attach(long_home: Path) -> None:
    server = EmbeddedServer(long_home)
    server.ensure_running()
    # What older versions left: trust logins and a world-writable socket directory.
    (server.pgdata / "pg_hba.conf").write_text(TRUST_HBA)
    server._pg_ctl(["reload"])
    server.socket_dir.chmod(0o777)
    if AS_ROOT:
        os.chown(server.socket_dir, 0, 0)
    EmbeddedServer(long_home).ensure_running()
    _assert_private(server)
    if AS_ROOT:
        server.socket_dir.chmod(0o755)
        (server.socket_dir / ".s.PGSQL.5432").chmod(0o777)
        refused = _psql(server, "nobody")
        assert "Peer authentication failed" in refused.stderr, "reloaded, trust is gone"


@needs_root
def test_a_private_directory_above_the_home_is_not_loosened() -> None:
    base = embedded_home()
    try:
        private = base / "private"
        private.mkdir(mode=0o700)
        with pytest.raises(EmbeddedServerError, match=r"cannot enter .*private \(mode 0700"):
            EmbeddedServer(private / "home").ensure_running()
        assert stat.S_IMODE(private.stat().st_mode) == 0o700
        assert not (private / "home" / "pg").exists()
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.slow
@needs_root
def test_a_socket_directory_made_by_another_user_is_refused(long_home: Path) -> None:
    server = EmbeddedServer(long_home)
    nobody = pwd.getpwnam("nobody")
    server.socket_dir.mkdir(mode=0o777)
    os.chown(server.socket_dir, nobody.pw_uid, nobody.pw_gid)
    with pytest.raises(EmbeddedServerError, match="belongs to another user"):
        server.ensure_running()
    assert not server.status().running
