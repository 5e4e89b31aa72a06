"""The TypeScript client (clients/typescript) against the embedded PostgreSQL of this suite.

``npm test`` runs its own tests (node's test runner) on a fresh migrated
database, with a real idempotent HTTP sink and ``python -m outbox deliver``
subprocesses it kills with SIGKILL. Keys derived by its ``deriveKey`` are
compared with Python's and SQL's over generated inputs. Node.js and npm are
required: without them these tests fail, they never skip.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deliverers.testing import IdempotentHttpSink
from outbox import Outbox, derive_key
from outbox.check.processes import start_deliverer
from outbox.serve.app import OutboxServer
from outbox.serve.settings import Credentials, ServeSettings

CLIENT = Path(__file__).parents[2] / "clients" / "typescript"

# One build of the client (dist/) at a time: under pytest-xdist these run on one worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("typescript")]


def _npm(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    npm = shutil.which("npm")
    assert npm is not None and shutil.which("node") is not None, "Node.js and npm are required"
    return subprocess.run(
        [npm, *args], cwd=CLIENT, capture_output=True, text=True, timeout=timeout, check=False
    )


API_TOKEN = "ts-api-token-0123456789abcdef"


@contextmanager
def _serving(server: OutboxServer) -> Iterator[OutboxServer]:
    server.start()
    try:
        yield server
    finally:
        server.shutdown()


@pytest.fixture(scope="session")
def built_client() -> Path:
    """The client installed from its lock file (when not yet) and compiled."""
    if not (CLIENT / "node_modules").is_dir():
        done = _npm("ci")
        assert done.returncode == 0, done.stdout + done.stderr
    done = _npm("run", "build")
    assert done.returncode == 0, done.stdout + done.stderr
    return CLIENT / "dist"


def test_the_typescript_clients_tests_pass(
    built_client: Path, dsn: str, sub_env: dict[str, str]
) -> None:
    # test/http.test.ts speaks the HTTP API: to this server, and to one it starts itself.
    credentials = Credentials(api_token=API_TOKEN.encode())
    with (
        IdempotentHttpSink(latency=0.1) as sink,
        Outbox.connect(dsn) as ob,
        _serving(OutboxServer(ob, ServeSettings(port=0, console=False), credentials)) as api,
    ):
        env = {
            **sub_env,
            "OUTBOX_SINK_URL": sink.url,
            "OUTBOX_PYTHON": sys.executable,
            "OUTBOX_API_URL": api.url,
            "OUTBOX_API_TOKEN": API_TOKEN,
        }
        npm = shutil.which("npm")
        assert npm is not None
        done = subprocess.run(
            [npm, "test"], cwd=CLIENT, env=env, capture_output=True, text=True, timeout=900
        )
        assert done.returncode == 0, done.stdout[-20000:] + done.stderr[-5000:]
        assert "# fail 0" in done.stdout
        stats = sink.stats()
    assert stats["duplicate_keys_applied"] == [] and stats["duplicate_operations"] == []
    assert stats["keys_applied"] == 31  # 30 written over SQL, 1 over HTTP


@pytest.fixture
def node_keys(built_client: Path) -> Iterator[subprocess.Popen[str]]:
    script = built_client / "test" / "support" / "derive-keys.js"
    node = shutil.which("node")
    assert node is not None
    with subprocess.Popen(
        [node, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
    ) as process:
        yield process
        assert process.stdin is not None
        process.stdin.close()
        assert process.wait(timeout=30) == 0


TRIPLES = st.lists(
    st.tuples(st.uuids(), st.text().filter(lambda s: "\x00" not in s), st.integers(0, 2**31 - 1)),
    min_size=1,
    max_size=20,
)


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(TRIPLES)
def test_keys_are_the_same_in_python_sql_and_typescript(
    dsn: str, node_keys: subprocess.Popen[str], triples: list[tuple[uuid.UUID, str, int]]
) -> None:
    python = [derive_key(*t) for t in triples]
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT outbox_derive_key(r, s, i) FROM unnest(%s::uuid[], %s::text[], %s::int[])"
            " WITH ORDINALITY AS t(r, s, i, n) ORDER BY n",
            [[t[0] for t in triples], [t[1] for t in triples], [t[2] for t in triples]],
        ).fetchall()
    assert node_keys.stdin is not None and node_keys.stdout is not None
    for run_id, step_id, index in triples:
        node_keys.stdin.write(json.dumps([str(run_id), step_id, index]) + "\n")
    node_keys.stdin.flush()
    typescript = [node_keys.stdout.readline().strip() for _ in triples]
    assert [r[0] for r in rows] == python
    assert typescript == python


EXAMPLE = Path(__file__).parents[2] / "examples" / "polyglot"


def test_the_polyglot_example_runs(
    built_client: Path, dsn: str, sub_env: dict[str, str], tmp_path: Path
) -> None:
    npm = shutil.which("npm")
    assert npm is not None
    if not (EXAMPLE / "node_modules").is_dir():
        done = subprocess.run([npm, "ci"], cwd=EXAMPLE, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
    done = subprocess.run(
        [npm, "run", "build"], cwd=EXAMPLE, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    with IdempotentHttpSink() as sink:
        deliverer = start_deliverer(sub_env, EXAMPLE / "deliverers.toml", tmp_path / "deliver.log")
        try:
            env = {**sub_env, "EMAIL_API_URL": f"{sink.url}/email"}
            outputs = []
            for _ in range(2):  # the second time is a retried request: it replays
                done = subprocess.run(
                    [npm, "start", "--silent", "--", "o-1001", "ada@example.com", "42.50"],
                    cwd=EXAMPLE,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                assert done.returncode == 0, done.stdout + done.stderr
                outputs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        finally:
            deliverer.terminate()
            assert deliverer.wait(timeout=60) == 0, (tmp_path / "deliver.log").read_text()
        stats = sink.stats()
    assert outputs[0] == outputs[1]
    assert outputs[0]["email"] == "succeeded" and outputs[0]["result"]["status"] == 200
    assert stats["operations_applied"] == 1 and stats["duplicate_operations"] == []
    with psycopg.connect(dsn) as conn:
        orders = conn.execute("SELECT id, customer, total FROM shop_orders").fetchall()
        emails = conn.execute("SELECT count(*) FROM outbox_effects").fetchone()
    assert [(o[0], o[1], str(o[2])) for o in orders] == [("o-1001", "ada@example.com", "42.50")]
    assert emails == (1,)


def test_npm_test_without_its_parts_says_how_to_run_it(tmp_path: Path) -> None:
    """No variables and no Python with agent-outbox: one clear message, not 21 failures."""
    node = shutil.which("node")
    assert node is not None, "Node.js is required"
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "node").symlink_to(node)
    done = subprocess.run(
        [node, str(CLIENT / "scripts" / "test.mjs")],
        env={"PATH": str(bare), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "pytest tests/integration/test_typescript_client.py" in done.stderr
    assert "pip install -e '.[test]'" in done.stderr and "OUTBOX_DSN" in done.stderr
