"""Bad command-line input is one clear line and exit 1 or 2, never a traceback (issue 11, L1).

Every case runs the real ``outbox`` command in its own process. They run side
by side (most of their time is starting Python) so the suite stays quick.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNREACHABLE = "postgresql://nobody@127.0.0.1:1/outbox"
DEEP = "[" * 5000 + "]" * 5000
RUN = "00000000-0000-0000-0000-000000000000"

Case = tuple[str, list[str | bytes], dict[str, str | None]]


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port something already listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _cases(tmp_path: Path, busy_port: int) -> list[Case]:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    port = str(busy_port)
    handler = "tests.fixtures_callables:echo"
    rated = tmp_path / "rated.toml"
    rated.write_text('[kinds."http.request"]\nrate = 5\n')
    worker = ["worker", handler, "--agent", "a", "--version", "1"]
    return [
        ("deliver --lease x", ["deliver", "--lease", "x"], {}),
        ("deliver --lease nan", ["deliver", "--lease", "nan"], {}),
        ("deliver --grace inf", ["deliver", "--grace", "inf"], {}),
        ("deliver --grace nan", ["deliver", "--grace", "nan"], {}),
        ("deliver --poll -1", ["deliver", "--poll", "-1"], {}),
        ("deliver --poll nan", ["deliver", "--poll", "nan"], {}),
        (
            "deliver --from-kafka, a kind with a rate",
            ["deliver", "--config", str(rated), "--from-kafka", "127.0.0.1:1"],
            {},
        ),
        ("worker --lease nan", [*worker, "--lease", "nan"], {}),
        ("worker --lease inf", [*worker, "--lease", "inf"], {}),
        ("worker --lease -1", [*worker, "--lease", "-1"], {}),
        ("relay --dispatch-ttl inf", ["relay", "--kafka", "x:1", "--dispatch-ttl", "inf"], {}),
        (
            "relay --kafka-option acks=1",
            ["relay", "--kafka", "x:1", "--kafka-option", "acks=1"],
            {},
        ),
        (
            "relay --kafka-option retries=0",
            ["relay", "--kafka", "x:1", "--kafka-option", "retries=0"],
            {},
        ),
        ("serve --port 70000", ["serve", "--port", "70000"], {}),
        ("serve --port -1", ["serve", "--port", "-1"], {}),
        ("serve --port busy", ["serve", "--port", port], {}),
        ("serve --host unknown", ["serve", "--host", "no.such.host.invalid"], {}),
        ("serve --host 999.1.1.1", ["serve", "--host", "999.1.1.1"], {}),
        ("serve --secret-file missing", ["serve", "--secret-file", str(tmp_path / "no")], {}),
        ("sink --port 70000", ["sink", "--port", "70000"], {}),
        ("sink --host unknown", ["sink", "--host", "no.such.host.invalid"], {}),
        ("deliver --metrics-port busy", ["deliver", "--metrics-port", port], {}),
        ("gc --older-than 99999999999d", ["gc", "--older-than", "99999999999d"], {}),
        ("gc --older-than 1e22s", ["gc", "--older-than", "9" * 22 + "s"], {}),
        (
            "gc --archive in a missing directory",
            ["gc", "--older-than", "1d", "--archive", str(tmp_path / "no" / "a.jsonl")],
            {},
        ),
        ("OUTBOX_DSN garbage", ["runs", "list"], {"OUTBOX_DSN": "garbage"}),
        ("OUTBOX_DSN mysql", ["runs", "list"], {"OUTBOX_DSN": "mysql://u:pw@h/db"}),
        ("OUTBOX_DSN http, deliver", ["deliver"], {"OUTBOX_DSN": "http://example.com"}),
        ("OUTBOX_DSN unreachable, migrate", ["migrate"], {"OUTBOX_DSN": UNREACHABLE}),
        ("OUTBOX_DSN unreachable, runs", ["runs", "list"], {"OUTBOX_DSN": UNREACHABLE}),
        ("OUTBOX_HOME a file", ["runs", "list"], {"OUTBOX_DSN": None, "OUTBOX_HOME": str(a_file)}),
        (
            "OUTBOX_HOME under a file",
            ["runs", "list"],
            {"OUTBOX_DSN": None, "OUTBOX_HOME": str(a_file / "home")},
        ),
        (
            "OUTBOX_IDLE_IN_TRANSACTION_TIMEOUT_MS unbounded",
            ["runs", "list"],
            {"OUTBOX_IDLE_IN_TRANSACTION_TIMEOUT_MS": "99999999999"},
        ),
        ("non-UTF-8 --agent", ["runs", "list", "--agent", b"\xff\xfe"], {}),
        ("non-UTF-8 signal name", ["signal", RUN, b"appro\xe9al"], {}),
        ("deeply nested --data", ["signal", RUN, "go", "--data", DEEP], {}),
        ("schemas export --dir a file", ["schemas", "export", "--dir", str(a_file)], {}),
        ("runs pause, blank reason", ["runs", "pause", RUN, "--reason", " "], {}),
        ("runs pause, no such run", ["runs", "pause", RUN, "--reason", "hold"], {}),
        ("runs resume, not a run id", ["runs", "resume", "not-a-uuid"], {}),
        ("runs fork, no such run", ["runs", "fork", RUN, "--from", "charge"], {}),
        ("runs fork, control character", ["runs", "fork", RUN, "--from", "a\nb"], {}),
    ]


def _run(case: Case, env: dict[str, str]) -> tuple[str, int, str]:
    name, args, overrides = case
    environ = dict(env)
    for key, value in overrides.items():
        if value is None:
            environ.pop(key, None)
        else:
            environ[key] = value
    done = subprocess.run(
        [sys.executable, "-m", "outbox", *args],
        capture_output=True,
        env=environ,
        cwd=ROOT,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    return name, done.returncode, done.stderr.decode("utf-8", "replace")


@pytest.mark.slow  # 34 processes: about 15 s on two idle cores
def test_bad_cli_input_is_one_line_and_a_non_zero_exit(
    sub_env: dict[str, str], tmp_path: Path, busy_port: int
) -> None:
    env = {**sub_env, "OUTBOX_WEBHOOK_SECRET": "0123456789abcdef0123456789abcdef"}
    cases = _cases(tmp_path, busy_port)
    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(lambda case: _run(case, env), cases))
    wrong = []
    for name, code, stderr in results:
        lines = [line for line in stderr.splitlines() if line.strip()]
        if (
            code not in (1, 2)
            or "Traceback" in stderr
            or len(lines) != 1
            or not lines[0].startswith("error: ")
        ):
            wrong.append(f"{name}: exit {code}: {stderr!r}")
    assert wrong == [], "\n".join(wrong)
    assert len(results) >= 26


@pytest.mark.parametrize(
    "command",
    [["relay", "--kafka", "127.0.0.1:1"], ["deliver", "--from-kafka", "127.0.0.1:1"]],
    ids=["relay", "deliver --from-kafka"],
)
def test_a_kafka_option_kafka_python_refuses_is_a_configuration_error(
    sub_env: dict[str, str], command: list[str]
) -> None:
    """Known only once the producer or consumer is made, after the start: not a traceback."""
    _, code, stderr = _run(("", [*command, "--kafka-option", "bogus=1"], {}), sub_env)
    assert code == 1 and "Traceback" not in stderr, stderr
    assert "error: ConfigurationError: the Kafka" in stderr and "--kafka-option" in stderr, stderr
    assert "bogus" in stderr, stderr


def test_secrets_in_a_bad_dsn_are_not_repeated(sub_env: dict[str, str]) -> None:
    _, code, stderr = _run(
        ("dsn", ["runs", "list"], {"OUTBOX_DSN": "mysql://user:hunter2@db/x"}), sub_env
    )
    assert code == 1
    assert "hunter2" not in stderr
    assert "not PostgreSQL" in stderr


def test_a_refused_argument_names_the_option(sub_env: dict[str, str]) -> None:
    _, code, stderr = _run(("port", ["sink", "--port", "70000"], {}), sub_env)
    assert code == 2
    assert "--port" in stderr and "outbox sink --help" in stderr
    _, code, stderr = _run(("agent", ["runs", "list", "--agent", b"\xff"], {}), sub_env)
    assert code == 2
    assert "not valid UTF-8" in stderr
